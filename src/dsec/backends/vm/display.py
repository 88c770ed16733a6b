"""The display and input of a full VM, through QMP: ``screendump`` (PNG) and
``input-send-event`` (keys as QEMU qcodes, text typed as key presses, mouse buttons, relative
moves of the PS/2 mouse, absolute points on the virtio tablet)."""

from __future__ import annotations

from typing import Any

from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import InputEvent

SCREEN = (1024, 768)  # vga=791
_ABS_MAX = 0x7FFF  # QEMU scales absolute axes to 0..32767

# Characters typed as a key (and shift when needed); everything else is refused, not guessed.
_PLAIN = {c: c for c in "abcdefghijklmnopqrstuvwxyz0123456789"}
_PLAIN.update({" ": "spc", "\n": "ret", "\t": "tab", "-": "minus", "=": "equal", ",": "comma", ".": "dot"})
_PLAIN.update({"/": "slash", ";": "semicolon", "'": "apostrophe", "[": "bracket_left", "]": "bracket_right"})
_PLAIN.update({"\\": "backslash", "`": "grave_accent"})
_SHIFTED = {c.upper(): c for c in "abcdefghijklmnopqrstuvwxyz"}
_SHIFTED.update(dict(zip('!@#$%^&*()_+<>?:"{}|~', "1234567890", strict=False)))
_SHIFTED.update({"_": "minus", "+": "equal", "<": "comma", ">": "dot", "?": "slash", ":": "semicolon"})
_SHIFTED.update(
    {'"': "apostrophe", "{": "bracket_left", "}": "bracket_right", "|": "backslash", "~": "grave_accent"}
)


def _key(qcode: str, down: bool) -> dict[str, Any]:
    return {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": qcode}}}


def _press(*qcodes: str) -> list[dict[str, Any]]:
    """Press keys in order (a chord), release them in reverse."""
    return [_key(q, True) for q in qcodes] + [_key(q, False) for q in reversed(qcodes)]


def qmp_events(events: list[InputEvent]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ev in events:
        if ev.type == "key":
            out += _press(*(ev.keys or []))
        elif ev.type == "text":
            for ch in ev.text or "":
                if ch in _PLAIN:
                    out += _press(_PLAIN[ch])
                elif ch in _SHIFTED:
                    out += _press("shift", _SHIFTED[ch])
                else:
                    raise InvalidRequest(f"cannot type {ch!r}: send it as keys (QEMU qcodes) instead")
        elif ev.type == "move":
            out += [
                {"type": "rel", "data": {"axis": "x", "value": ev.x or 0}},
                {"type": "rel", "data": {"axis": "y", "value": ev.y or 0}},
            ]
        elif ev.type == "point":
            if not (0 <= (ev.x or 0) < SCREEN[0] and 0 <= (ev.y or 0) < SCREEN[1]):
                raise InvalidRequest(f"point ({ev.x}, {ev.y}) is off the {SCREEN[0]}x{SCREEN[1]} screen")
            out += [
                {"type": "abs", "data": {"axis": "x", "value": (ev.x or 0) * _ABS_MAX // (SCREEN[0] - 1)}},
                {"type": "abs", "data": {"axis": "y", "value": (ev.y or 0) * _ABS_MAX // (SCREEN[1] - 1)}},
            ]
        elif ev.type == "click":
            for down in (True, False):
                out.append({"type": "btn", "data": {"down": down, "button": ev.button}})
    return out
