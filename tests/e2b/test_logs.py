"""E2B's sandbox logs (``GET /v2/sandboxes/{id}/logs`` and the deprecated v1 form) from the edge's
trajectory, through the official SDK's own API client (the SDKs have no method for them; the
CLI's ``e2b sandbox logs`` calls these). Behaviour asserted is E2B's API's
(e2b-dev/infra: handlers/sandbox_logs.go, clusters/resources_local.go): newest first by
default, a cursor in milliseconds, ``level`` a floor, ``search`` a substring, an unknown or
another team's sandbox has no entries, a malformed ID and a limit past 1,000 are 400s."""

from __future__ import annotations

import json

from tests.e2b.conftest import E2B

_CLIENT = """
        import asyncio
        from e2b.connection_config import ConnectionConfig
        from e2b.api.client_sync import get_api_client
        from e2b.api.client_async import get_api_client as get_async_client
        from e2b.api.client.api.sandboxes import get_v_2_sandboxes_sandbox_id_logs as v2
        from e2b.api.client.api.sandboxes import get_sandboxes_sandbox_id_logs as v1
        from e2b.api.client.models.logs_direction import LogsDirection
        from e2b.api.client.models.log_level import LogLevel
        api = get_api_client(ConnectionConfig())
        def entries(sid, **kw):
            res = v2.sync_detailed(sid, client=api, **kw)
            if res.status_code != 200:
                return res.status_code
            return [[e.timestamp.timestamp(), e.level.value, e.message, e.fields.to_dict()]
                    for e in res.parsed.logs]
"""


async def test_a_sandbox_s_commands_and_files_show_in_its_logs(e2b: E2B) -> None:
    out = await e2b.run(
        _CLIENT
        + """
        from e2b import CommandExitException
        sbx = Sandbox.create(timeout=120)
        sbx.commands.run("echo logged-hi")
        try:
            sbx.commands.run("exit 3")
        except CommandExitException:
            pass
        sbx.files.write("/tmp/logged.txt", "x")
        try:
            sbx.files.write("/tmp", "a directory")
        except Exception:
            pass
        sid = sbx.sandbox_id
        newest_first = entries(sid)
        middle = newest_first[len(newest_first) // 2][0]
        cursor = int(middle * 1000)
        async def from_async():
            client = get_async_client(ConnectionConfig())
            res = await v2.asyncio_detailed(sid, client=client, direction=LogsDirection.FORWARD)
            return [e.message for e in res.parsed.logs]
        old = v1.sync_detailed(sid, client=api, start=0)
        print(json.dumps({
            "backward": newest_first,
            "forward": entries(sid, direction=LogsDirection.FORWARD),
            "async_forward": asyncio.run(from_async()),
            "after": entries(sid, direction=LogsDirection.FORWARD, cursor=cursor),
            "before": entries(sid, cursor=cursor),
            "cursor": cursor,
            "errors": entries(sid, level=LogLevel.ERROR),
            "search": entries(sid, search="exit 3"),
            "two": entries(sid, limit=2),
            "v1": [[e.line, e.timestamp.timestamp()] for e in old.parsed.logs],
            "v1_entries": [e.message for e in old.parsed.log_entries],
        }))
        sbx.kill()
        """,
        timeout=180,
    )
    backward, forward = out["backward"], out["forward"]
    assert backward == forward[::-1] and len(forward) >= 8
    stamps = [e[0] for e in forward]
    assert stamps == sorted(stamps)
    messages = [e[2] for e in forward]
    assert out["async_forward"] == messages
    started = next(e for e in forward if e[2].startswith("Process started") and "logged-hi" in e[2])
    assert started[1] == "info" and started[3]["event_type"] == "process_start"
    # A command that exits non-zero ended normally (info); a write that failed is an error.
    ended = [e for e in forward if e[3].get("event_type") == "process_end"]
    assert {e[3].get("exit_code") for e in ended} >= {"0", "3"} and {e[1] for e in ended} == {"info"}
    assert any(e[2] == "Write started: /tmp/logged.txt" for e in forward)
    errors = out["errors"]
    assert errors and all(e[1] == "error" for e in errors)
    failed = next(e for e in errors if e[3].get("path") == "/tmp" and e[3]["event_type"] == "write_end")
    assert "directory" in failed[2] and failed[3]["error"] in failed[2], "the error says why"
    assert out["search"] and all("exit 3" in e[2] for e in out["search"])
    assert out["two"] == backward[:2]
    cursor = out["cursor"] / 1000
    assert out["after"] and all(e[0] >= cursor - 0.001 for e in out["after"])
    assert out["before"] and all(e[0] <= cursor + 0.001 for e in out["before"])
    assert len(out["after"]) + len(out["before"]) >= len(forward)
    # v1: forward from start, each entry also as a raw JSON line
    assert out["v1_entries"] == messages
    assert [json_line_message(line) for line, _ in out["v1"]] == messages


def json_line_message(line: str) -> str:
    decoded = json.loads(line)
    assert {"time", "level", "message"} <= set(decoded)
    return str(decoded["message"])


async def test_logs_the_key_may_not_see_are_empty_and_bad_queries_refused(e2b_latest: E2B) -> None:
    made = 'sbx = Sandbox.create(timeout=120)\nsbx.commands.run("true")\nprint(json.dumps(sbx.sandbox_id))'
    sandbox = await e2b_latest.run(made)
    out = await e2b_latest.run(
        _CLIENT
        + f"""
        sid = {sandbox!r}
        unknown = sid[:-4] + ("aaaa" if not sid.endswith("aaaa") else "bbbb")
        http = api.get_httpx_client()
        print(json.dumps({{
            "unknown": entries(unknown),
            "malformed": entries("not-a-sandbox-id"),
            "too_many": v2.sync_detailed(sid, client=api, limit=1001).status_code,
            "bad_cursor": http.get(f"/v2/sandboxes/{{sid}}/logs?cursor=-1").status_code,
            "bad_level": http.get(f"/v2/sandboxes/{{sid}}/logs?level=loud").status_code,
            "long_search": http.get(f"/v2/sandboxes/{{sid}}/logs?search=" + "x" * 257).status_code,
        }}))
        """,
        key=e2b_latest.other_key,
    )
    assert out == {
        "unknown": [],
        "malformed": 400,
        "too_many": 400,
        "bad_cursor": 400,
        "bad_level": 400,
        "long_search": 400,
    }
    read = _CLIENT + f"        print(json.dumps(entries({sandbox!r})))\n"
    mine = await e2b_latest.run(read)
    theirs = await e2b_latest.run(read, key=e2b_latest.other_key)
    assert theirs == [] and mine != [], "another team's key sees no entries; the owner's does"
