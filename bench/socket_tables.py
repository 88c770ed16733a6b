"""What a sandbox's own socket hash tables change: reading its /proc/net/tcp (what ss, netstat
and port probes do) with the host's shared table against its own, in one run.

    .venv/bin/python bench/socket_tables.py [--reads 300] [--rounds 3]

An embedded node on a scratch data directory; two debian:bookworm sandboxes, one created while
the node's ``tcp_child_ehash_entries``/``udp_child_hash_entries`` are 0 (its namespace shares
the host's tables, as every namespace did before the edge set them) and one after the edge set
them (backends/container/backend.py). In each, a Python loop times --reads reads of
/proc/net/tcp, tcp6 and udp, the two sandboxes taking turns --rounds times; p50/p99 per read
over all rounds. A read walks every bucket of the table, empty or not: the host's is sized by
its memory.

The shared sandbox is made by setting those two host-wide knobs to 0 for the length of one
create: every network namespace made meanwhile, by anyone, shares the host's tables. So the
benchmark refuses to run beside another node (named in its message), and puts the knobs back
however it ends (also on SIGTERM or SIGHUP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from _node import other_nodes, scratch_node
from _stats import pct
from dsec import DSecClient, DSecContainerRunArgs
from dsec.backends.container.backend import CHILD_SOCKET_TABLES
from dsec.sdk.client import Sandbox

FILES = ("tcp", "tcp6", "udp")
PROBE = """
import json, sys, time
out = {}
for name in sys.argv[2:]:
    times = []
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        with open("/proc/net/" + name, "rb") as f:
            f.read()
        times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out))
"""


async def reads(sb: Sandbox, n: int) -> dict[str, list[float]]:
    out = await sb.run_shell(f"python3 -c '{PROBE}' {n} {' '.join(FILES)}", timeout=600)
    if out.exit_code != 0:
        raise RuntimeError(out.stderr)
    parsed: dict[str, list[float]] = json.loads(out.stdout)
    return parsed


async def create(client: DSecClient, shared: bool) -> Sandbox:
    saved = {knob: knob.read_text() for knob in CHILD_SOCKET_TABLES}
    if shared:
        for knob in CHILD_SOCKET_TABLES:
            knob.write_text("0\n")
    try:
        return await client.run_container(
            DSecContainerRunArgs(container_image="debian:bookworm", memory_limit_mb=128)
        )
    finally:
        for knob, value in saved.items():
            knob.write_text(value)


async def main(n: int, rounds: int, layers: Path) -> None:
    if not all(knob.exists() for knob in CHILD_SOCKET_TABLES):
        raise SystemExit("this kernel has no per-namespace socket tables (Linux 6.2+)")
    if others := other_nodes():
        raise SystemExit(
            "socket_tables sets tcp_child_ehash_entries/udp_child_hash_entries host-wide while it "
            "creates a sandbox: it does not run beside another node, and these run here: " + ", ".join(others)
        )
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through create()'s finally: knobs back
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    host = Path("/proc/sys/net/ipv4/tcp_ehash_entries").read_text().strip()
    async with scratch_node("sockets", layers) as node, DSecClient(node.url, node.api_key) as client:
        # The node stops both with itself.
        boxes = {"shared": await create(client, shared=True), "own": await create(client, shared=False)}
        for label, sb in boxes.items():
            sizes = await sb.run_shell("cat /proc/sys/net/ipv4/tcp_ehash_entries")
            print(f"{label}: tcp_ehash_entries in the sandbox {sizes.stdout.strip()} (host {host})")
        times: dict[str, dict[str, list[float]]] = {label: {f: [] for f in FILES} for label in boxes}
        for _ in range(rounds):
            for label, sb in boxes.items():
                for name, xs in (await reads(sb, n)).items():
                    times[label][name] += xs
    print(f"{os.cpu_count()} cores; {n} reads x {rounds} rounds per file; microseconds per read")
    print(f"{'file':6} {'shared p50':>11} {'p99':>9} {'own p50':>9} {'p99':>9} {'shared/own p50':>15}")
    for name in FILES:
        s, o = times["shared"][name], times["own"][name]
        print(
            f"{name:6} {pct(s, 50) * 1e6:11.0f} {pct(s, 99) * 1e6:9.0f} {pct(o, 50) * 1e6:9.0f} "
            f"{pct(o, 99) * 1e6:9.0f} {pct(s, 50) / pct(o, 50):14.1f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=Path, default=Path("/var/lib/dsec/layers"))
    a = parser.parse_args()
    asyncio.run(main(a.reads, a.rounds, a.layers))
