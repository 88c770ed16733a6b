"""The FnCall runner as the one file the sandbox runs: a zip of ``runner/``, built here.

The runner is a package (``dsec.edge.fncall.runner``), but a pool sandbox gets one read-only
file, ``/.dsec/fncall-runner.py``, which its python3 runs as ``python3 /.dsec/fncall-runner.py``
(python runs a zip with a top-level ``__main__.py`` whatever its name). The zip is built in
memory from the package's sources, deterministically (sorted names, fixed timestamps and
modes, stored uncompressed): the same sources give the same bytes, so the node rewrites its
copy only when the runner changed and a hash of it is stable across nodes and zlib versions.
Inside, the package is ``_dsec_fncall_runner``: a name no call's code imports by accident
(its modules stay in ``sys.modules`` of every warm Python call), and not ``dsec``, which a call
may import for real from its image.
"""

from __future__ import annotations

import atexit
import functools
import io
import shutil
import tempfile
import zipfile
from pathlib import Path

PACKAGE = Path(__file__).with_name("runner")
NAME_IN_ZIP = "_dsec_fncall_runner"
MAIN = f"import sys\n\nfrom {NAME_IN_ZIP}.serve import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can hold


@functools.cache
def runner_zip() -> bytes:
    """The runner, as the bytes of the file shipped into pool sandboxes."""
    members = {"__main__.py": MAIN.encode()}
    for path in sorted(PACKAGE.glob("*.py")):
        members[f"{NAME_IN_ZIP}/{path.name}"] = path.read_bytes()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.create_system, info.external_attr = 3, 0o100644 << 16  # a Unix regular file, rw-r--r--
            zf.writestr(info, data, compress_type=zipfile.ZIP_STORED)
    return out.getvalue()


@functools.cache
def runner_path() -> Path:
    """The runner as a file of this process's own (a private temporary directory, removed at
    exit), for what starts it outside a sandbox: tests and benchmarks on the host."""
    tmp = Path(tempfile.mkdtemp(prefix="dsec-fncall-runner-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    path = tmp / "fncall-runner.py"
    path.write_bytes(runner_zip())
    return path
