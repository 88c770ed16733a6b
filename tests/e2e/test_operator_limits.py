"""Caps on layer imports as an operator sets them: `dsec up --layer-limits`, a real node.

The upload cap defaults to 16 GiB; an operator lowers it (or the expansion bounds) on the
command line, and an upload past it is refused with 413 before anything is stored. A value
outside the bounds stops `dsec up` before it starts anything.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from dsec import DSecClient
from dsec.images.store import LayerStore
from dsec.protocol.errors import TooLarge
from tests.conftest import DATA_DIR
from tests.support import DSEC, dsec_env, start_dsec_up


def _scratch(layers: Path) -> list[Path]:
    """The store's scratch directory: a refused upload's spooled body must be gone from it."""
    with LayerStore(layers) as store:
        return sorted(store.tmp_dir.iterdir())


def _url_key(config: Path) -> tuple[str, str]:
    data = json.loads(config.read_text())
    return data["url"], data["api_key"]


async def test_an_operators_lower_upload_cap_refuses_a_larger_upload(tmp_path: Path) -> None:
    config, data = tmp_path / "config.json", tmp_path / "node"
    layers = DATA_DIR / "layers"
    tree = tmp_path / "tree"
    (tree / "opt").mkdir(parents=True)
    (tree / "opt/blob").write_bytes(os.urandom(3 << 20))  # 3 MiB of noise: it stays 3 MiB packed
    up = await asyncio.to_thread(
        start_dsec_up, data, layers, config, "caps", "--layer-limits", "upload=2,ratio=4"
    )
    try:
        scratch_before = _scratch(layers)
        async with DSecClient(*_url_key(config)) as client:
            with pytest.raises(TooLarge, match="cap") as refused:
                await client.import_layer(tree, f"caps-{os.getpid()}:1")
            assert refused.value.status == 413
            assert not [r for r in await client.layers() if f"caps-{os.getpid()}:1" in r.names]
        assert _scratch(layers) == scratch_before
    finally:
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.communicate, timeout=60)
    assert up.returncode == 0


@pytest.mark.parametrize(
    "value", ["upload=0", "ratio=0", "expand=1,floor=2", "upload=1.5", "size=3", "upload=-1"]
)
def test_layer_limits_out_of_bounds_stop_dsec_up_before_it_starts(tmp_path: Path, value: str) -> None:
    done = subprocess.run(
        [DSEC, "up", "--data-dir", str(tmp_path / "node"), "--no-base", "--layer-limits", value],
        env=dsec_env(tmp_path / "config.json"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--layer-limits" in done.stderr
    assert not (tmp_path / "node").exists(), "nothing may start on a bad option"
