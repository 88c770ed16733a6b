"""The node's egress CA inside a sandbox with egress headers (:mod:`dsec.netpolicy.intercept`):
written where its TLS clients look when headers are given, taken out again when they are
cleared, and kept out of every layer packed from the sandbox (it is this node's CA, trusted
for this sandbox's hosts only).

Its own files (:data:`~dsec.netpolicy.intercept.SANDBOX_CA_PATHS`), and the certificate
appended to the system bundle (what curl, Python's ssl and OpenSSL read); runtimes with a
bundle of their own are pointed at those by the sandbox's environment
(:data:`~dsec.protocol.egress_headers.CA_ENV`).
"""

from __future__ import annotations

import logging

from dsec.executor.file_ops import FileOps, one_chunk
from dsec.netpolicy import intercept
from dsec.protocol.errors import DSecError

log = logging.getLogger(__name__)

_MAX_BUNDLE = 8 << 20  # Debian's bundle is about 200 KiB; a bigger one is the image's to keep


def written() -> list[str]:
    """The paths (relative to /) a packed layer leaves out of a sandbox that trusted the CA."""
    return [p.lstrip("/") for p in (*intercept.SANDBOX_CA_PATHS, intercept.SYSTEM_BUNDLE)]


async def trust(files: FileOps, ca: bytes) -> None:
    for path in intercept.SANDBOX_CA_PATHS:
        await files.mkdir(path.rsplit("/", 1)[0], parents=True)
        await files.write_stream(path, one_chunk(ca), 0o444)
    old = await _bundle(files)
    if old is not None and ca not in old:
        sep = b"\n" if old and not old.endswith(b"\n") else b""
        await files.write_stream(intercept.SYSTEM_BUNDLE, one_chunk(old + sep + ca), 0o644)


async def distrust(files: FileOps, ca: bytes) -> None:
    for path in intercept.SANDBOX_CA_PATHS:
        try:
            await files.remove(path)
        except DSecError:
            pass  # removed from inside already
    old = await _bundle(files)
    if old is not None and ca in old:
        await files.write_stream(intercept.SYSTEM_BUNDLE, one_chunk(old.replace(ca, b"")), 0o644)


async def _bundle(files: FileOps) -> bytes | None:
    """The system bundle's bytes (empty: none in the image); None when it is too big to touch."""
    data = b""
    try:
        async for chunk in files.read_stream(intercept.SYSTEM_BUNDLE):
            data += chunk
            if len(data) > _MAX_BUNDLE:
                log.warning("%s is over %d bytes: left as it is", intercept.SYSTEM_BUNDLE, _MAX_BUNDLE)
                return None
    except DSecError:
        return b""
    return data
