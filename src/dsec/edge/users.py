"""Resolving a sandbox's initial user against its image, before anything runs in it."""

from __future__ import annotations

from pathlib import Path

from dsec.backends.base import User
from dsec.protocol.errors import InvalidRequest


def _passwd(layer_dirs: list[Path]) -> str:
    # The top-most layer that has /etc/passwd wins, as it does in the overlay.
    for d in reversed(layer_dirs):
        path = d / "etc" / "passwd"
        if path.is_file() and not path.is_symlink():
            return path.read_text(errors="replace")
    return ""


def resolve_user(layer_dirs: list[Path], name: str) -> User:
    """``name`` is a user name from the image's /etc/passwd or a numeric uid."""
    for line in _passwd(layer_dirs).splitlines():
        parts = line.split(":")
        if len(parts) < 7:
            continue
        if parts[0] == name or parts[2] == name:
            home = parts[5] or "/"
            # Commands start in the user's home; an image without it starts them in /.
            if not any((d / home.lstrip("/")).is_dir() for d in layer_dirs):
                home = "/"
            return User(name=parts[0], uid=int(parts[2]), gid=int(parts[3]), home=home)
    if name == "root":
        return User("root", 0, 0, "/")
    if name.isdigit():
        return User(name, int(name), int(name), "/")
    raise InvalidRequest(f"init_user {name!r} is not a user of this image (not in its /etc/passwd)")
