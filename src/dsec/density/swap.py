"""Swap the edge manages, so that pausing a sandbox can push its anonymous memory out of RAM.

Without swap, a paused sandbox keeps its anonymous memory resident (only page cache is
dropped). The operator chooses: ``none`` (pause only freezes), ``host`` (use whatever swap
the host has), ``file`` (a swap file under the edge's data directory) or ``zram`` (a
compressed RAM device: smaller, no disk, but it still occupies RAM). Enabling is idempotent:
swap found already on (an earlier run of the edge, or another edge of the same host) is used
as it is and left on at exit; ``release`` turns off only what this edge itself turned on, and
the edge calls it only when nothing is paused (swapping off pulls every page back into RAM).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest

log = logging.getLogger("dsec.density.swap")

SwapKind = Literal["none", "host", "file", "zram"]
_ZRAM = Path("/sys/block")


@dataclass(frozen=True)
class SwapConfig:
    kind: SwapKind = "none"
    size_mb: int = 4096
    path: Path | None = None  # the swap file (kind "file"); default: <data_dir>/swap/dsec.swap

    @classmethod
    def parse(cls, text: str) -> SwapConfig:
        """``none``, ``host``, ``file[:SIZE_MB[:PATH]]`` or ``zram[:SIZE_MB]`` (the CLI form)."""
        kind, _, rest = text.partition(":")
        if kind not in ("none", "host", "file", "zram"):
            raise InvalidRequest(f"swap {text!r}: say none, host, file[:SIZE_MB[:PATH]] or zram[:SIZE_MB]")
        size, _, path = rest.partition(":")
        if rest and kind in ("none", "host"):
            raise InvalidRequest(f"swap {text!r}: {kind} takes no size or path")
        try:
            size_mb = int(size) if size else 4096
        except ValueError as exc:
            raise InvalidRequest(f"swap {text!r}: size must be a number of MiB") from exc
        if not 64 <= size_mb <= 1 << 24:
            raise InvalidRequest(f"swap {text!r}: size must be 64 MiB to 16 TiB")
        if path and kind != "file":
            raise InvalidRequest(f"swap {text!r}: only a swap file has a path")
        return cls(kind, size_mb, Path(path) if path else None)  # type: ignore[arg-type]


def active_swaps() -> dict[str, int]:
    """Active swap areas (``/proc/swaps``): name -> size in bytes."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/swaps").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                out[fields[0].replace("\\040", " ")] = int(fields[2]) * 1024
    return out


def free_swap_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapFree:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise InfraFailure(f"{' '.join(argv)} failed: {done.stderr.strip()}", reason=InfraReason.swap)


class Swap:
    def __init__(self, config: SwapConfig, data_dir: Path) -> None:
        self.config = config
        self.path = config.path or data_dir / "swap" / "dsec.swap"
        self.device: str | None = None  # what this edge turned on (to turn off on release)

    def ensure(self) -> None:
        if self.config.kind == "file":
            self._ensure_file()
        elif self.config.kind == "zram":
            self._ensure_zram()

    def _ensure_file(self) -> None:
        name = os.path.realpath(self.path)
        if name in active_swaps():
            return
        size = self.config.size_mb << 20
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size != size:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # no holes: the kernel refuses sparse swap files
            finally:
                os.close(fd)
            _run("mkswap", str(self.path))
        _run("swapon", str(self.path))
        self.device = name
        log.info("swap file %s (%d MiB) on", self.path, self.config.size_mb)

    def _ensure_zram(self) -> None:
        active = active_swaps()
        for dev in sorted(_ZRAM.glob("zram*")):
            if f"/dev/{dev.name}" in active:
                return  # from an earlier run (or another edge here): used, not owned
        free = [d for d in sorted(_ZRAM.glob("zram*")) if (d / "disksize").read_text().strip() == "0"]
        if not free:
            control = Path("/sys/class/zram-control/hot_add")
            if not control.exists():
                raise InfraFailure(
                    "no free zram device (is the zram module loaded?)", reason=InfraReason.swap
                )
            free = [_ZRAM / f"zram{control.read_text().strip()}"]
        dev = free[0]
        algorithms = (dev / "comp_algorithm").read_text()
        if "lz4" in algorithms.replace("[", " ").replace("]", " ").split():
            (dev / "comp_algorithm").write_text("lz4")  # faster than the default lzo-rle here
        (dev / "disksize").write_text(str(self.config.size_mb << 20))
        _run("mkswap", f"/dev/{dev.name}")
        _run("swapon", f"/dev/{dev.name}")
        self.device = f"/dev/{dev.name}"
        log.info("zram swap %s (%d MiB) on", self.device, self.config.size_mb)

    def release(self) -> None:
        """Turn off what :meth:`ensure` turned on (call only when nothing is paused)."""
        if self.device is None:
            return
        _run("swapoff", self.device)
        if self.config.kind == "zram":
            with contextlib.suppress(OSError):
                (_ZRAM / Path(self.device).name / "reset").write_text("1")
        self.device = None
