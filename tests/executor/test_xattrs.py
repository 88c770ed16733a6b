"""Extended attributes set from the host (E2B's file metadata): only ``user.``, only inside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.executor.files import SandboxFiles
from dsec.protocol.errors import InvalidRequest


def test_xattrs_stay_in_the_user_namespace_and_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside.txt"
    (root / "tmp").mkdir(parents=True)
    outside.write_text("host")
    (root / "tmp" / "real.txt").write_text("inside")
    # An absolute link names the sandbox's own tree: it resolves beneath the root.
    os.symlink(str(outside), root / "tmp" / "link")
    files = SandboxFiles(root, uid=os.getuid(), gid=os.getgid())
    files.write_bytes(str(outside), b"the sandbox's own")  # the path the link names, inside
    files.set_xattrs("/tmp/link", "user.e2b.", {"k": "v"})
    assert os.listxattr(outside) == []
    assert files.xattrs(str(outside), "user.e2b.") == {"k": "v"}
    files.set_xattrs("/tmp/real.txt", "user.e2b.", {"a": "1", "b": "2"})
    files.set_xattrs("/tmp/real.txt", "user.e2b.", {"b": "3"})
    assert files.xattrs("/tmp/real.txt", "user.e2b.") == {"b": "3"}
    for prefix in ("trusted.e2b.", "security.", "user"):
        with pytest.raises(InvalidRequest):
            files.set_xattrs("/tmp/real.txt", prefix, {"k": "v"})
    with pytest.raises(InvalidRequest):
        files.set_xattrs("/tmp/real.txt", "user.e2b.", {"k" * 300: "v"})
