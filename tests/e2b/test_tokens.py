"""envd access tokens: stateless, per sandbox, shared by apiservers, and URL signatures as the
SDKs compute them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.apiserver.e2b.tokens import EnvdTokens, secret_from_cluster, secret_from_file
from dsec.protocol.errors import Unauthorized
from tests.e2b.conftest import E2B

SID = "sb-test-1-abcdef"


def test_a_token_opens_its_sandbox_only() -> None:
    tokens = EnvdTokens(b"k" * 32)
    token = tokens.issue(SID)
    tokens.check(SID, token)
    for sid, bad in ((SID, None), (SID, ""), (SID, token[:-1] + "0"), ("sb-test-1-other", token)):
        with pytest.raises(Unauthorized):
            tokens.check(sid, bad)
    with pytest.raises(Unauthorized):
        EnvdTokens(b"j" * 32).check(SID, token)  # another secret: another cluster


def test_secrets_are_shared_where_they_must_be(tmp_path: Path) -> None:
    first = secret_from_file(tmp_path / "secret")
    assert secret_from_file(tmp_path / "secret") == first, "a restart keeps tokens valid"
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    cluster = secret_from_cluster("s" * 16)
    assert cluster == secret_from_cluster("s" * 16) != secret_from_cluster("t" * 16)
    assert b"s" * 16 not in cluster


async def test_url_signatures_match_the_sdks(e2b: E2B) -> None:
    tokens = EnvdTokens(b"k" * 32)
    token = tokens.issue(SID)
    signed = await e2b.run(
        f"""
        from e2b.sandbox.signature import get_signature
        print(json.dumps([get_signature("/tmp/a b.txt", "read", "user", "{token}", 300),
                          get_signature("/x", "write", None, "{token}")]))
        """
    )
    read, write = signed
    tokens.check_signature(SID, "/tmp/a b.txt", "read", "user", read["signature"], read["expiration"])
    tokens.check_signature(SID, "/x", "write", None, write["signature"], None)
    with pytest.raises(Unauthorized):
        tokens.check_signature(SID, "/x", "read", None, write["signature"], None)
    with pytest.raises(Unauthorized, match="expired"):
        tokens.check_signature(SID, "/tmp/a b.txt", "read", "user", read["signature"], 1)
