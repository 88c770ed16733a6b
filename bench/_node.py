"""An embedded node for a benchmark: a scratch data directory sharing `dsec up`'s layer store."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from dsec.density.swap import SwapConfig
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
