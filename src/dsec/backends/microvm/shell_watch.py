"""A microVM session shell as its guest agent watches it (``guest/PROTOCOL.md``, WATCH).

The edge cannot see a guest's processes, so the agent does what :class:`dsec.executor.idle.
ShellView` does from the host's /proc for a container's shell: it records where the shell
waits for its next command (its /proc/PID/syscall line, right after a no-op), tells whether it
waits exactly there again, and forwards what the shell's pipes hold followed by the edge's
token. Where a command ends is then decided by nothing the command can fake, in a microVM too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dsec.executor.idle import until_waiting

# WATCH's ops and WATCHED's answers (PROTOCOL.md)
CALIBRATE, CHECK, MARK = 1, 2, 3
NO, YES, UNWATCHED = 0, 1, 2

Ask = Callable[[bytes], Awaitable[bytes]]  # one WATCH round trip: its WATCHED payload


class GuestShellView:
    """:class:`dsec.executor.idle.ShellWatch` through the guest agent."""

    def __init__(self, ask: Ask) -> None:
        self._ask = ask

    async def calibrate(self) -> bool:
        async def waiting() -> bool | None:
            answer = (await self._ask(bytes([CALIBRATE])))[0]
            return None if answer == UNWATCHED else answer == YES

        return await until_waiting(waiting)

    async def idle(self) -> bool | None:
        answer = (await self._ask(bytes([CHECK])))[0]
        return None if answer == UNWATCHED else answer == YES

    async def mark_end(self, token: bytes) -> tuple[bool, bool]:
        out, err = (await self._ask(bytes([MARK]) + token))[:2]
        return out == YES, err == YES
