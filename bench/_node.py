"""An embedded node for a benchmark: a scratch data directory sharing `dsec up`'s layer store."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from dsec.backends.container import cgroups
from dsec.density.swap import SwapConfig
from dsec.images.mount import mounts_under
from dsec.node.embedded import EmbeddedNode, NodeConfig


@contextlib.asynccontextmanager
async def scratch_node(
    name: str, layers: Path, edge: Callable[[Path], dict[str, Any]] | None = None
) -> AsyncIterator[EmbeddedNode]:
    """A started node named ``bench`` (``edge(scratch)`` its edge settings; default: no swap),
    closed with every sandbox it holds and its directory removed however the bench ends."""
    scratch = Path(tempfile.mkdtemp(prefix=f"dsec-bench-{name}-"))
    config = NodeConfig(
        data_dir=scratch,
        layer_dir=layers,
        port=0,
        node="bench",
        config_file=scratch / "config.json",
        edge=edge(scratch) if edge is not None else {"swap": SwapConfig("none")},
    )
    node = EmbeddedNode(config)
    try:
        await node.start()
        yield node
    finally:
        await node.close(stop_sandboxes=True)
        shutil.rmtree(scratch, ignore_errors=True)


def other_nodes(but: Path | None = None) -> list[str]:
    """The other nodes on this host (a `dsec up`, a test suite, another benchmark), each as its
    parent cgroup and, when its runtime directory is still mounted, its data directory: what a
    benchmark that changes something host-wide names when it refuses to run beside them."""
    dirs = {}
    for m in mounts_under(Path("/")):
        if m.source == "dsec-runtime":  # every node's runtime tmpfs: <data directory>/runtime
            data = Path(m.mount_point).parent
            dirs[cgroups.data_dir_digest(data)] = data
    own = cgroups.data_dir_digest(but) if but is not None else None
    out = []
    for parent in cgroups.parents():
        digest = parent.rsplit("-", 1)[-1]
        held = any((cgroups.CGROUP_ROOT / "memory" / parent).glob("*/sb-*"))
        if digest == own or not (held or digest in dirs):  # an empty parent left by a dead node
            continue
        out.append(f"{parent} (data directory {dirs[digest]})" if digest in dirs else parent)
    return out
