"""E2B's network ``rules`` (per-host header transforms) and ``Secret.fill`` placeholders through
the official SDK (2.63): a request from inside to the host gets the headers with the secret's
value, an update of the secret reaches running sandboxes and a delete takes its header away,
the sandbox's info shows the placeholder and never the value, ``update_network`` replaces
them, and E2B's validation answers as E2B's (``validateNetworkRules``).

The host is the mirror's ``web.public.test`` (tests/netpolicy/mirror.py), in ``allow_out`` as
E2B's users write it: a domain of the sandbox's own, opened by name where the node opens public
addresses (the test node's ``public-web``), so the edge reads its requests.
"""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
import pytest

from tests.e2b.conftest import E2B
from tests.e2e.test_egress import the_mirror  # noqa: F401 (a fixture)
from tests.netpolicy import mirror

RUN = uuid.uuid4().hex[:8]

_SNIPPET = """
import asyncio
from e2b import AsyncSandbox, Secret
NAME, HOST, VALUE = {name!r}, {host!r}, {value!r}
RULES = {{HOST: [{{"transform": {{"headers": {{"Authorization": "Bearer " + Secret.fill(NAME)}}}}}}]}}
NET = {{"allow_out": [HOST], "deny_out": ["0.0.0.0/0"], "rules": RULES}}
FETCH = f"curl -sS --max-time 20 -H 'Authorization: mine' https://{{HOST}}/headers"
Secret.create(NAME, VALUE)
try:
    sbx = Sandbox.create(timeout=120, network=NET)
    sent = json.loads(sbx.commands.run(FETCH).stdout)
    Secret.update(NAME, VALUE + "-2")  # running sandboxes follow, as E2B's egress resolves per request
    updated = json.loads(sbx.commands.run(FETCH).stdout)
    info = sbx.get_info()
    sbx.update_network({{"allow_out": [HOST], "deny_out": ["0.0.0.0/0"]}})
    # Spliced end to end again: the mirror's own (self-signed) certificate, hence -k.
    after = json.loads(sbx.commands.run(FETCH + " -k").stdout)
    sbx.kill()

    async def main():
        a = await AsyncSandbox.create(timeout=120, network=NET)
        out = json.loads((await a.commands.run(FETCH)).stdout)
        Secret.destroy(NAME)  # the header naming it goes, and the host is spliced again (-k)
        gone = json.loads((await a.commands.run(FETCH + " -k")).stdout)
        await a.kill()
        return [out, gone]

    print(json.dumps({{"sent": sent, "updated": updated, "after": after, "async": asyncio.run(main()),
                      "info": str(info), "rules": info.network and info.network.get("rules")}}))
finally:
    Secret.destroy(NAME)
"""


def header(sent: list[list[str]], name: str) -> list[str]:
    return [v for k, v in sent if k.lower() == name.lower()]


async def test_a_rule_s_headers_reach_the_host_with_the_secret_filled(
    the_mirror: None,  # noqa: F811
    e2b_latest: E2B,
) -> None:
    name, value = f"nr-{RUN}", f"sk-{uuid.uuid4().hex}"
    out = await e2b_latest.run(_SNIPPET.format(name=name, host=mirror.PUBLIC_NAME, value=value), timeout=240)
    assert header(out["sent"], "Authorization") == [f"Bearer {value}"]  # set, not added
    assert header(out["updated"], "Authorization") == [f"Bearer {value}-2"]
    made, gone = out["async"]
    assert header(made, "Authorization") == [f"Bearer {value}-2"]
    assert header(gone, "Authorization") == ["mine"]
    assert header(out["after"], "Authorization") == ["mine"]  # update_network cleared the rule
    assert value not in out["info"]
    placeholder = "Bearer ${e2b.secrets." + name + "}"
    assert out["rules"] == {mirror.PUBLIC_NAME: [{"transform": {"headers": {"Authorization": placeholder}}}]}


