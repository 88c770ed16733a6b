"""Telling compressed blobs by their magic bytes, decompressing them as a stream, hashing."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import shutil
import subprocess
import tempfile
import threading
import zlib
from collections.abc import Iterator
from typing import IO

from dsec.images.oci.validation import _bad
from dsec.protocol.errors import InfraFailure, InfraReason

_CHUNK = 1 << 20
_MAGIC = [
    (b"\x1f\x8b", "gzip"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"BZh", "bzip2"),
]


# ---- decompression and hashing ---------------------------------------------------------------


def _sniff(head: bytes) -> str:
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    return "tar"


def _decompressed(reader: IO[bytes], kind: str, what: str) -> Iterator[bytes]:
    """The decompressed bytes of ``reader`` (``kind`` from :func:`_sniff`), in chunks."""
    if kind == "zstd":
        yield from _zstd(reader, what)
        return
    stream: io.BufferedIOBase | IO[bytes]
    if kind == "gzip":
        stream = gzip.GzipFile(fileobj=reader, mode="rb")
    elif kind == "xz":
        stream = lzma.LZMAFile(reader)
    elif kind == "bzip2":
        stream = bz2.BZ2File(reader)
    else:
        stream = reader
    with stream:
        while True:
            try:
                chunk = stream.read(_CHUNK)
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as err:
                raise _bad(what, f"cannot be decompressed ({kind}): {err}") from err
            if not chunk:
                return
            yield chunk


def _zstd(reader: IO[bytes], what: str) -> Iterator[bytes]:
    # This Python has no zstd module; the zstd tool streams just as well. A thread feeds it.
    tool = shutil.which("zstd")
    if tool is None:
        raise InfraFailure(
            "zstd-compressed layers need the zstd tool: install zstd", reason=InfraReason.storage
        )
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([tool, "-dcq"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        assert proc.stdin is not None and proc.stdout is not None
        stdin, stdout = proc.stdin, proc.stdout
        errors: list[BaseException] = []

        def feed() -> None:
            try:
                while chunk := reader.read(_CHUNK):
                    stdin.write(chunk)
            except BrokenPipeError:
                pass  # zstd stopped reading: its exit code tells why
            except BaseException as err:
                errors.append(err)
            finally:
                try:
                    stdin.close()
                except BrokenPipeError:
                    pass

        feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
        feeder.start()
        finished = False
        try:
            while chunk := stdout.read(_CHUNK):
                yield chunk
            finished = True
        finally:
            if not finished:
                proc.kill()
            stdout.close()
            feeder.join()
            rc = proc.wait()
        if errors:
            raise errors[0]
        if rc != 0:
            stderr.seek(0)
            message = stderr.read(2000).decode(errors="replace").strip()
            raise _bad(what, f"cannot be decompressed (zstd exit {rc}): {message or 'no message'}")


def _hash_reader(reader: IO[bytes]) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    while chunk := reader.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return f"sha256:{h.hexdigest()}", n
