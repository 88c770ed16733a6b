"""A tiny BIOS-bootable disk image made here, for the imported-image tests: an MBR (syslinux's
boot code and one FAT partition) whose SYSLINUX boots a kernel and initramfs from it."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

MBR = Path("/usr/lib/syslinux/mbr/mbr.bin")
TOOLS = ("syslinux", "mcopy", "mkfs.vfat")
_OFFSET = 1 << 20  # the partition starts at 1 MiB


def can_build() -> bool:
    return MBR.exists() and all(shutil.which(t) for t in TOOLS)


def build(dest: Path, kernel: Path, initramfs: Path, append: str, size_mb: int = 64) -> None:
    """Write a raw disk image to ``dest`` whose bootloader boots ``kernel`` with ``append``."""
    part = dest.with_suffix(".part")
    try:
        with open(part, "wb") as fh:
            fh.truncate((size_mb << 20) - _OFFSET)
        _run("mkfs.vfat", "-F", "16", "-n", "DSECBOOT", str(part))
        cfg = dest.with_suffix(".cfg")
        cfg.write_text(
            f"DEFAULT linux\nPROMPT 0\nLABEL linux\n  KERNEL vmlinuz\n  INITRD initrd\n  APPEND {append}\n"
        )
        for src, name in ((kernel, "vmlinuz"), (initramfs, "initrd"), (cfg, "syslinux.cfg")):
            _run("mcopy", "-i", str(part), str(src), f"::{name}")
        cfg.unlink()
        sectors = part.stat().st_size // 512
        # MBR: boot code, one active FAT16 (LBA) partition from sector 2048, the signature.
        entry = struct.pack(
            "<B3sB3sII", 0x80, b"\xfe\xff\xff", 0x0E, b"\xfe\xff\xff", _OFFSET // 512, sectors
        )
        head = bytearray(_OFFSET)
        head[:440] = MBR.read_bytes()[:440]
        head[446:462] = entry
        head[510:512] = b"\x55\xaa"
        with open(dest, "wb") as out, open(part, "rb") as src_fh:
            out.write(head)
            shutil.copyfileobj(src_fh, out, 1 << 20)
        _run("syslinux", "--offset", str(_OFFSET), "--install", str(dest))
    finally:
        part.unlink(missing_ok=True)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
