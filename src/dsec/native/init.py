"""PID 1 of every container sandbox: ``dsec-init`` (``dsec_init.c``), one tiny static process
that reaps orphans and waits for SIGTERM.

:func:`install_init` compiles it once per source version into the node's build directory
(:mod:`dsec.native.build`) and copies it into the runtime directory that sandboxes see
read-only at ``/.dsec``, where :data:`dsec.backends.container.oci.INIT` names it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsec.native.build import Program

SOURCE = Path(__file__).with_name("dsec_init.c")
NAME = "dsec-init"
PROGRAM = Program(NAME, SOURCE)


def build_init(bin_dir: Path) -> Path:
    """Compile ``dsec-init`` into ``bin_dir`` unless this source's binary is there; its path."""
    return PROGRAM.build(bin_dir)


def install_init(bin_dir: Path, runtime_dir: Path) -> None:
    """Put the current ``dsec-init`` at ``runtime_dir/dsec-init`` (a rename: running sandboxes
    keep the binary they started with)."""
    built = build_init(bin_dir)
    target = runtime_dir / NAME
    if target.exists() and target.read_bytes() == built.read_bytes():
        return
    tmp = target.with_name(f".{NAME}.{os.getpid()}.tmp")
    shutil.copy2(built, tmp)
    os.chmod(tmp, 0o755)
    tmp.replace(target)
