"""A DSec cluster as separate OS processes on one machine: edges in their own network
namespaces, apiservers in the root one, one PostgreSQL IAM and one shared layer store.

Everything is driven through what an operator has: the ``dsec edge`` and ``dsec apiserver``
commands, the SDK, and the IAM database the apiservers share (the test reads the edge
registry there to see epochs and heartbeats).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
from pathlib import Path

from dsec import DSecClient, DSecError
from dsec.backends.container import cgroups
from dsec.iam import open_iam_store
from dsec.images.blobstore import SharedMountBlobStore
from dsec.images.store import LayerStore
from dsec.protocol.ids import SandboxId
from tests.support import DSEC, eventually

from .netns import Netns
from .procs import Proc

# The suite's local store, where tests/conftest.py's base_layer fixture keeps the base layer.
# Not imported from there: mypy --strict over this package would check that module too.
LOCAL_LAYERS = Path(os.environ.get("DSEC_TEST_DATA_DIR", "/var/lib/dsec-test")) / "layers"
NODES = ("edge1", "edge2", "edge3")  # one per network namespace
EDGE_PORT = 8643  # the same on every edge: each has a network namespace of its own
HEARTBEAT_S = 0.5
WATCH_INTERVAL_S = 0.2
# Ten missed heartbeats: the checks made right after an edge is killed still see it unreachable.
NODE_LOST_AFTER_S = 10 * HEARTBEAT_S
CLIENT_TIMEOUT_S = 60.0


def node_of(sandbox_id: str) -> str:
    return SandboxId.parse(sandbox_id).node


def epoch_of(sandbox_id: str) -> int:
    return SandboxId.parse(sandbox_id).epoch


def free_port() -> int:
    # Apiservers listen on every address: edges reach them at the host end of their veth.
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def seed_shared_store(shared: Path, ref: str) -> str:
    """A shared store (new, or one seeded before) holding layer ``ref`` from the local store.

    The blob is hard-linked into the store (no copy of its bytes; ``put`` still hashes it and
    checks the digest) and tagged the same, so no node has to rebuild the base layer.
    """
    fresh = not shared.exists()
    shared.mkdir(exist_ok=True)
    source = LayerStore(LOCAL_LAYERS)
    info = source.resolve(ref)
    store = LayerStore.over(SharedMountBlobStore(shared, create=fresh))
    link = store.tmp_dir / "seed.erofs"
    try:
        os.link(source.blob_path(info.digest), link)
    except OSError:  # another filesystem: one copy of one blob is still cheap enough
        subprocess.run(["cp", "--reflink=auto", str(source.blob_path(info.digest)), str(link)], check=True)
    try:
        store.blobs.put(link, expected=info.digest)
    finally:
        link.unlink(missing_ok=True)
    store.tag(info.digest, ref)
    return info.digest


async def forget_earlier_nodes(pg_dsn: str) -> None:
    """The shared registry at ``pg_dsn`` forgets every node earlier cluster tests registered
    (a provider-started node a test stopped stays registered): a bulk operation by label spans
    every registered node, and one at an address an edge of this test now has would join."""
    home = await open_iam_store(pg_dsn)
    try:
        for record in await home.list_nodes():
            await home.forget_node(record.node)
    finally:
        await home.close()


async def prepare_overflow_iam(tmp: Path, pg_dsn: str, away_url: str, admin_name: str) -> str:
    """The IAM side of a home cluster that overflows to another, "west" at ``away_url``.

    The home registry (the session's shared PostgreSQL at ``pg_dsn``) forgets the nodes earlier
    cluster tests registered there: one at an address an edge of this test now has would join.
    The away cluster's IAM (``tmp/away-iam.sqlite``) gets an admin key named ``admin_name``
    (returned) and project root/burst, whose key (``tmp/west.key``) the home apiservers
    overflow with, as their ``--overflow`` file (``tmp/overflow.json``) says.
    """
    await forget_earlier_nodes(pg_dsn)
    iam = await open_iam_store(str(tmp / "away-iam.sqlite"))
    try:
        away_key = await iam.issue_key(admin=True, name=admin_name)
        await iam.create_project("root", "burst")
        burst_key = await iam.issue_key("root/burst", name="the home cluster")
    finally:
        await iam.close()
    key_file = tmp / "west.key"
    key_file.write_text(burst_key + "\n")
    key_file.chmod(0o600)
    target = {"name": "west", "url": away_url, "api_key_file": str(key_file)}
    overflow = {"threshold": 1.0, "poll_interval_s": 0.2, "targets": [target]}
    (tmp / "overflow.json").write_text(json.dumps(overflow))
    return away_key


class Cluster:
    """Three edges (one per namespace) and two apiservers, started and ended by PID."""

    def __init__(self, tmp: Path, spaces: list[Netns], iam_url: str, shared: Path, key: str) -> None:
        self.tmp = tmp
        self.key = key  # an admin key: the test and the teardown act as the operator
        self.iam_url = iam_url
        self.shared = shared
        self.spaces = dict(zip(NODES, spaces, strict=True))
        self.secret_file = tmp / "cluster-secret"
        self.secret_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.secret_file.chmod(0o600)
        self.api_ports = [free_port(), free_port()]
        self.apis: list[Proc | None] = [None, None]
        self.edges: dict[str, Proc] = {}
        self.started: list[Proc] = []  # every incarnation, for the logs
        self.logs = tmp / "logs"
        self.logs.mkdir()

    @property
    def nodes(self) -> list[str]:
        return list(self.spaces)

    def data_dir(self, node: str) -> Path:
        return self.tmp / "edges" / node

    def api_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.api_ports[index]}"

    def client(self, index: int) -> DSecClient:
        return DSecClient(self.api_url(index), self.key, timeout=CLIENT_TIMEOUT_S)

    def _log(self, name: str) -> Path:
        n = sum(1 for p in self.started if p.name == name)
        return self.logs / f"{name}.{n}.log"

    def _start(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self._log(name))
        self.started.append(proc)
        return proc

    def start_apiserver(self, index: int) -> Proc:
        scratch = self.tmp / f"api{index}-scratch"
        argv = [
            DSEC, "apiserver",
            "--iam", self.iam_url,
            "--shared-layers", str(self.shared),
            "--host", "0.0.0.0",
            "--port", str(self.api_ports[index]),
            "--secret-file", str(self.secret_file),
            "--scratch", str(scratch),
            "--watch-interval", str(WATCH_INTERVAL_S),
            "--node-lost-after", str(NODE_LOST_AFTER_S),
        ]  # fmt: skip
        proc = self._start(f"api{index}", argv)
        self.apis[index] = proc
        return proc

    def start_edge(self, node: str) -> Proc:
        ns = self.spaces[node]
        data = self.data_dir(node)
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            DSEC, "edge",
            "--node", node,
            "--data-dir", str(data),
            "--host", ns.ns_ip,
            "--port", str(EDGE_PORT),
            "--shared-layers", str(self.shared),
            "--secret-file", str(self.secret_file),
            "--heartbeat", str(HEARTBEAT_S),
            "--fncall-pool-size", "1",
            "--swap", "host",  # three edges on one host: none of them adds a swap file
            "--no-microvm",
            "--no-vm",
        ]  # fmt: skip
        for port in self.api_ports:  # at the host end of its own veth: the only way out
            argv += ["--apiserver", f"http://{ns.host_ip}:{port}"]
        proc = self._start(node, ns.enter(argv))
        self.edges[node] = proc
        return proc

    async def start(self) -> None:
        # Everything starts at once and is waited for after: edges retry until an apiserver
        # answers, so the order only saves retries.
        procs = [self.start_apiserver(0), self.start_apiserver(1)]
        procs += [self.start_edge(node) for node in self.nodes]
        for proc in procs:
            await proc.wait_up()
        for index in range(len(self.apis)):
            await self.wait_serving(index)

    async def wait_serving(self, index: int, nodes: list[str] | None = None) -> None:
        """Until apiserver ``index`` has read every edge from the registry and found it healthy."""
        want = set(self.nodes if nodes is None else nodes)
        async with self.client(index) as client:

            async def healthy() -> bool:
                return want <= {n["node"] for n in await client.nodes() if n.get("healthy")}

            await eventually(healthy, f"apiserver {index} to see {sorted(want)} healthy", 30)

    def reports(self) -> str:
        return "\n".join(p.report() for p in self.started)

    # ---- teardown --------------------------------------------------------------------------

    async def close(self) -> list[str]:
        """Stop every sandbox through the API, SIGTERM the edges, end the apiservers.

        Returns what went wrong; every step is attempted whatever failed before. A dead edge
        is started again first so that its sandboxes are stopped through the API, as an
        operator would, rather than left running.
        """
        problems: list[str] = []
        await self._revive(problems)
        await self._stop_sandboxes(problems)
        edges = list(self.edges.items())
        codes = await asyncio.gather(*(asyncio.to_thread(proc.terminate) for _, proc in edges))
        for (node, proc), code in zip(edges, codes, strict=True):
            if code != 0:
                problems.append(f"edge {node} (pid {proc.pid}) did not exit cleanly on SIGTERM: {code}")
        # Stateless: how an apiserver ends does not matter to the cluster, only that it does.
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in self.apis if p is not None))
        for node in self.nodes:
            problems += force_cleanup(self.data_dir(node))
        return problems

    async def _revive(self, problems: list[str]) -> None:
        if not any(p is not None and p.alive() for p in self.apis):
            try:
                await self.start_apiserver(0).wait_up()
            except AssertionError as exc:
                problems.append(f"no apiserver could be started for cleanup: {exc}")
        revived = []
        for node, proc in list(self.edges.items()):
            if not proc.alive():
                try:
                    await self.start_edge(node).wait_up()
                    revived.append(node)
                except AssertionError as exc:
                    problems.append(f"edge {node} could not be restarted for cleanup: {exc}")
        for index, api in enumerate(self.apis):
            if revived and api is not None and api.alive():
                try:
                    await self.wait_serving(index, revived)
                except (AssertionError, DSecError, OSError) as exc:
                    problems.append(f"apiserver {index} did not see {revived} again: {exc}")

    async def _stop_sandboxes(self, problems: list[str]) -> None:
        index = next((i for i, p in enumerate(self.apis) if p is not None and p.alive()), None)
        if index is None:
            problems.append("no apiserver left to stop the sandboxes through")
            return
        try:
            async with self.client(index) as client:
                for sb in await client.list():
                    await sb.stop()

                async def none_left() -> bool:
                    return not await client.list()

                await eventually(none_left, "every sandbox to be stopped")
        except (DSecError, AssertionError, OSError) as exc:
            problems.append(f"stopping the sandboxes through apiserver {index} failed: {exc!r}")


def force_cleanup(data_dir: Path) -> list[str]:
    """Last resort after the API: remove containers still known to this edge's crun state.

    Only this edge's runtime root is looked at, so nothing another test or node runs is
    touched. Anything found here is reported: the API should have stopped it.
    """
    root = data_dir / "run" / "crun"
    if not root.is_dir():
        return []
    listed = subprocess.run(["crun", "--root", str(root), "list", "-q"], capture_output=True, text=True)
    left = listed.stdout.split()
    for sid in left:
        subprocess.run(["crun", "--root", str(root), "delete", "--force", sid], capture_output=True)
        cgroups.remove(sid)
    return [f"container {sid} of {data_dir.name} outlived the API's stop; removed by force" for sid in left]
