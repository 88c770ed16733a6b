"""What network permissions cost: create with a grant, a live grant change, vs a plain create.

    .venv/bin/python bench/egress.py [--n 40] [--runtime gvisor] [--pool 10.233.0.0/16]

An embedded node (containers only) on a scratch data directory sharing `dsec up`'s layer
store, with two permissions naming documentation addresses (nothing needs to answer: the cost
measured is the node's, not the network's). Measured in the same run, each p50/p99 over --n:
  - create without rules (the baseline);
  - create with a grant (the link is made before the create returns);
  - set_network_rules on a running sandbox with no link (first grant: link made);
  - set_network_rules switching one grant for another (an nftables element update).
With --runtime gvisor every create is a gVisor one; its network stack takes its link at start,
so the sandboxes granted later are created with all-False rules (the link made at create) and
their first grant is an element update too.

    .venv/bin/python bench/egress.py --real

The opt-in smoke against the real registries (it needs the internet, so no test runs it): a
node with DSec's default catalogue, the README's Listing 1 rules (pypi on, npm off) plus
debian, then `apt-get install` of python3-pip and `pip install` of a small package inside, and
npm's registry must not resolve. Prints each step's outcome and time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from _node import scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.density.swap import SwapConfig
from dsec.netpolicy.config import EgressConfig

PERMISSIONS = {
    "a": [{"address": "192.0.2.10", "ports": [3141], "names": ["a.test"]}],
    "b": [{"address": "192.0.2.11", "ports": [443, 80], "names": ["b.test"]}],
}


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        await op(i)
        out.append(time.perf_counter() - t)
    return out


def line(name: str, lat: list[float], base: list[float] | None) -> str:
    p50, p99 = pct(lat, 50) * 1e3, pct(lat, 99) * 1e3
    ratio = "" if base is None else f"  {p50 / (pct(base, 50) * 1e3):.2f}x the baseline p50"
    return f"  {name:<46} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms{ratio}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    ap.add_argument("--runtime", choices=["crun", "gvisor"], default="crun")
    ap.add_argument("--pool", default="10.233.0.0/16", help="sandbox link addresses (one per bench run)")
    ap.add_argument("--real", action="store_true", help="the smoke against the real registries instead")
    a = ap.parse_args()
    if a.real:
        await real_smoke(a.layers, a.pool)
        return
    egress = EgressConfig.model_validate({"pool": a.pool, "permissions": PERMISSIONS})
    print(f"cores {os.cpu_count()}  n {a.n}  runtime {a.runtime}")
    async with scratch_node(
        "egress", a.layers, lambda scratch: {"swap": SwapConfig("none"), "egress": egress}
    ) as node:
        async with DSecClient(node.url, node.api_key) as client:
            made = []

            def create(rules: dict[str, bool]) -> Callable[[int], Awaitable[None]]:
                async def op(_: int) -> None:
                    made.append(
                        await client.run_container(
                            DSecContainerRunArgs(
                                container_image="debian:bookworm",
                                runtime=a.runtime,
                                network_rules=rules,
                            )
                        )
                    )

                return op

            await create({})(0)  # warm: layers mounted
            base = await timed(a.n, create({}))
            granted = await timed(a.n, create({"a": True}))
            plain = made[1 : a.n + 1]
            if a.runtime == "gvisor":  # linked at create or never: a later grant needs rules named
                unlinked = await timed(a.n, create({"a": False}))
                plain = made[-a.n :]
            first = await timed(a.n, lambda i: plain[i].set_network_rules({"a": True}))
            swap = await timed(a.n, lambda i: plain[i].set_network_rules({"a": False, "b": True}))
            for sb in made:
                await sb.stop()
        print(line("create, no rules (baseline)", base, None))
        print(line("create with a grant (link made)", granted, base))
        if a.runtime == "gvisor":
            print(line("create, all False (link made, nothing granted)", unlinked, base))
            print(line("set_network_rules: first grant (set update)", first, base))
        else:
            print(line("set_network_rules: first grant (link made)", first, base))
        print(line("set_network_rules: switch grants (set update)", swap, base))


SMOKE = [
    ("npm's registry does not resolve", "! getent hosts registry.npmjs.org"),
    ("apt-get install python3-pip", "apt-get update -qq && apt-get install -y -qq python3-pip >/dev/null"),
    ("pip install six", "pip install -q --no-cache-dir --target /tmp/six six && ls /tmp/six/six.py"),
]


async def real_smoke(layers: Path, pool: str) -> None:
    egress = EgressConfig.model_validate({"pool": pool, "catalogue": True})
    print(f"cores {os.cpu_count()}  permissions {sorted(egress.permissions)}")
    async with scratch_node(
        "egress-real", layers, lambda scratch: {"swap": SwapConfig("none"), "egress": egress}
    ) as node:
        async with DSecClient(node.url, node.api_key) as client:
            sb = await client.run_container(
                DSecContainerRunArgs(
                    container_image="debian:bookworm",
                    memory_limit_mb=4096,
                    cpu_cores_limit=2,
                    network_rules={"npm": False, "pypi": True, "debian": True},
                )
            )
            for what, command in SMOKE:
                t = time.perf_counter()
                r = await sb.run_shell(command, timeout=600)
                ok = "ok" if r.exit_code == 0 else f"FAILED ({r.exit_code}): {(r.stderr or r.stdout)[-300:]}"
                print(f"  {what:<36} {time.perf_counter() - t:6.1f} s  {ok}")
            await sb.stop()


if __name__ == "__main__":
    asyncio.run(main())
