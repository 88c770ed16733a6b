"""Source trees for the on-demand bench: a runnable Python install plus bulky, incompressible data.

A tree looks like a training/eval image: the host's real CPython (interpreter, its shared
libraries, the whole standard library) so a process can start from it under chroot, a synthetic
``site-packages`` of many small files with realistic (log-normal) sizes, a few native-library
sized files, model weights and dataset shards. All synthetic content is random (incompressible);
names and sizes come from a seeded PRNG so every image of one spec has the same layout.

``/app/workload.py`` (below) is the program the bench runs inside the image.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PYTHON = "/usr/bin/python3.11"
STDLIB = "/usr/lib/python3.11"


@dataclass(frozen=True)
class TreeSpec:
    small_files: int  # site-packages modules
    native_libs: int  # 1-16 MiB files
    model_files: int
    model_mib: int  # each
    shards: int
    shard_mib: int


# >= 2 GiB: the image of figures (a) and (b).
BIG = TreeSpec(small_files=12_000, native_libs=24, model_files=2, model_mib=850, shards=64, shard_mib=4)
# The eight images of the burst (c): same shape, smaller.
SMALL = TreeSpec(small_files=3_000, native_libs=6, model_files=1, model_mib=256, shards=16, shard_mib=4)

_WRITE = 4 << 20


def _random_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, _WRITE)
            f.write(os.urandom(n))
            left -= n


def _python_runtime(root: Path) -> None:
    """The host interpreter, the libraries it links, the loader and the standard library."""
    out = subprocess.run(["ldd", PYTHON], capture_output=True, text=True, check=True).stdout
    libs = [p for line in out.splitlines() for p in line.split() if p.startswith("/")]
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "lib64").mkdir()
    os.symlink("usr/lib", root / "lib")
    os.symlink("usr/bin", root / "bin")
    shutil.copy2(PYTHON, root / "usr/bin/python3.11")
    os.symlink("python3.11", root / "usr/bin/python3")
    for lib in libs:
        real = os.path.realpath(lib)
        dest = root / ("lib64" if "ld-linux" in lib else "usr/lib/x86_64-linux-gnu") / os.path.basename(lib)
        shutil.copy2(real, dest)
    shutil.copytree(STDLIB, root / "usr/lib/python3.11", symlinks=True, ignore=shutil.ignore_patterns("test"))
    (root / "tmp").mkdir(mode=0o1777)
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("sandbox\n")


def small_file_paths(spec: TreeSpec) -> list[str]:
    """Relative paths of the synthetic site-packages files (the same for every seed)."""
    paths = []
    for i in range(spec.small_files):
        pkg, mod = divmod(i, 40)
        paths.append(f"usr/lib/python3.11/site-packages/pkg{pkg:04d}/mod{mod:02d}.py")
    return paths


def build_tree(root: Path, spec: TreeSpec, seed: int) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    _python_runtime(root)
    rng = random.Random(seed)
    for rel in small_file_paths(spec):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        # log-normal, median ~2.7 KiB, mean ~6 KiB: the shape of a real site-packages
        _random_file(p, min(int(rng.lognormvariate(7.9, 1.25)), 2 << 20))
    native = root / "usr/lib/python3.11/site-packages/native"
    native.mkdir()
    for i in range(spec.native_libs):
        _random_file(native / f"lib{i:02d}.so", rng.randint(1, 16) << 20)
    models = root / "models"
    models.mkdir()
    for i in range(spec.model_files):
        _random_file(
            models / f"model-{i + 1:05d}-of-{spec.model_files:05d}.safetensors", spec.model_mib << 20
        )
    data = root / "data"
    data.mkdir()
    for i in range(spec.shards):
        _random_file(data / f"shard-{i:05d}.bin", spec.shard_mib << 20)
    app = root / "app"
    app.mkdir()
    shutil.copy2(Path(__file__).with_name("workload.py"), app / "workload.py")
    # Fixed mtimes: a rebuild from the same random data would give the same image.
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.utime(os.path.join(dirpath, name), ns=(0, 1_700_000_000 * 10**9), follow_symlinks=False)
    os.utime(root, ns=(0, 1_700_000_000 * 10**9))


if __name__ == "__main__":
    build_tree(Path(sys.argv[1]), BIG if sys.argv[2] == "big" else SMALL, int(sys.argv[3]))
