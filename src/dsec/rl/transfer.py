"""Copying an agent's changes into a grading sandbox without trusting anything of the agent's.

* File names are bytes end to end: the change listing and the file API carry a name that is
  not UTF-8 exactly (``path_b64`` on the wire), so an odd name is copied like any other.
* Files are read through the file API (host side) with caps on how many entries, how large
  each file (the apparent size: a sparse file counts at the size it claims) and how large in
  all; a file that grows while it is read is cut off at the cap and dropped, never held whole.
* Symbolic links are never read by running anything in the agent's sandbox: the listing
  carries each link's target, read by the edge from the sandbox's writable layer on the host
  (``openat2`` beneath the layer, the link itself never followed), the same for containers and
  microVMs. They are recreated in the grading sandbox by the node's static busybox
  (``/.dsec/busybox``, read-only in every container sandbox) with a fixed environment and a
  timeout; target and name reach ``ln -s --`` through ``xargs -0`` from stdin, so their bytes
  are never text on a command line and never an option. Links are applied after every file, so
  no write follows one.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from dsec.protocol.errors import DSecError, FileNotFound
from dsec.protocol.models import Change, ChangeKind, FileType
from dsec.sdk.client import Sandbox

__all__ = ["Copied", "CopyLimits", "copy_changes"]

NODE_BUSYBOX = "/.dsec/busybox"
_TOOL_TIMEOUT = 30.0
_TOOL_ENV = {"PATH": "/nonexistent", "LC_ALL": "C"}
_LINK_MAX = 4095


@dataclass(frozen=True)
class CopyLimits:
    max_files: int = 10_000
    max_file_bytes: int = 16 << 20
    max_total_bytes: int = 64 << 20


@dataclass
class Copied:
    applied: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    contents: dict[str, bytes] = field(default_factory=dict)  # applied files, for the scan


def _order(change: Change) -> int:
    if change.kind is ChangeKind.deleted:
        return 0
    return {FileType.dir: 1, FileType.file: 2}.get(change.type, 3)


async def copy_changes(agent: Sandbox, room: Sandbox, changes: list[Change], limits: CopyLimits) -> Copied:
    """Apply ``changes`` (already judged applicable) from ``agent`` to ``room``.

    Errors of the room's file API propagate (the caller decides whether the room died); what is
    wrong with one of the agent's files only drops that file."""
    out = Copied()
    total = made = 0
    # Deletions first (a replaced directory is deleted, then made again), then directories,
    # files, and links last.
    for change in sorted(changes, key=lambda c: (_order(c), c.path)):
        path = change.path
        if change.kind is not ChangeKind.deleted:
            if made >= limits.max_files:
                out.dropped.append(
                    (path, f"more than {limits.max_files} files, directories and links changed")
                )
                continue
            made += 1
        if change.kind is ChangeKind.deleted:
            with contextlib.suppress(FileNotFound):
                await room.remove(path, recursive=True)
        elif change.type is FileType.dir:
            await room.mkdir(path, parents=True)
        elif change.type is FileType.file:
            cap = min(limits.max_file_bytes, limits.max_total_bytes - total)
            data, mode, why = await _read_capped(agent, path, cap)
            if data is None:
                out.dropped.append((path, why))
                continue
            total += len(data)
            await room.write_file(path, data, mode=mode)
            out.contents[path] = data
        elif change.type is FileType.symlink:
            why = await _copy_link(room, path, change.target)
            if why:
                out.dropped.append((path, why))
                continue
        else:
            out.dropped.append((path, "not a file, directory or link (a device, fifo or socket)"))
            continue
        out.applied.append(path)
    return out


async def _read_capped(agent: Sandbox, path: str, cap: int) -> tuple[bytes | None, int, str]:
    """The file's content and mode, or None and why it is not copied."""
    try:
        st = await agent.stat(path)
    except DSecError as exc:
        return None, 0, f"unreadable in the agent's sandbox: {exc}"
    if st.type is not FileType.file:
        return None, 0, f"changed type while being read (now {st.type.value})"
    if st.size > cap:  # the apparent size: a sparse file is refused at what it claims
        return None, 0, f"too large: {st.size} bytes, over the cap of {cap} bytes"
    data = bytearray()
    try:
        async for chunk in agent.read_stream(path):
            data += chunk
            if len(data) > cap:
                return None, 0, f"grew past the cap of {cap} bytes while being read"
    except DSecError as exc:
        return None, 0, f"unreadable in the agent's sandbox: {exc}"
    return bytes(data), st.mode & 0o777, ""  # no set-id bits into the grading sandbox


async def _copy_link(room: Sandbox, path: str, target: str | None) -> str:
    """Recreate the link at ``path`` in ``room``; '' on success, else why it was dropped."""
    if not target:
        return "link target unreadable (the link changed while the changes were listed)"
    if len(os.fsencode(target)) > _LINK_MAX:
        return f"link target longer than {_LINK_MAX} bytes"
    with contextlib.suppress(FileNotFound):
        await room.remove(path, recursive=True)
    made = await room.exec(
        [NODE_BUSYBOX, "xargs", "-0", NODE_BUSYBOX, "ln", "-s", "--"],
        stdin=os.fsencode(target) + b"\0" + os.fsencode(path) + b"\0",
        env=_TOOL_ENV,
        timeout=_TOOL_TIMEOUT,
    )
    if made.exit_code != 0 or made.timed_out:
        return f"link could not be recreated: {made.stderr.strip()[:200]}"
    return ""
