"""E2B's ``get_metrics`` (and the list form ``/sandboxes/metrics``) from the edge's cgroup samples.

Each test runs once per SDK version; both versions have ``get_metrics`` (sync and async).
"""

from __future__ import annotations

import aiohttp

from dsec.node.embedded import EmbeddedNode
from tests.e2b.conftest import E2B

MIB = 1 << 20
HELD_MIB = 300  # what the sandbox's holder process keeps resident
# A holder of HELD_MIB touched bytes (b"x" * n writes every page), then a marker file.
HOLD = (
    f"python3 -c \"import time; b = b'x' * ({HELD_MIB} << 20); "
    "open('/tmp/held', 'w').write('1'); time.sleep(600)\""
)
# 3 s of CPU time (not wall time: a loaded machine takes longer, the figure is the same).
BURN = 'python3 -c "import time\nwhile time.process_time() < 3: pass"'


async def test_memory_and_cpu_show_in_the_samples_and_the_range_filters(e2b: E2B) -> None:
    out = await e2b.run(
        f"""
        import datetime as dt
        sbx = Sandbox.create(timeout=120)
        idle = sbx.get_metrics()
        sbx.commands.run({HOLD!r}, background=True)
        sbx.commands.run("until [ -s /tmp/held ]; do sleep 0.05; done")
        sbx.commands.run({BURN!r}, timeout=120)
        # Samples are taken every 5 s: wait for two of the sampler's besides the fresh one.
        while len(ms := sbx.get_metrics()) < 3:
            time.sleep(0.5)
        # ms[0] and ms[1] are the sampler's, 5 s apart (the last one is the fresh reading)
        before = sbx.get_metrics(end=ms[0].timestamp)
        after = sbx.get_metrics(start=ms[1].timestamp)
        future = sbx.get_metrics(start=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))
        past = sbx.get_metrics(end=dt.datetime(2001, 1, 1, tzinfo=dt.timezone.utc))
        try:
            sbx.get_metrics(start=ms[1].timestamp, end=ms[0].timestamp - dt.timedelta(seconds=2))
            backwards = None
        except Exception as e:
            backwards = str(e)
        def rows(ms):
            return [[m.timestamp.timestamp(), m.cpu_count, m.cpu_used_pct, m.mem_used, m.mem_total,
                     m.mem_cache, m.disk_used, m.disk_total] for m in ms]
        print(json.dumps({{"idle": rows(idle), "all": rows(ms),
                          "after": rows(after), "before": rows(before), "future": rows(future),
                          "past": rows(past), "backwards": backwards}}))
        sbx.kill()
        """,
        timeout=180,
    )
    idle, every = out["idle"], out["all"]
    # A sandbox younger than a sample still has its figure read now (and a sampler's tick may
    # have come between the create and the call: then that sample too).
    assert 1 <= len(idle) <= 2 and all(r[3] < HELD_MIB * MIB for r in idle), idle
    stamps = [r[0] for r in every]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    for _ts, cpus, pct, _used, total, cache, disk_used, disk_total in every:
        assert (cpus, total) == (2, 1024 * MIB), "the sandbox's own limits, not the node's"
        assert 0 <= pct <= 100 and cache >= 0
        assert (disk_used, disk_total) == (0, 0), "no disk_limit_mb: no quota volume to measure"
    assert every[-1][3] >= HELD_MIB * MIB, "the holder's memory is in the sandbox's charge"
    # Each figure is the CPU over its window (since the previous one; the first since the
    # create, just before the idle reading) in % of 2 cores: together they hold the 3 s burnt,
    # however a loaded machine spread them (the first window, read from the idle reading on,
    # is a little short: 2.4 s of 3 leaves room for it).
    starts = [idle[0][0], *stamps[:-1]]
    burnt = sum(r[2] / 100 * 2 * (r[0] - t0) for r, t0 in zip(every, starts, strict=True))
    assert burnt >= 2.4, (burnt, every)
    # whole seconds, as timestampUnix reads: `end` takes its second, `start` from its second
    assert out["before"] == every[:1], "end at the first sample: that one alone"
    assert len(out["after"]) >= 2 and out["after"][0] == every[1], "start at the second: it and later"
    assert out["future"] == [] and out["past"] == []
    assert out["backwards"] and "start time cannot be after end time" in out["backwards"]


async def test_async_sdk_and_other_projects(e2b: E2B) -> None:
    out = await e2b.run(
        """
        import asyncio
        from e2b import AsyncSandbox
        async def main():
            sbx = await AsyncSandbox.create(timeout=120)
            mine = await sbx.get_metrics()
            by_id = await AsyncSandbox.get_metrics(sbx.sandbox_id)
            return sbx.sandbox_id, [m.mem_total for m in mine], [m.cpu_count for m in by_id]
        sid, mine, by_id = asyncio.run(main())
        print(json.dumps({"id": sid, "mine": mine, "by_id": by_id}))
        """
    )
    # One sample per period since the create: a slow machine may already have taken a second.
    assert out["mine"] and set(out["mine"]) == {1024 * MIB}
    assert out["by_id"] and set(out["by_id"]) == {2}
    seen = await e2b.run(
        f"""
        def outcome(sid):
            try:
                return len(Sandbox.get_metrics(sid))
            except Exception as e:
                return type(e).__name__
        print(json.dumps([outcome({out["id"]!r}), outcome("sb-test-1-nothing"), outcome("metrics")]))
        """,
        key=e2b.other_key,
    )
    assert seen == ["SandboxNotFoundException"] * 3, "another project's key learns of no sandbox"


async def test_the_list_form_gives_each_visible_sandbox_its_latest(
    node: EmbeddedNode, e2b_keys: tuple[str, str]
) -> None:
    # A raw HTTP route (no SDK calls it): once, not per SDK version.
    key, other_key = e2b_keys
    url = f"{node.url}/sandboxes/metrics"

    async def create(http: aiohttp.ClientSession, key: str) -> str:
        body = {"templateID": "base", "timeout": 120}
        async with http.post(f"{node.url}/sandboxes", json=body, headers={"X-API-Key": key}) as r:
            assert r.status == 201, await r.text()
            return str((await r.json())["sandboxID"])

    async with aiohttp.ClientSession() as http:
        ids = [await create(http, key), await create(http, key)]
        theirs = await create(http, other_key)
        mine = {"X-API-Key": key}
        asked = ",".join([*ids, theirs, "sb-test-1-nothing", "garbage", ids[0]])
        async with http.get(url, params={"sandbox_ids": asked}, headers=mine) as r:
            status, body = r.status, await r.json()
        too_many = ",".join(f"sb-test-1-{i}" for i in range(101))
        async with http.get(url, params={"sandbox_ids": too_many}, headers=mine) as r:
            many_status, many = r.status, await r.json()
        async with http.get(url, headers=mine) as r:
            missing_status = r.status
        one = f"{node.url}/sandboxes/{ids[0]}/metrics"
        async with http.get(one, params={"start": "-1"}, headers=mine) as r:
            negative_status = r.status
    assert status == 200 and sorted(body["sandboxes"]) == sorted(ids), body
    for m in body["sandboxes"].values():
        assert (m["cpuCount"], m["memTotal"]) == (2, 1024 * MIB) and m["memUsed"] > 0
        assert {"timestamp", "timestampUnix", "cpuUsedPct", "memCache", "diskUsed", "diskTotal"} <= set(m)
    assert many_status == 400 and "maximum is 100" in many["message"]
    assert (missing_status, negative_status) == (400, 400)
