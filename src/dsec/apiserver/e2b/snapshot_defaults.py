"""What a sandbox made from an E2B snapshot starts with besides its files: its source's user,
working directory and environment.

E2B restores envd's memory with the snapshot, so a sandbox made from one runs commands as the
same default user, in the same directory, with the same environment as its source did. DSec's
snapshot is a layer list (snapshots.py), which keeps none of that; this keeps it, per snapshot
(its ref, ``name:version``), in a JSON file beside the templates' (``e2b-snapshots/``), written
whole and atomically. An entry goes with its snapshot; one snapshot ref moved to new content
gets the new source's.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from dsec.protocol.bounds import AbsPath, UserName


class SnapshotDefaults(BaseModel):
    pack: str = ""  # the snapshot's last layer when this was kept: another content is another's
    user: UserName = "root"
    workdir: AbsPath | None = None
    env: dict[str, str] = Field(default_factory=dict)


class SnapshotDefaultsStore:
    def __init__(self, directory: Path) -> None:
        self.file = directory / "defaults.json"
        self._entries: dict[str, SnapshotDefaults] | None = None
        self._lock = asyncio.Lock()

    async def _loaded(self) -> dict[str, SnapshotDefaults]:
        if self._entries is None:

            def load() -> dict[str, SnapshotDefaults]:
                try:
                    raw = json.loads(self.file.read_text())
                    return {ref: SnapshotDefaults.model_validate(v) for ref, v in raw.items()}
                except FileNotFoundError:
                    return {}
                except (ValueError, ValidationError, AttributeError):
                    return {}  # unreadable: snapshots start as their layers say (root), as before

            self._entries = await asyncio.to_thread(load)
        return self._entries

    async def _save(self, entries: dict[str, SnapshotDefaults]) -> None:
        data = json.dumps({ref: d.model_dump() for ref, d in entries.items()})

        def write() -> None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(self.file.parent, 0o700)  # tenants' env: root's alone
            tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}")
            tmp.write_text(data)
            os.replace(tmp, self.file)

        await asyncio.to_thread(write)

    async def put(self, ref: str, defaults: SnapshotDefaults) -> None:
        async with self._lock:
            entries = await self._loaded()
            entries[ref] = defaults
            await self._save(entries)

    async def get(self, ref: str) -> SnapshotDefaults | None:
        return (await self._loaded()).get(ref)

    async def drop(self, ref: str) -> None:
        async with self._lock:
            entries = await self._loaded()
            if entries.pop(ref, None) is not None:
                await self._save(entries)
