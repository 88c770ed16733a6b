"""envd access tokens: what lets a caller into one sandbox's in-sandbox API without an API key.

E2B hands each sandbox an ``envdAccessToken`` at create and connect; the SDK sends it as
``X-Access-Token`` on every envd request and signs download/upload URLs with it. Here a token
is an HMAC of the sandbox ID under a secret every apiserver instance shares, so any instance
checks any token with no lookup and no state, and a restart keeps tokens valid. A token never
expires on its own: it dies with its sandbox (the envd routes answer "not found" after that).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from dsec.protocol.errors import Unauthorized

# envd's words for an expired signed URL (E2B's SDK suite checks the body).
EXPIRED_SIGNATURE = "signature is already expired"

_TOKEN_CONTEXT = b"dsec-e2b-envd-token-v1"
_SECRET_BYTES = 32


def secret_from_cluster(cluster_secret: str) -> bytes:
    """The token secret of a cluster's apiservers, derived from the secret they already share
    (derived, not the cluster secret itself: a token must never reveal anything about it)."""
    return hmac.new(cluster_secret.encode(), _TOKEN_CONTEXT, hashlib.sha256).digest()


def secret_from_file(path: Path) -> bytes:
    """A random secret kept in ``path`` (made on first use, mode 0600): ``dsec up`` restarts
    on the same data directory keep every token valid."""
    try:
        data = path.read_bytes()
        if len(data) >= _SECRET_BYTES:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(_SECRET_BYTES))
    try:
        os.link(tmp, path)  # two first starts at once: one secret wins, both read it
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


class EnvdTokens:
    def __init__(self, secret: bytes | None = None) -> None:
        # No secret given: this process alone can check its tokens (tests, throwaway servers).
        self._secret = secret if secret is not None else secrets.token_bytes(_SECRET_BYTES)

    def issue(self, sandbox_id: str) -> str:
        mac = hmac.new(self._secret, _TOKEN_CONTEXT + b"\0" + sandbox_id.encode(), hashlib.sha256)
        return mac.hexdigest()

    def issue_traffic(self, sandbox_id: str) -> str:
        """The sandbox's ``trafficAccessToken`` (its ports, when created with
        ``allow_public_traffic=False``): the same scheme over another name (an ID never holds
        ``:``), so neither token opens what the other does."""
        return self.issue(f"traffic:{sandbox_id}")

    def check(self, sandbox_id: str, token: str | None) -> None:
        """Raise :class:`Unauthorized` unless ``token`` is ``sandbox_id``'s token."""
        if not token or not hmac.compare_digest(self.issue(sandbox_id), token):
            raise Unauthorized(f"missing or wrong envd access token for sandbox {sandbox_id}")

    def check_signature(
        self,
        sandbox_id: str,
        path: str,
        operation: str,
        user: str | None,
        signature: str | None,
        expiration: int | None,
    ) -> None:
        """Check a signed download/upload URL as the SDK's ``sandbox/signature.py`` makes them:
        ``v1_`` + unpadded base64 of sha256("path:operation:user:token[:expiration]")."""
        if not signature:
            raise Unauthorized("missing signature")
        if expiration is not None and expiration < time.time():
            raise Unauthorized(EXPIRED_SIGNATURE)
        token = self.issue(sandbox_id)
        raw = f"{path}:{operation}:{user or ''}:{token}"
        if expiration is not None:
            raw += f":{expiration}"
        digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
        if not hmac.compare_digest(f"v1_{digest}", signature):
            raise Unauthorized("bad signature")
