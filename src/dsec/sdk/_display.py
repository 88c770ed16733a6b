"""The screen of a full VM: screenshots and keyboard/mouse input (``Sandbox`` calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeVar

from dsec.protocol.models import InputEvent
from dsec.protocol.ops import Call, Screenshot, SendInput

R = TypeVar("R")


class SandboxDisplayCalls:
    if TYPE_CHECKING:

        async def _call(self, op: Call[R], *, timeout: float | None = None) -> R: ...

    async def screenshot(self) -> bytes:
        """What the VM's display shows now, as PNG bytes (full VMs: ``run_vm``)."""
        return (await self._call(Screenshot())).png

    async def send_input(self, events: list[InputEvent]) -> int:
        """Keyboard and mouse events, in order (see :class:`~dsec.protocol.models.InputEvent`)."""
        return await self._call(SendInput(events=events))

    async def press(self, *keys: str) -> int:
        """Press ``keys`` together (QEMU qcodes: "ctrl", "alt", "ret", "a", "f1"...)."""
        return await self.send_input([InputEvent(type="key", keys=list(keys))])

    async def type_text(self, text: str) -> int:
        return await self.send_input([InputEvent(type="text", text=text)])

    async def click(self, button: Literal["left", "right", "middle"] = "left") -> int:
        return await self.send_input([InputEvent(type="click", button=button)])

    async def point(self, x: int, y: int) -> int:
        """Put the pointer on pixel (x, y) of the 1024x768 screen (the VM's tablet: absolute)."""
        return await self.send_input([InputEvent(type="point", x=x, y=y)])

    async def move_mouse(self, dx: int, dy: int) -> int:
        """Move the pointer by (dx, dy) pixels (the PS/2 mouse is relative)."""
        return await self.send_input([InputEvent(type="move", x=dx, y=dy)])
