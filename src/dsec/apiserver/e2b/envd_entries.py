"""envd's ``EntryInfo``: a DSec FileStat as envd describes a file, with owner and group by name
and, for a symlink, where it leads.

Owners are read from the sandbox's own ``/etc/passwd`` and ``/etc/group`` (what ``ls -l``
inside would print), once per call.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import stat
from datetime import UTC, datetime
from typing import Any

from dsec.edge.link import EdgeLink
from dsec.protocol.errors import DSecError, FileNotFound, InvalidRequest
from dsec.protocol.models import FileStat, FileType

_NAMES_MAX = 1 << 20
_LINKS_AT_ONCE = 256  # symlinks resolved by one readlink process
_LINK_TARGET_MAX = 1 << 20
_TYPES = {FileType.file: "FILE_TYPE_FILE", FileType.dir: "FILE_TYPE_DIRECTORY"}
_DIR_BLOCK = 4096


def dir_size(size: int) -> int:
    """A directory's size as E2B's ext4 guests report it: whole 4 KiB blocks, at least one.
    A disk-limited sandbox's writable layer is btrfs, whose directory size counts name bytes
    (0 when empty); a directory's st_size means nothing else to a client, and SDK users (E2B's own
    suite) take a directory's size as positive."""
    return max(_DIR_BLOCK, -(-size // _DIR_BLOCK) * _DIR_BLOCK)


async def _names(link: EdgeLink, sandbox_id: str, path: str) -> dict[int, str]:
    """id -> name from an /etc/passwd-style file in the sandbox ({} if it has none)."""
    data = bytearray()
    try:
        async for chunk in link.read_stream(sandbox_id, path):
            data += chunk
            if len(data) > _NAMES_MAX:
                return {}
    except (FileNotFound, InvalidRequest):
        return {}
    out: dict[int, str] = {}
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            out.setdefault(int(parts[2]), parts[0])
    return out


class Owners:
    def __init__(self, users: dict[int, str], groups: dict[int, str]) -> None:
        self.users, self.groups = users, groups

    @classmethod
    async def of(cls, link: EdgeLink, sandbox_id: str) -> Owners:
        users, groups = await asyncio.gather(
            _names(link, sandbox_id, "/etc/passwd"), _names(link, sandbox_id, "/etc/group")
        )
        return cls(users, groups)

    def entry(self, info: FileStat) -> dict[str, Any]:
        """A FileStat as envd's ``EntryInfo`` (proto JSON: defaults left out)."""
        mode = info.mode & 0o7777
        kind = {FileType.dir: stat.S_IFDIR, FileType.symlink: stat.S_IFLNK}.get(info.type, stat.S_IFREG)
        out: dict[str, Any] = {
            "name": info.name,
            "type": _TYPES.get(info.type, "FILE_TYPE_FILE"),
            "path": info.path,
            "size": str(dir_size(info.size) if info.type == FileType.dir else info.size),
            "mode": mode,
            "permissions": stat.filemode(kind | mode),
            "owner": self.users.get(info.uid, str(info.uid)),
            "group": self.groups.get(info.gid, str(info.gid)),
            "modifiedTime": datetime.fromtimestamp(info.mtime, UTC).isoformat().replace("+00:00", "Z"),
        }
        if info.type == FileType.symlink:
            out["isSymlink"] = True
        return out


async def _link_targets(link: EdgeLink, sandbox_id: str, paths: list[str]) -> list[str]:
    """Where each symlink leads with every link on the way resolved (envd: Go's EvalSymlinks;
    the link's own path when that fails). The edge's file calls describe a link, never read
    it, so ``readlink -e`` runs in the sandbox: one process per listing, not per link."""
    script = 'for p; do t=$(readlink -e -- "$p") || t=$p; printf "%s\\0" "$t"; done'
    out = bytearray()
    events = link.exec_stream(sandbox_id, ["sh", "-c", script, "sh", *paths], timeout=30)
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if event.t == "out" and event.d:
                    out += base64.b64decode(event.d)
                    if len(out) > _LINK_TARGET_MAX:
                        break
    except DSecError:
        return list(paths)
    complete = out.decode(errors="replace").split("\0")[:-1]  # each target ends with a NUL
    return [complete[i] or p if i < len(complete) else p for i, p in enumerate(paths)]


async def entries(
    link: EdgeLink, sandbox_id: str, owners: Owners, infos: list[FileStat]
) -> list[dict[str, Any]]:
    """``infos`` as envd's EntryInfo: a symlink carries ``symlinkTarget`` and its target's
    type and mode (envd 0.6.x), the link's own path and ``isSymlink``."""
    out = [owners.entry(i) for i in infos]
    links = [n for n, i in enumerate(infos) if i.type == FileType.symlink]
    for start in range(0, len(links), _LINKS_AT_ONCE):
        batch = links[start : start + _LINKS_AT_ONCE]
        targets = await _link_targets(link, sandbox_id, [infos[n].path for n in batch])
        for n, target in zip(batch, targets, strict=True):
            out[n]["symlinkTarget"] = target
            try:
                pointed = await link.stat(sandbox_id, target) if target != infos[n].path else None
            except DSecError:
                pointed = None
            if pointed is None or pointed.type == FileType.symlink:
                out[n]["type"] = "FILE_TYPE_UNSPECIFIED"
                out[n]["mode"] = 0
            else:
                out[n]["type"] = _TYPES.get(pointed.type, "FILE_TYPE_UNSPECIFIED")
                out[n]["mode"] = pointed.mode & 0o777
    return out
