"""Runs inside a sandbox built from a bench image (chroot, /usr/bin/python3.11).

    python3 /app/workload.py big|small

Prints ``ready`` as soon as the interpreter is up with a few standard modules imported (the
"first output" the bench times), then reads part of the image the way an eval job would:
imports some packages (many small files), loads a couple of native libraries, a slice of the
model weights, a few dataset shards. Ends with one JSON line: files and bytes it read.
"""

from __future__ import annotations

import json
import os
import random
import sys
import zlib

print("ready", flush=True)

MIB = 1 << 20
profile = sys.argv[1]
stats = {"files": 0, "bytes": 0}
crc = 0


def read(path: str, offset: int = 0, length: int | None = None) -> None:
    global crc
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length if length is not None else os.fstat(f.fileno()).st_size - offset
        while left > 0:
            data = f.read(min(left, MIB))
            if not data:
                break
            crc = zlib.crc32(data[:64], crc)
            left -= len(data)
            stats["bytes"] += len(data)
    stats["files"] += 1


big = profile == "big"
sp = "/usr/lib/python3.11/site-packages"
pkgs = sorted(p for p in os.listdir(sp) if p.startswith("pkg"))
for pkg in pkgs[: 8 if big else 2]:  # "import" a few packages: every module file of each
    for mod in sorted(os.listdir(f"{sp}/{pkg}")):
        read(f"{sp}/{pkg}/{mod}")
for lib in sorted(os.listdir(f"{sp}/native"))[: 2 if big else 1]:
    read(f"{sp}/native/{lib}")
models = sorted(os.listdir("/models"))
read(f"/models/{models[0]}", 0, MIB)  # the safetensors header
read(f"/models/{models[0]}", 200 * MIB if big else 64 * MIB, (96 if big else 8) * MIB)  # one layer group
if big:
    rng = random.Random(7)
    size = os.stat(f"/models/{models[1]}").st_size
    for _ in range(32):  # scattered tensors
        read(f"/models/{models[1]}", rng.randrange(0, size // MIB - 1) * MIB, MIB)
for shard in sorted(os.listdir("/data"))[: 4 if big else 1]:
    read(f"/data/{shard}")
print(json.dumps({**stats, "crc": crc}), flush=True)
