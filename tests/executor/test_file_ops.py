"""HostFileOps, the async file interface over a sandbox root the host reaches: whole files
either way in bounded chunks, nothing left by a write that fails, the entries mkdir and
move made. (tests/edge/link_conformance.py drives the same calls through every edge link.)"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.executor.file_ops import CHUNK, HostFileOps
from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import FileNotFound
from dsec.protocol.models import FileType


@pytest.fixture
def ops(tmp_path: Path) -> HostFileOps:
    root = tmp_path / "sandbox"
    root.mkdir()
    return HostFileOps(SandboxFiles(root, uid=os.getuid(), gid=os.getgid()))


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at : at + size]


async def read_all(ops: HostFileOps, path: str) -> list[bytes]:
    return [chunk async for chunk in ops.read_stream(path)]


async def broken(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    raise ConnectionResetError("the client went away")


# Around the chunk size: the reader stops at a short read, and a file of exactly one chunk
# needs one more read to find its end.
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
@pytest.mark.parametrize("piece", [1000, 64 << 10, 2 * CHUNK])
async def test_a_file_of_any_size_round_trips_in_bounded_chunks(
    ops: HostFileOps, size: int, piece: int
) -> None:
    data = os.urandom(size)
    info = await ops.write_stream("/d/f", pieces(data, piece))
    assert (info.size, info.type, info.path) == (size, FileType.file, "/d/f")
    got = await read_all(ops, "/d/f")
    assert b"".join(got) == data
    assert all(0 < len(chunk) <= CHUNK for chunk in got)


@pytest.mark.parametrize("sent", [(), (b"a",), (b"a", b"b"), (b"a", b"b", b"c")])
async def test_a_write_whose_body_fails_leaves_the_target_as_it_was(
    ops: HostFileOps, sent: tuple[bytes, ...]
) -> None:
    with pytest.raises(ConnectionResetError):
        await ops.write_stream("/new", broken(*sent))
    assert not await ops.exists("/new")
    await ops.write_stream("/old", pieces(b"before", 3))
    with pytest.raises(ConnectionResetError):
        await ops.write_stream("/old", broken(*sent))
    assert b"".join(await read_all(ops, "/old")) == b"before"
    assert [e.name for e in await ops.list_dir("/")] == ["old"]  # no temporary file stays


async def test_mkdir_and_move_answer_the_entry_they_made(ops: HostFileOps) -> None:
    made = await ops.mkdir("/a/b")
    assert (made.path, made.type) == ("/a/b", FileType.dir)
    await ops.write_stream("/a/b/f", pieces(b"x" * 10, 4))
    moved = await ops.move("/a/b/f", "/a/g")
    assert (moved.path, moved.type, moved.size) == ("/a/g", FileType.file, 10)
    with pytest.raises(FileNotFound):
        await read_all(ops, "/a/b/f")
