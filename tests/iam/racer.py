"""A separate process that races for quota: the conformance suite starts several of these.

    python -m tests.iam.racer sqlite <path> <project> <n> <prefix> <go-file>
    python -m tests.iam.racer postgres <dsn> <schema> <project> <n> <prefix> <go-file>

It opens its own store, prints ``ready``, waits until ``go-file`` exists (so that all racers
start together), fires ``n`` concurrent reserves, and prints one JSON line with the outcome.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from dsec.iam.base import IamStore
from dsec.protocol.errors import QuotaExceeded


async def _open(argv: list[str]) -> tuple[IamStore, list[str]]:
    if argv[0] == "sqlite":
        from dsec.iam.sqlite import SqliteIamStore

        return SqliteIamStore(Path(argv[1])), argv[2:]
    from dsec.iam.postgres import PostgresIamStore

    return await PostgresIamStore.connect(argv[1], schema=argv[2], max_size=8), argv[3:]


async def main(argv: list[str]) -> None:
    store, rest = await _open(argv)
    project, n, prefix, go = rest[0], int(rest[1]), rest[2], Path(rest[3])
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("racer: never told to go")
        await asyncio.sleep(0.001)

    async def one(i: int) -> str:
        try:
            await store.reserve(project, f"{prefix}-{i}", 0.5, 64)
        except QuotaExceeded:
            return "quota"
        return "ok"

    try:
        results = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await store.close()
    print(json.dumps({"ok": results.count("ok"), "quota": results.count("quota")}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
