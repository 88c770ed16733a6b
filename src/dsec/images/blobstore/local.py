"""The blob store in a directory on local disk (the embedded default)."""

from __future__ import annotations

from pathlib import Path

from dsec.images.blobstore._dirstore import _DirBlobStore
from dsec.protocol.errors import InfraFailure, InfraReason


class LocalDirBlobStore(_DirBlobStore):
    """A directory on local disk; created if missing. The embedded default."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        try:
            self._make_dirs()
            self._write_marker()
        except OSError as err:
            raise InfraFailure(
                f"cannot open the layer store at {root}: {err}", reason=InfraReason.storage
            ) from err
