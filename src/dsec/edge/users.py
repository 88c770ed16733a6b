"""Users of a sandbox's /etc/passwd: its initial user, resolved against its image before anything
runs in it; a started process's user, against the file as it is then (:mod:`.processes`)."""

from __future__ import annotations

import dataclasses
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


def find_user(passwd: str, name: str) -> User | None:
    """``name`` (a user name or a numeric uid) as /etc/passwd text ``passwd`` lists it, its home
    as written there (``/`` if empty); root and a bare uid need no entry (home ``/``)."""
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and name in (parts[0], parts[2]) and parts[2].isdigit() and parts[3].isdigit():
            return User(name=parts[0], uid=int(parts[2]), gid=int(parts[3]), home=parts[5] or "/")
    if name == "root":
        return User("root", 0, 0, "/")
    if name.isdigit():
        return User(name, int(name), int(name), "/")
    return None


def resolve_user(layer_dirs: list[Path], name: str) -> User:
    """``name`` is a user name from the image's /etc/passwd or a numeric uid."""
    user = find_user(_passwd(layer_dirs), name)
    if user is None:
        raise InvalidRequest(f"init_user {name!r} is not a user of this image (not in its /etc/passwd)")
    # Commands start in the user's home; an image without it starts them in /.
    if not any((d / user.home.lstrip("/")).is_dir() for d in layer_dirs):
        return dataclasses.replace(user, home="/")
    return user