def _rules(**headers: str) -> dict[str, Any]:
    return {mirror.DNS_NAME: [{"transform": {"headers": headers}}]}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({f"h{i}.dns.test": [] for i in range(11)}, "Network rules can have at most 10 domains."),
        ({"bad domain": []}, "Rule domain 'bad domain' is not a valid domain name."),
        ({mirror.DNS_NAME: [{}, {}]}, f"Domain '{mirror.DNS_NAME}' can have at most 1 transform rule."),
        (_rules(**{"Bad Name": "x"}), "must contain only valid HTTP token characters"),
        (_rules(A="x\ny"), "contains invalid characters"),
        (_rules(A="${e2b.secrets.}"), "Network transform header contains a malformed E2B placeholder."),
        (_rules(A="${e2b.secrets.a"), "Network transform header contains a malformed E2B placeholder."),
        (_rules(A="${e2b.identity.tokens.aws}"), "workload identity tokens"),
        (_rules(A="${e2b.secrets.nr-missing-" + RUN + "}"), "does not exist in this project"),
        (_rules(Host="evil"), "frames the request"),
    ],
)
async def test_e2b_s_rule_checks_answer_400_before_anything_is_made(
    e2b_latest: E2B, rules: dict[str, Any], message: str
) -> None:
    body = {"templateID": "base", "timeout": 60, "network": {"allow_out": ["mirror-dns"], "rules": rules}}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{e2b_latest.url}/sandboxes", json=body, headers={"X-API-Key": e2b_latest.key}) as r,
    ):
        answer = await r.json()
    assert r.status == 400 and message in answer["message"], answer


async def test_workload_identity_gets_e2b_s_checks_then_e2b_s_answer_to_a_team_without_it(
    e2b_latest: E2B,
) -> None:
    """``iam`` as E2B's API takes it (``buildSandboxIam``): its checks and messages, then the 400
    it gives every team whose ``enable-sandbox-iam-tokens`` flag is off. An empty token map is
    no workload identity at all: the sandbox is made."""
    out = await e2b_latest.run(
        """
        import asyncio
        from e2b import AsyncSandbox, Secret
        def tried(iam):
            try:
                Sandbox.create(timeout=60, iam=iam).kill()
                return "made"
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        async def tried_async(iam):
            try:
                await (await AsyncSandbox.create(timeout=60, iam=iam)).kill()
                return "made"
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        tok = Secret.iam_token(audience="sts.amazonaws.com", token_type="JWT-SVID")
        print(json.dumps({
            "one": tried({"tokens": {"aws": tok}}),
            "one async": asyncio.run(tried_async({"tokens": {"aws": tok}})),
            "many": tried({"tokens": {f"t{i}": tok for i in range(6)}}),
            "audience": tried({"tokens": {"aws": {"audience": "", "token_type": "JWT-SVID"}}}),
            "type": tried({"tokens": {"aws": {"audience": "x", "token_type": "OIDC"}}}),
            "empty": tried({"tokens": {}}),
        }))
        """,
        timeout=120,
    )
    assert out["one"].endswith("Sandbox IAM workload tokens are not available for your team."), out
    assert out["one async"] == out["one"]
    assert out["many"].endswith("iam.tokens: too many tokens: 6 (max 5)"), out
    assert out["audience"].endswith("iam.tokens.aws.audience: audience is required"), out
    assert out["type"].endswith('iam.tokens.aws.tokenType: only "JWT-SVID" is supported'), out
    assert out["empty"] == "made"
    assert all(v.startswith("SandboxException: 400: ") for k, v in out.items() if k != "empty"), out


async def test_a_rule_for_a_host_reached_only_by_address_is_refused(e2b_latest: E2B) -> None:
    """``public-web`` opens addresses, which the edge splices unread: no header could be added
    there (the host must be in ``allow_out`` too, as E2B asks), so the create says so instead of
    sending the request without it."""
    body = {
        "templateID": "base",
        "timeout": 60,
        "network": {"allow_out": ["public-web"], "rules": _rules(A="b")},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{e2b_latest.url}/sandboxes", json=body, headers={"X-API-Key": e2b_latest.key}) as r,
    ):
        answer = await r.json()
    assert r.status == 400 and "naming its domain" in answer["message"], answer
