"""A burst past a real cluster: overflow to a second cluster, and a node started on demand.

Home: two apiservers (PostgreSQL IAM) and two small edges (``edge1``, ``edge2``, each admits two
1-core sandboxes), each edge in its own network namespace. Away (the overflow target "west"):
one apiserver (SQLite IAM) and one edge (``edge3``) in a third namespace. Every part is a
separate OS process; sandboxes are real containers. The first home apiserver runs the scale-out
policy (``dsec apiserver --scaling FILE``, provider ``local-netns``): under sustained load it
starts a third home edge, ``burst-1``, in a namespace of its own, registered with both home
apiservers.

The burst fills the home cluster (2 + 2), goes on to the started node and to the other cluster,
and the overflow apiserver is SIGKILLed while creates to it are in flight. Then it is started
again (apiservers hold no state of their own) and every sandbox must be reachable through
either home apiserver: none that a create returned is lost, and every sandbox any edge holds is
listed by both (a create cut off by the SIGKILL may have made one: it is the job's, and the
job's stop ends it), so nothing is leaked. Once the burst is over, the started node, idle,
is drained and stopped by the scaler (scale-in) while its apiserver runs on. Teardown ends
every process, namespace and mount, also after a failure; a provider node still running goes
with the apiserver that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import CapacityExhausted, DSecClient, DSecContainerRunArgs, DSecError, InfraFailure, Sandbox
from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.store import LayerStore
from dsec.protocol.ids import SandboxId
from tests.support import DSEC, eventually

from . import hostscan
from .harness import (
    CLIENT_TIMEOUT_S,
    EDGE_PORT,
    HEARTBEAT_S,
    WATCH_INTERVAL_S,
    force_cleanup,
    free_port,
    prepare_overflow_iam,
    seed_shared_store,
)
from .netns import NETNS_DIR, Netns
from .procs import Proc

HOME_EDGES, AWAY_EDGE, BURST = ("edge1", "edge2"), "edge3", "burst-1"
JOB = {"job": "burst"}
IDLE_S = 20  # the scaler's idle_s: far past the moment between the node's start and its first sandbox
EDGE_ARGS = [
    "--heartbeat", str(HEARTBEAT_S),
    "--fncall-pool-size", "0",
    "--swap", "host",
    "--no-microvm",
    "--no-vm",
]  # fmt: skip


def _two_cores_admitted() -> str:
    """A small node: the CPU limits of two 1-core sandboxes, not three."""
    return f"cpu={2.5 / (os.cpu_count() or 1):.6f}"


class BurstClusters:
    def __init__(self, tmp: Path, spaces: list[Netns], pg_dsn: str, home_key: str) -> None:
        self.tmp = tmp
        self.spaces = {HOME_EDGES[0]: spaces[0], HOME_EDGES[1]: spaces[1], AWAY_EDGE: spaces[2]}
        self.pg_dsn = pg_dsn
        self.home_key = home_key
        self.away_key = ""
        self.secret_file = tmp / "cluster-secret"
        self.secret_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.secret_file.chmod(0o600)
        self.ports = {"a": free_port(), "b": free_port(), "away": free_port()}
        self.apis: dict[str, Proc] = {}
        self.edges: dict[str, Proc] = {}
        self.started: list[Proc] = []
        (tmp / "logs").mkdir()
        (tmp / "edges").mkdir()

    def url(self, api: str) -> str:
        return f"http://127.0.0.1:{self.ports[api]}"

    def client(self, api: str) -> DSecClient:
        return DSecClient(
            self.url(api), self.away_key if api == "away" else self.home_key, timeout=CLIENT_TIMEOUT_S
        )

    def _start(self, name: str, argv: list[str]) -> Proc:
        n = sum(1 for p in self.started if p.name == name)
        proc = Proc(name, argv, self.tmp / "logs" / f"{name}.{n}.log")
        self.started.append(proc)
        return proc

    def start_api(self, api: str) -> Proc:
        side = "away" if api == "away" else "home"
        argv = [
            DSEC, "apiserver",
            "--iam", str(self.tmp / "away-iam.sqlite") if side == "away" else self.pg_dsn,
            "--shared-layers", str(self.tmp / f"{side}-layers"),
            "--host", "0.0.0.0",
            "--port", str(self.ports[api]),
            "--secret-file", str(self.secret_file),
            "--scratch", str(self.tmp / f"{api}-scratch"),
            "--watch-interval", str(WATCH_INTERVAL_S),
        ]  # fmt: skip
        if side == "home":
            argv += ["--overflow", str(self.tmp / "overflow.json")]
        if api == "a":
            argv += ["--scaling", str(self.tmp / "scaling.toml")]
        self.apis[api] = proc = self._start(f"api-{api}", argv)
        return proc

    def start_edge(self, node: str) -> Proc:
        side = "away" if node == AWAY_EDGE else "home"
        ns = self.spaces[node]
        argv = [
            DSEC, "edge",
            "--node", node,
            "--data-dir", str(self.tmp / "edges" / node),
            "--host", ns.ns_ip,
            "--port", str(EDGE_PORT),
            "--shared-layers", str(self.tmp / f"{side}-layers"),
            "--secret-file", str(self.secret_file),
            *EDGE_ARGS,
        ]  # fmt: skip
        for api in ("away",) if side == "away" else ("a", "b"):
            argv += ["--apiserver", f"http://{ns.host_ip}:{self.ports[api]}"]
        if side == "home":
            argv += ["--admission", _two_cores_admitted()]
        self.edges[node] = proc = self._start(node, ns.enter(argv))
        return proc

    async def prepare(self, base_layer: str) -> None:
        for side in ("home", "away"):
            seed_shared_store(self.tmp / f"{side}-layers", base_layer)
        LayerStore.over(SharedMountBlobStore(self.tmp / "away-layers")).mark_public(base_layer)
        self.away_key = await prepare_overflow_iam(self.tmp, self.pg_dsn, self.url("away"), "burst test")
        # Home at 2 of 2.5 admitted cores per edge is 0.8 (0.75: whatever the rounding of the
        # caps) for 0.5 s: one node. Idle for IDLE_S once the burst is over, it is drained and
        # stopped; during the burst it is either loaded or holds sandboxes, never both idle
        # and below the threshold for that long.
        edge_args = ", ".join(json.dumps(a) for a in EDGE_ARGS)
        (self.tmp / "scaling.toml").write_text(
            'provider = "local-netns"\nthreshold = 0.75\nsustain_s = 0.5\ninterval_s = 0.1\n'
            f"idle_s = {IDLE_S}\ndrain_s = 1\nmax_nodes = 1\ncpus = 2.5\n"
            f"[local_netns]\napiserver_ports = [{self.ports['a']}, {self.ports['b']}]\n"
            f'data_root = "{self.tmp / "edges"}"\nedge_args = [{edge_args}]\n'
        )

    async def start(self) -> None:
        procs = [self.start_api(api) for api in ("a", "b", "away")]
        procs += [self.start_edge(node) for node in (*HOME_EDGES, AWAY_EDGE)]
        for proc in procs:
            await proc.wait_up()
        for api in ("a", "b"):
            await self.wait_serving(api, *HOME_EDGES)
        await self.wait_serving("away", AWAY_EDGE)

    async def wait_serving(self, api: str, *nodes: str) -> None:
        async with self.client(api) as client:

            async def healthy() -> bool:
                seen = {n["node"] for n in await client.nodes() if n.get("healthy")}
                return set(nodes) <= seen

            await eventually(healthy, f"apiserver {api} to see {nodes} healthy", 60)

    async def close(self) -> list[str]:
        problems: list[str] = []
        if "away" in self.apis and not self.apis["away"].alive():
            await self.start_api("away").wait_up()  # the west sandboxes are stopped through it
        for api in ("a", "away"):
            try:
                async with self.client(api) as client:
                    for sb in await client.list():
                        await sb.stop()
            except (DSecError, OSError) as exc:
                problems.append(f"stopping the sandboxes through {api} failed: {exc!r}")
        codes = await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in self.edges.values()))
        problems += [
            f"edge {n} did not exit cleanly: {c}" for n, c in zip(self.edges, codes, strict=True) if c
        ]
        # Apiserver a stops the provider's node on its way out (release_provider).
        api_pids = {api: proc.pid for api, proc in self.apis.items()}
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in self.apis.values()))
        problems += self._provider_leftovers(api_pids["a"]) if "a" in api_pids else []
        # The edges stop first, so apiserver a's scaler may see no healthy node and start
        # another (burst-2): stopped while it starts, it must give the host back as well.
        for node in sorted({*self.edges, *self.provided()}):
            problems += force_cleanup(self.tmp / "edges" / node)
        return problems

    def provided(self) -> list[str]:
        """The nodes the provider started (each has a data directory under ``edges``)."""
        return sorted(p.name for p in (self.tmp / "edges").glob("burst-*") if p.is_dir())

    @staticmethod
    def _provider_leftovers(pid: int) -> list[str]:
        """The provider's namespaces (``dsecp-<apiserver pid>-<slot>``) and what runs in them:
        gone once apiserver a exited; ended by PID and reported if not."""
        left = sorted(NETNS_DIR.glob(f"dsecp-{pid}-*"))
        if not left:
            return []
        stray = hostscan.processes_in_netns(hostscan.netns_inode(p) for p in left)
        for p in stray:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        for ns in left:  # its veth goes with it
            subprocess.run(["ip", "netns", "del", ns.name], check=False, capture_output=True)
        return [f"the provider left namespaces {[p.name for p in left]} and processes {stray}"]

    def reports(self) -> str:
        return "\n".join(p.report() for p in self.started)


@pytest.fixture
async def burst(
    base_layer: str, cluster_pg: object, namespaces: list[Netns], admin_key: str, tmp_path: Path
) -> AsyncIterator[BurstClusters]:
    c = BurstClusters(tmp_path, namespaces, cluster_pg.dsn, admin_key)  # type: ignore[attr-defined]
    try:
        await c.prepare(base_layer)
        await c.start()
        yield c
    finally:
        problems = await c.close()
        print(c.reports())
        burst_cgroups = hostscan.sandbox_cgroups(c.provided())
        # A provider node, stopped by scale-in or with its apiserver (even while it starts),
        # removes its cgroup parents too.
        burst_cgroups += [p for n in c.provided() for p in hostscan.node_parents(n, tmp_path / "edges" / n)]
        assert problems == [] and burst_cgroups == [], "\n".join([*problems, *burst_cgroups])


def _where(sb: Sandbox) -> str:
    sid = SandboxId.parse(sb.id)
    return sid.cluster or sid.node


@pytest.mark.slow
async def test_a_burst_fills_home_starts_a_node_overflows_and_survives_the_overflow_apiserver(
    burst: BurstClusters, base_layer: str
) -> None:
    args = DSecContainerRunArgs(container_image=base_layer, cpu_cores_limit=1, labels=JOB)
    made: list[Sandbox] = []
    async with burst.client("a") as a, burst.client("b") as b:
        # Fill home, through both apiservers: two on each edge, then load stays past 0.75.
        for i in range(4):
            made.append(await (a, b)[i % 2].run_container(args))
        assert Counter(map(_where, made)) == {"edge1": 2, "edge2": 2}
        # Home is full: the next creates go to the other cluster, or to the node the provider
        # is starting once it serves (it needs 0.5 s of load and an edge's start-up).
        made += [await b.run_container(args) for _ in range(2)]
        assert {_where(s) for s in made[4:]} <= {"west", BURST}

        async def started() -> bool:
            for client in (a, b):
                if not any(n["node"] == BURST and n.get("healthy") for n in await client.nodes()):
                    return False
            return True

        await eventually(started, f"the provider's {BURST} to serve both home apiservers", 60)
        while Counter(map(_where, made))[BURST] < 2:  # the started node takes what home cannot
            made.append(await a.run_container(args))
            assert _where(made[-1]) == BURST, made[-1].id
        split = Counter(map(_where, made))
        assert split["edge1"] == split["edge2"] == split[BURST] == 2 and set(split) <= {
            *HOME_EDGES,
            BURST,
            "west",
        }

        # Mid-burst: every node at home is full, so these go to west; its apiserver is
        # SIGKILLed once the first of them is made.
        creates = [asyncio.create_task((a, b)[i % 2].run_container(args)) for i in range(4)]
        await asyncio.wait(creates, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.to_thread(burst.apis["away"].kill)
        outcomes = await asyncio.gather(*creates, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # classified, never a bare 500
                assert isinstance(outcome, InfraFailure | CapacityExhausted), repr(outcome)
            else:
                made.append(outcome)
        assert any(not isinstance(o, BaseException) for o in outcomes)
        assert {_where(s) for s in made[6:]} - {BURST} <= {"west"}
        west = [s for s in made if _where(s) == "west"]
        with pytest.raises(InfraFailure):  # down: classified, not hanging
            await west[0].run_shell("true")

        # The overflow cluster's apiserver comes back (stateless); its sandboxes never left.
        await burst.start_api("away").wait_up()
        await burst.wait_serving("away", AWAY_EDGE)

        async def west_reachable() -> bool:
            try:
                return (await west[0].run_shell("true")).exit_code == 0
            except InfraFailure:
                return False

        await eventually(west_reachable, "the home apiservers to reach west again", 30)
        returned = {s.id for s in made}
        for client in (a, b):
            listed = {s.id for s in await client.list(JOB)}
            assert returned <= listed, f"lost: {sorted(returned - listed)}"
            extra = listed - returned  # made by a create the SIGKILL cut off: west's, and the job's
            assert all(SandboxId.parse(i).cluster == "west" for i in extra), sorted(extra)
            for sid in sorted(listed):
                sb = await client.get(sid)
                assert (await sb.run_shell("echo here")).stdout == "here\n", sid
        async with burst.client("away") as away:
            there = {s.id for s in await away.list()}  # the other cluster's own view
        ours = {str(SandboxId.parse(i).within_cluster()) for i in listed if SandboxId.parse(i).cluster}
        assert there == ours, "west holds nothing the home cluster does not list"

        # The job's stop ends every sandbox of the burst, in both clusters: nothing is left.
        await b.stop_all(JOB)
        for client in (a, b):
            assert await client.list(JOB) == []
        async with burst.client("away") as away:
            assert await away.list() == []

        # Scale-in: the started node, idle and the cluster below the threshold, is fenced,
        # found empty after the drain and stopped: its edge and its namespace go, while the
        # apiserver that started it runs on.
        provider_netns = f"dsecp-{burst.apis['a'].pid}-*"
        await eventually(
            lambda: not list(NETNS_DIR.glob(provider_netns)), f"scale-in to stop {BURST}", IDLE_S + 60
        )
        assert burst.apis["a"].alive()

        async def forgotten() -> bool:
            for client in (a, b):
                if any(n["node"] == BURST and n.get("healthy") for n in await client.nodes()):
                    return False
            return True

        await eventually(forgotten, f"both home apiservers to see {BURST} gone", 60)
        assert [s.id for s in await a.list(JOB)] == [], "nothing was lost to the stop"
