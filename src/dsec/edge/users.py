"""Users of a sandbox's /etc/passwd: its initial user, resolved against its image before anything
runs in it; a started process's user, against the file as it is then (:mod:`.processes`)."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

from dsec.backends.base import User
from dsec.images.hosttree import HostTree
from dsec.protocol.errors import InvalidRequest

_PASSWD_MAX = 4 << 20  # bytes read of an image's /etc/passwd (a layer's content is a tenant's)
_OPAQUE = "trusted.overlay.opaque"


def _passwd(layer_dirs: list[Path]) -> str:
    """The image's /etc/passwd as its overlay would show it: the top-most layer with an entry
    wins. A committed layer is a tenant's tree (its /etc may be a link to the host's), so
    nothing is followed: a link or whiteout there hides the lower layers and lists no user."""
    for d in reversed(layer_dirs):
        with HostTree(d) as tree:
            etc = tree.lstat("etc")
            if etc is None:
                continue
            if not stat.S_ISDIR(etc.st_mode):
                return ""  # /etc replaced by a link, a file or a whiteout
            if tree.lstat("etc/passwd") is not None:
                return (tree.read_bytes("etc/passwd", _PASSWD_MAX) or b"").decode(errors="replace")
            if tree.getxattr("etc", _OPAQUE) == b"y":
                return ""
    return ""


def _has_dir(layer_dirs: list[Path], path: str) -> bool:
    for d in layer_dirs:
        with HostTree(d) as tree:
            if tree.is_dir(path):
                return True
    return False


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
    if ".." in user.home.split("/") or not _has_dir(layer_dirs, user.home):
        return dataclasses.replace(user, home="/")
    return user
