"""The few Linux calls the runner needs that Python's stdlib lacks, through libc.

A module of its own so every part of the runner shares one handle, loaded once at start (the
zygote and every call process inherit it), and the raw constants sit beside it.
"""

from __future__ import annotations

import ctypes

CLONE_NEWIPC, CLONE_NEWNET, IPC_RMID = 0x08000000, 0x40000000, 0
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
MADV_MERGEABLE, ADDR_NO_RANDOMIZE, PER_QUERY = 12, 0x0040000, 0xFFFFFFFF
libc = ctypes.CDLL(None, use_errno=True)
