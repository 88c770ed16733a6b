"""`dsec layer build` and `Sandbox.commit` on the real runtime."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from dsec import DSecClient
from dsec.images.mount import mount_erofs, umount
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import BuildFailed
from dsec.sdk.build import BuildEvent
from tests.conftest import BASE, Sandboxes

DOCKERFILE = """\
# a comment, then a continuation
FROM debian:bookworm
ENV GREETING=hello \\
    WHO=world
WORKDIR /app
COPY app.py ./
COPY data /app/data
RUN python3 app.py > out.txt && echo "$GREETING $WHO" > greeting.txt
RUN rm /etc/motd && mkdir -p /root/.cache/pip && echo cached > /root/.cache/pip/x \\
    && echo 42 > /tmp/answer && echo history > /root/.bash_history && echo more > /var/tmp/x
RUN rm -rf /usr/share/doc && mkdir /srv/keep && echo kept > /srv/keep/file
"""


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "data" / "sub").mkdir(parents=True)
    (ctx / "app.py").write_text("print('built by app.py')\n")
    (ctx / "data" / "sub" / "input.csv").write_text("a,b\n1,2\n")
    (ctx / "data" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (ctx / "data" / "run.sh").chmod(0o755)
    (ctx / "data" / "link").symlink_to("run.sh")
    return ctx


async def test_build_layer_applies_steps_and_scrubs_residue(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode, context: Path, tmp_path: Path
) -> None:
    ref = f"built:{uuid.uuid4().hex[:10]}"
    events: list[BuildEvent] = []
    before = {s.id for s in await client.list()}
    info = await client.build_layer(DOCKERFILE, context, ref, progress=events.append)
    assert ref in info.names
    assert {s.id for s in await client.list()} == before  # the build sandbox is gone
    steps = [e.description for e in events if not e.output]
    assert steps[0].startswith("build sandbox on debian:bookworm") and steps[-1] == f"commit {ref}"

    sb = await make_sandbox(container_image=None, layers=[BASE, ref])
    r = await sb.run_shell(
        "cat /app/out.txt /app/greeting.txt /app/data/sub/input.csv;"
        " /app/data/run.sh; readlink /app/data/link"
    )
    assert r.stdout == "built by app.py\nhello world\na,b\n1,2\nrun\nrun.sh\n", r
    r = await sb.run_shell(
        "for p in /etc/motd /root/.cache /tmp/answer /root/.bash_history /var/tmp/x /usr/share/doc; do"
        " test -e $p && echo present $p; done; cat /srv/keep/file; stat -c %U /app/app.py"
    )
    assert r.stdout == "kept\nroot\n", r  # deletions kept, residue scrubbed

    # The layer holds only the diff, and nothing of the node's own tools.
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_erofs(node.store.blob_path(info.digest), mnt)
    try:
        assert not (mnt / ".dsec").exists()
        assert not (mnt / "bin").exists()  # untouched base content is not copied into the diff
        assert (mnt / "app" / "out.txt").is_file()
    finally:
        umount(mnt)


async def test_failed_step_reports_its_line_and_output(client: DSecClient, context: Path) -> None:
    before = {s.id for s in await client.list()}
    bad = "FROM debian:bookworm\nRUN echo starting\nRUN echo to-stderr >&2; exit 7\n"
    events: list[BuildEvent] = []
    with pytest.raises(BuildFailed, match=r"line 3.*exited with 7[\s\S]*to-stderr"):
        await client.build_layer(bad, context, f"bad:{uuid.uuid4().hex[:10]}", progress=events.append)
    assert b"starting\n" in [e.output for e in events]  # step output streams as it comes
    assert {s.id for s in await client.list()} == before
    with pytest.raises(Exception, match="outside the context"):
        await client.build_layer("FROM debian:bookworm\nCOPY ../secret /x\n", context, "escape:1")


async def test_commit_keeps_the_sandbox_running(client: DSecClient, make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    await sb.run_shell("mkdir -p /work && echo state > /work/s && echo junk > /work/junk.log")
    info = await sb.commit(f"snap:{uuid.uuid4().hex[:10]}", exclude=["work/*.log"])
    assert (await sb.run_shell("cat /work/s")).stdout == "state\n"
    fresh = await make_sandbox(container_image=None, layers=[BASE, info.digest])
    r = await fresh.run_shell("cat /work/s; test -e /work/junk.log || echo no-junk")
    assert r.stdout == "state\nno-junk\n"
    assert (await client.get(sb.id)).info.state.value == "running"
