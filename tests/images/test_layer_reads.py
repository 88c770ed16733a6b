"""The scan behind ``dsec_ondemand_read_bytes`` (images/layer_reads.py), over a tree of its
own: what it counts, and what a tenant's layer cannot make it count or do."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dsec.images import _pagecache
from dsec.images.layer_reads import ReadScanner, scan

pytestmark = pytest.mark.skipif(not _pagecache.supported(), reason="cachestat(2) needs Linux >= 6.5")
MIB = 1 << 20


def _cached(path: Path) -> int:
    use = _pagecache.cache_use(path)
    assert use is not None
    return use.cached


def test_it_sums_each_file_s_page_cache_once(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "a/b").mkdir(parents=True)
    (layer / "a/b/data.bin").write_bytes(os.urandom(2 * MIB))  # written: in the page cache
    (layer / "small.txt").write_text("x")
    os.link(layer / "a/b/data.bin", layer / "hardlink.bin")  # the same file: counted once
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4 * MIB))
    (layer / "escape").symlink_to(outside)  # never followed
    (layer / "dir-escape").symlink_to(tmp_path)
    os.mkfifo(layer / "fifo")  # never opened (an open would block without O_NONBLOCK)
    got = scan([layer])
    assert got.complete and got.files == 2
    assert got.cached_bytes == _cached(layer / "a/b/data.bin") + _cached(layer / "small.txt")
    assert 2 * MIB <= got.cached_bytes < 3 * MIB


def test_a_huge_tree_is_cut_short_and_says_so(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"f{i}").write_text("x")
    got = scan([tmp_path], max_files=5)
    assert got.files == 5 and not got.complete


def test_the_scanner_runs_in_the_background_and_not_again_while_fresh(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(os.urandom(MIB))
    asked = threading.Event()
    calls: list[int] = []

    def roots() -> list[Path]:
        calls.append(1)
        asked.set()
        return [tmp_path]

    scanner = ReadScanner(roots, interval_s=3600)
    assert scanner.last is None
    first = scanner.scan_now()
    assert scanner.last == first and first.cached_bytes >= MIB
    scanner.refresh()  # fresh: no second scan
    assert calls == [1]
    scanner.last = None
    asked.clear()
    scanner.refresh()
    assert asked.wait(30) and len(calls) == 2
