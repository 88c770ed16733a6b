"""Host-side walks of a sandbox's layers stay inside them.

The edge reads a sandbox's writable layer and its committed layers as host root (changes,
pack, the image's /etc/passwd). The agent chose every name in them: a link to ``/`` or to a
host directory must read as a link, never as the host's files.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dsec import DSecClient, InvalidRequest, Sandbox
from dsec.protocol.models import ChangeKind, FileType
from tests.conftest import BASE, Sandboxes


async def test_changes_under_a_link_to_the_root_list_nothing_of_the_host(
    sandbox: Sandbox, host_secret: Path
) -> None:
    r = await sandbox.run_shell(f"ln -s / /hostlink && ln -s {host_secret.parent} /secretdir")
    assert r.exit_code == 0, r
    # On the host these name the secret's directory: the walk must not go there.
    assert await sandbox.changes(under=f"/hostlink{host_secret.parent}") == []
    assert await sandbox.changes(under="/secretdir") == []
    listed = {(c.path, c.kind, c.type) for c in await sandbox.changes()}
    assert ("/hostlink", ChangeKind.added, FileType.symlink) in listed
    assert ("/secretdir", ChangeKind.added, FileType.symlink) in listed
    assert not any(host_secret.name in c.path for c in await sandbox.changes()), listed


async def test_changes_still_list_what_the_sandbox_wrote_below_a_real_directory(sandbox: Sandbox) -> None:
    await sandbox.run_shell("mkdir -p /srv/a/b && echo x > /srv/a/b/f; ln -s /etc /srv/a/l; rm /etc/issue")
    got = {(c.path, c.kind) for c in await sandbox.changes(under="/srv/a")}
    assert got == {
        ("/srv/a/b", ChangeKind.added),
        ("/srv/a/b/f", ChangeKind.added),
        ("/srv/a/l", ChangeKind.added),
    }
    etc = {(c.path, c.kind) for c in await sandbox.changes(under="/etc")}
    assert ("/etc/issue", ChangeKind.deleted) in etc


async def test_a_tenant_layer_cannot_point_the_user_lookup_at_the_host(
    client: DSecClient, make_sandbox: Sandboxes, tmp_path: Path
) -> None:
    """init_user is looked up in the image's /etc/passwd on the host: a tenant's layer (an
    import, or a commit) whose /etc links to a host directory must not make the host's passwd
    the image's."""
    user = f"hostonly{uuid.uuid4().hex[:6]}"
    hostdir = tmp_path / "hostetc"
    hostdir.mkdir()
    (hostdir / "passwd").write_text(f"{user}:x:4242:4242::/:/bin/sh\n")
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "etc").symlink_to(hostdir)
    ref = f"test/etc-link:{uuid.uuid4().hex[:12]}"
    await client.import_layer(layer, ref)
    with pytest.raises(InvalidRequest, match="not a user of this image"):
        await make_sandbox(container_image=None, layers=[BASE, ref], init_user=user)
