"""OCI images end to end: import through the API, then run a sandbox on them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dsec import DSecClient, InvalidRequest
from tests.conftest import Sandboxes
from tests.images.ocikit import WH, D, F, S, SaveImage, docker_save, layer, oci_layout


def busybox_layer() -> bytes:
    """A self-contained base: static busybox with the applets a session needs."""
    data = Path("/bin/busybox").read_bytes()
    entries = [D("bin"), F("bin/busybox", data, mode=0o755)]
    entries += [S(f"bin/{a}", "busybox") for a in ("sh", "cat", "ls", "echo", "test", "id")]
    entries += [D("etc"), F("etc/motd", "from base\n"), F("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n")]
    entries += [D("root"), D("tmp", mode=0o1777)]
    return layer(*entries)


TOP = layer(D("app"), F("app/hello.txt", "hello from the image\n"), WH("etc/motd"))


@pytest.mark.parametrize("form", ["docker-save", "oci-layout"])
async def test_imported_image_runs_with_deletions_kept(
    client: DSecClient, make_sandbox: Sandboxes, tmp_path: Path, form: str
) -> None:
    base = busybox_layer()
    if form == "docker-save":
        archive = docker_save(tmp_path / "img.tar", [SaveImage(["demo:latest"], [base, TOP])])
    else:
        archive = oci_layout(tmp_path / "layout", [base, TOP])  # a directory: the SDK tars it
    ref = f"demo:{uuid.uuid4().hex[:10]}"
    seen: list[str] = []
    layers = await client.import_image(archive, ref, progress=lambda stage, done, total: seen.append(stage))
    assert len(layers) == 2 and seen, "progress events reach the caller"
    sb = await make_sandbox(container_image=ref)
    r = await sb.run_shell("cat /app/hello.txt; test -e /etc/motd || echo motd-deleted; id -u")
    assert r.stdout == "hello from the image\nmotd-deleted\n0\n", r
    again = await client.import_image(archive, f"demo:{uuid.uuid4().hex[:10]}")
    assert [x.digest for x in again] == [x.digest for x in layers]  # stored once


async def test_corrupted_archive_is_refused(client: DSecClient, tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "img.tar", [SaveImage(["demo:latest"], [busybox_layer()])])
    data = bytearray(archive.read_bytes())
    where = data.find(b"from base")
    data[where] ^= 0x01  # one flipped bit inside a layer
    archive.write_bytes(bytes(data))
    with pytest.raises(InvalidRequest, match=r"digest|diff_id"):
        await client.import_image(archive, f"bad:{uuid.uuid4().hex[:10]}")
