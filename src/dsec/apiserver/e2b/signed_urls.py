"""Which sandbox a signed file URL is for, when nothing in the request says.

With ``E2B_SANDBOX_URL`` set, the SDKs' ``download_url``/``upload_url`` are
``E2B_SANDBOX_URL/files?path=..&signature=..``: no sandbox ID, and a browser or ``curl`` sends no
``E2b-Sandbox-Id``. The signature is ``v1_`` + base64(sha256("path:operation:user:TOKEN[:exp]"))
with TOKEN the sandbox's envd access token, an HMAC of its ID: so the sandbox is the one whose
token makes the signature valid. This module finds it by trying the running sandboxes' tokens.

Cost, measured (``/tmp/decisions-ports.md``): about 1 µs a candidate with its token known
(tokens are kept, one HMAC per sandbox ever), 3 µs without; a search is bounded to
:data:`MAX_CANDIDATES` sandboxes (about 16 ms of CPU at worst), and a signature found is
remembered, so fetching the same URL again costs one check. Searching is work anyone can ask
for, so it gets at most :data:`SEARCH_SHARE` of a core; past that, an unnamed URL is refused
until the budget refills (a URL that names its sandbox never waits on it). A deployment with
``--e2b-domain`` and wildcard DNS never searches: URLs made without ``E2B_SANDBOX_URL`` name
their sandbox in their Host (``49983-ID.<domain>``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections import OrderedDict

from aiohttp import web

from dsec.apiserver.e2b.tokens import EnvdTokens
from dsec.apiserver.sandboxes import SandboxRoutes

MAX_CANDIDATES = 16384  # sandboxes tried by one search
# Searches are unauthenticated work: at most this share of one core goes to them, averaged over
# a second (a burst of bad signatures then costs the fallback, never the apiserver).
SEARCH_SHARE = 0.25
_TOKENS_KEPT = 65536  # known tokens (64 hex characters each: about 8 MiB at most)
_FOUND_KEPT = 4096  # signatures already matched to their sandbox


def signature(path: str, operation: str, user: str | None, token: str, expiration: int | None) -> str:
    """The SDK's ``sandbox/signature.py``."""
    raw = f"{path}:{operation}:{user or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def _remember(cache: OrderedDict[str, str], key: str, value: str, cap: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > cap:
        cache.popitem(last=False)


class SignedUrlFinder:
    def __init__(self, sandboxes: SandboxRoutes, tokens: EnvdTokens) -> None:
        self.sandboxes = sandboxes
        self.tokens = tokens
        self._tokens: OrderedDict[str, str] = OrderedDict()
        self._found: OrderedDict[str, str] = OrderedDict()
        self._budget, self._budget_at = SEARCH_SHARE, time.monotonic()  # seconds of search left

    def _token(self, sandbox_id: str) -> str:
        token = self._tokens.get(sandbox_id)
        if token is None:
            token = self.tokens.issue(sandbox_id)
            _remember(self._tokens, sandbox_id, token, _TOKENS_KEPT)
        return token

    async def _candidates(self) -> list[str]:
        links = list(self.sandboxes.links.values())
        answers = await asyncio.gather(*(link.sandbox_ids() for link in links), return_exceptions=True)
        ids: list[str] = []
        for answer in answers:
            if isinstance(answer, list):  # a node that did not answer holds no candidate now
                ids.extend(answer)
        return ids[:MAX_CANDIDATES]

    async def find(self, request: web.Request) -> str | None:
        """The sandbox whose token signs this ``/files`` request's URL; None if none does (or
        it is malformed or expired: the envd route then says why)."""
        query = request.query
        given = query.get("signature", "")
        try:
            expiration = int(query["signature_expiration"]) if "signature_expiration" in query else None
        except ValueError:
            return None
        if not given.startswith("v1_") or (expiration is not None and expiration < time.time()):
            return None
        operation = "read" if request.method == "GET" else "write"
        path, user = query.get("path", ""), query.get("username")
        # Remembered by signature and operation; the envd route checks the rest against the
        # sandbox named (a signature commits to its path, user and expiry).
        memo = f"{operation} {given}"
        known = self._found.get(memo)
        if known is not None:
            return known
        now = time.monotonic()
        self._budget = min(SEARCH_SHARE, self._budget + (now - self._budget_at) * SEARCH_SHARE)
        self._budget_at = now
        if self._budget <= 0:
            return None
        try:
            for sandbox_id in await self._candidates():
                mine = signature(path, operation, user, self._token(sandbox_id), expiration)
                if hmac.compare_digest(mine, given):
                    _remember(self._found, memo, sandbox_id, _FOUND_KEPT)
                    return sandbox_id
            return None
        finally:
            self._budget -= time.monotonic() - now
