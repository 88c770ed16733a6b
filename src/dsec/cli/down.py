"""``dsec down``: the end of a node ``dsec up`` ran. Ctrl-C stops serving and leaves its
sandboxes running (the next ``dsec up`` re-adopts them); this stops those sandboxes too and
gives the host back what the node took: their processes, mounts, cgroups and network
namespaces, the node's cgroup parents, layer mounts and its swap file. Layers, keys and the
data directory stay (``rm -rf`` it to drop those too).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from dsec.cli._common import _fail, console
from dsec.cli._node_options import MicroVMOption, VMOption
from dsec.density.swap import Swap, SwapConfig, active_swaps
from dsec.node.embedded import DEFAULT_DATA_DIR, EmbeddedNode, NodeConfig
from dsec.protocol.errors import Conflict, DSecError
from dsec.sdk.config import config_path


def _data_dir_of(pid: str, argv: list[str]) -> Path:
    for i, arg in enumerate(argv):
        if arg == "--data-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--data-dir="):
            return Path(arg.partition("=")[2])
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(b"DSEC_DATA_DIR="):
                return Path(os.fsdecode(entry.partition(b"=")[2]))
    return DEFAULT_DATA_DIR


def serving_pid(data_dir: Path) -> int | None:
    """A running `dsec up` or `dsec edge` on ``data_dir``: two nodes must never share one."""
    want = data_dir.resolve()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = [os.fsdecode(a) for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            at = next(i for i, a in enumerate(argv[:3]) if Path(a).name == "dsec")
            if argv[at + 1 : at + 2] not in (["up"], ["edge"]):
                continue
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
        except (OSError, StopIteration):
            continue
        if (cwd / _data_dir_of(pid, argv)).resolve() == want:
            return int(pid)
    return None


def down(
    data_dir: Annotated[Path, typer.Option("--data-dir", envvar="DSEC_DATA_DIR")] = Path("/var/lib/dsec"),
    node: Annotated[str, typer.Option(help="the node's name, as given to `dsec up`")] = "local",
    layer_dir: Annotated[Path | None, typer.Option(help="as given to `dsec up`")] = None,
    microvm: MicroVMOption = True,
    vm: VMOption = True,
) -> None:
    """Stop a node's sandboxes (stop `dsec up` with Ctrl-C first) and release what it holds on
    the host; prints how many sandboxes it stopped."""
    pid = serving_pid(data_dir)
    if pid is not None:
        raise _fail(Conflict(f"a node runs on {data_dir} (process {pid}): stop it (Ctrl-C) first"))
    if not data_dir.exists():
        console.print(f"nothing to do: no node state in {data_dir}")
        return
    scratch = data_dir / "down-config.json"
    with contextlib.suppress(OSError):  # the key `dsec up` issued, so none is issued for this
        shutil.copyfile(config_path(), scratch)
    # The node comes up as `dsec up` would (to re-adopt what runs), serving on a loopback port
    # of its own, without swap (turning it on only to turn it off) or FnCall pools.
    config = NodeConfig(
        data_dir=data_dir,
        port=0,
        node=node,
        layer_dir=layer_dir,
        config_file=scratch,
        edge={"swap": SwapConfig("none"), "ksm": True},
        microvm=microvm,
        vm=vm,
    )

    async def stop_all() -> int:
        emb = EmbeddedNode(config)
        await emb.start()
        try:
            count = int(emb.edge.stats()["running"])
        finally:
            await emb.close(stop_sandboxes=True)
        return count

    try:
        stopped = asyncio.run(stop_all())
    except DSecError as exc:
        raise _fail(exc) from None
    finally:
        scratch.unlink(missing_ok=True)
    swap = Swap(SwapConfig("file"), data_dir).path  # the swap file `dsec up` makes by default
    if str(swap.resolve()) in active_swaps():
        subprocess.run(["swapoff", str(swap)], check=False, capture_output=True)
    console.print(f"node {node} is down: stopped {stopped} sandboxes; its data stays in {data_dir}")
