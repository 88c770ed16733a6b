"""What it takes to leave nothing of a call behind: its files, its System V IPC objects, and
the /proc reads that prove none of its processes is left.

Used by the runner (``calls.py``) after each call; the kill itself needs the runner's state
(its pids, the call uid) and stays there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

from .libc import IPC_RMID, libc


def remove(path: str) -> None:
    """Remove a file or tree a call had its hands on, whatever modes it left on the way."""

    def unlock(_func: Callable[..., Any], p: str, _exc: Any) -> None:
        for d in (os.path.dirname(p), p):  # a call may leave dirs unreadable or unwritable
            try:
                if not os.path.islink(d):
                    os.chmod(d, 0o700)
            except OSError:
                pass

    for _ in range(8):  # each pass can open one more level of locked dirs
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, onerror=unlock)
            else:
                os.unlink(path)
        except OSError:
            pass
        if not os.path.lexists(path):
            return


def all_root(pid: str) -> bool:
    """Every uid of the process is 0: the zygote's spare, never a call's (no call gains root)."""
    with open(f"/proc/{pid}/status", "rb") as f:
        uids = next(line for line in f if line.startswith(b"Uid:"))
    return uids.split()[1:] == [b"0"] * 4


def children(pid: int, tasks: list[str]) -> list[str]:
    """The child pids of every thread of ``pid`` (zombies included)."""
    found: list[str] = []
    for tid in tasks:
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
            found += f.read().decode().split()
    return found


def sysv_ipc_of(uid: int) -> list[tuple[str, int]]:
    """The System V IPC objects (kind, id) of this IPC namespace that ``uid`` owns or created."""
    found = []
    for kind, id_column in (("shm", "shmid"), ("sem", "semid"), ("msg", "msqid")):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as f:
                header, *rows = f.read().split(b"\n")
        except OSError:
            continue
        columns = header.decode().split()
        for row in rows:
            entry = dict(zip(columns, row.split(), strict=False))
            if entry and str(uid).encode() in (entry.get("uid"), entry.get("cuid")):
                found.append((kind, int(entry[id_column])))
    return found


def remove_sysv_ipc(objects: list[tuple[str, int]]) -> int:
    """IPC_RMID on each (as their owner or creator: without CAP_SYS_ADMIN root may not)."""
    for kind, ident in objects:
        if kind == "shm":
            libc.shmctl(ident, IPC_RMID, None)
        elif kind == "sem":
            libc.semctl(ident, 0, IPC_RMID)
        else:
            libc.msgctl(ident, IPC_RMID, None)
    return 0
