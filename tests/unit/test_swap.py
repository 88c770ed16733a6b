"""The swap the edge manages for paused sandboxes: the ``--swap`` forms an operator writes, and a
real swap file that is turned on once, shared by whoever finds it on, and turned off only by its
owner."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.density.swap import Swap, SwapConfig, active_swaps
from dsec.protocol.errors import InvalidRequest


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", SwapConfig("none", 4096, None)),
        ("host", SwapConfig("host", 4096, None)),
        ("file", SwapConfig("file", 4096, None)),
        ("file:128", SwapConfig("file", 128, None)),
        ("file:128:/srv/dsec/edge.swap", SwapConfig("file", 128, Path("/srv/dsec/edge.swap"))),
        ("file::/srv/edge.swap", SwapConfig("file", 4096, Path("/srv/edge.swap"))),
        ("file:64:/mnt/a:b.swap", SwapConfig("file", 64, Path("/mnt/a:b.swap"))),  # only the first ':'
        ("zram", SwapConfig("zram", 4096, None)),
        ("zram:512", SwapConfig("zram", 512, None)),
        ("zram:16777216", SwapConfig("zram", 1 << 24, None)),  # 16 TiB: the largest
    ],
)
def test_the_swap_forms_an_operator_writes(text: str, expected: SwapConfig) -> None:
    assert SwapConfig.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "say none, host"),
        ("swapfile", "say none, host"),
        ("FILE:128", "say none, host"),
        ("file:lots", "number of MiB"),
        ("file:1.5", "number of MiB"),
        ("file:63", "64 MiB to 16 TiB"),
        ("zram:0", "64 MiB to 16 TiB"),
        ("zram:-512", "64 MiB to 16 TiB"),
        ("file:16777217", "64 MiB to 16 TiB"),
        ("zram:512:/srv/z.swap", "only a swap file has a path"),
        ("none:64:/srv/x", "none takes no size or path"),
        ("host:128", "host takes no size or path"),
    ],
)
def test_a_malformed_swap_form_is_an_invalid_request(text: str, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        SwapConfig.parse(text)
    assert repr(text) in info.value.message, "the message quotes what the operator wrote"


def test_the_default_swap_file_lives_under_the_data_directory(tmp_path: Path) -> None:
    assert Swap(SwapConfig("file", 64), tmp_path).path == tmp_path / "swap" / "dsec.swap"
    own = tmp_path / "elsewhere.swap"
    assert Swap(SwapConfig("file", 64, own), tmp_path).path == own


def test_swap_none_and_host_turn_nothing_on(tmp_path: Path) -> None:
    before = active_swaps()
    for kind in ("none", "host"):
        swap = Swap(SwapConfig.parse(kind), tmp_path)
        swap.ensure()
        assert swap.device is None
        swap.release()  # nothing of its own to turn off
    assert active_swaps() == before
    assert list(tmp_path.iterdir()) == [], "no swap file made"


swapping = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("mkswap", "swapon", "swapoff")),
    reason="turning swap on needs root and util-linux",
)


@pytest.fixture
def swap_file(tmp_path: Path) -> Iterator[Path]:
    """A swap file path of this test's own; whatever happens, it is not left on."""
    path = tmp_path / "s.swap"
    try:
        yield path
    finally:
        if os.path.realpath(path) in active_swaps():
            subprocess.run(["swapoff", str(path)], check=False, capture_output=True)
        assert os.path.realpath(path) not in active_swaps(), "the test left swap on"


@swapping
def test_a_swap_file_is_turned_on_shared_and_turned_off_by_its_owner(tmp_path: Path, swap_file: Path) -> None:
    name = os.path.realpath(swap_file)
    owner = Swap(SwapConfig("file", 64, swap_file), tmp_path)
    owner.ensure()
    assert name in active_swaps(), "ensure() turned the swap file on"
    assert (60 << 20) < active_swaps()[name] <= (64 << 20)
    assert swap_file.stat().st_size == 64 << 20 and swap_file.stat().st_mode & 0o077 == 0
    owner.ensure()  # again: already on, nothing changes
    assert name in active_swaps()

    # Another edge (or a restarted one) finds it on: it uses it and does not own it.
    finder = Swap(SwapConfig("file", 64, swap_file), tmp_path)
    finder.ensure()
    assert finder.device is None
    finder.release()
    assert name in active_swaps(), "only the edge that turned swap on turns it off"

    owner.release()
    assert name not in active_swaps()
    owner.release()  # twice: nothing left to turn off, not an error

    # The file stays, ready for the next start; turning it on again reuses it.
    again = Swap(SwapConfig("file", 64, swap_file), tmp_path)
    again.ensure()
    assert name in active_swaps() and again.device == name
    again.release()
    assert name not in active_swaps()


@pytest.mark.skipif(not Path("/sys/class/zram-control").exists(), reason="no zram kernel module on this host")
def test_a_zram_swap_is_made_compressed_turned_on_and_reset(tmp_path: Path) -> None:
    before = active_swaps()
    if any(d.startswith("/dev/zram") for d in before):  # an edge uses any zram swap it finds on
        pytest.skip(f"a zram swap is on already (another node's?): {sorted(before)}")
    swap = Swap(SwapConfig.parse("zram:128"), tmp_path)
    device = ""
    try:
        swap.ensure()
        device = swap.device or ""
        assert device.startswith("/dev/zram")
        assert active_swaps()[device] >= 127 << 20
        again = Swap(SwapConfig.parse("zram:128"), tmp_path)
        again.ensure()  # finds it on: uses it, does not own it
        assert again.device is None and active_swaps()[device] >= 127 << 20
    finally:
        swap.release()
    assert active_swaps() == before
    assert (Path("/sys/block") / Path(device).name / "disksize").read_text().strip() == "0", "reset"
