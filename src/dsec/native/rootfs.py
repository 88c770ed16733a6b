"""Starting the OCI runtime on a sandbox root mounted out of the host's sight: ``dsec-rootfs``.

The overlay root is mounted in a mount namespace of the helper's own, which becomes crun's
container's (``own_root``) or which runsc copies for its sandbox (see container/backend.py).
That used to happen in a ``preexec_fn``, and any preexec_fn makes Python fork() rather than vfork(): the
child copies the page tables of the whole edge and the edge then takes copy-on-write faults, a
cost that grows with the sandboxes the edge holds (perf at 3,000 held: about a third of the
edge's CPU per create). ``dsec_rootfs.c`` does the unshare and mount after a plain
vfork+exec instead.
"""

from __future__ import annotations

import asyncio
import os
from asyncio.subprocess import DEVNULL
from pathlib import Path

from dsec.executor.fdwait import PipeReader
from dsec.native import spawner
from dsec.native.build import Program
from dsec.protocol.errors import InfraFailure, InfraReason

SOURCE = Path(__file__).with_name("dsec_rootfs.c")
NAME = "dsec-rootfs"
PROGRAM = Program(NAME, SOURCE)


def build_helper(bin_dir: Path) -> Path:
    """Compile ``dsec-rootfs`` (static, once per source version) into ``bin_dir``, which
    sandboxes must not see: it runs as root on the host."""
    return PROGRAM.build(bin_dir)


async def run(
    helper: Path,
    overlay_options: str,
    rootfs: Path,
    argv: list[str],
    env: dict[str, str],
    *,
    new_core_cookie: bool = False,
    hide_net_sysctls: bool = False,
    own_root: bool = False,
) -> int:
    """Run ``argv`` in a private mount namespace with the overlay mounted on ``rootfs`` (and,
    if asked, a fresh core scheduling cookie, and an empty ``/proc/sys/net``: see the helper);
    its exit status. ``own_root``: the namespace becomes the container's, holding only the
    tree under ``rootfs`` once ``argv`` has succeeded (crun's config has no mount namespace).
    InfraFailure: storage when the namespace, the mount or the cookie cannot be made; runtime
    when ``argv`` cannot start or the namespace cannot become the container's."""
    args = [
        *(["--new-core-cookie"] if new_core_cookie else []),
        *(["--hide-net-sysctls"] if hide_net_sysctls else []),
        *(["--own-root"] if own_root else []),
        overlay_options,
        str(rootfs),
        *argv,
    ]
    said, rc = await _launch(helper, args, env)
    if said.startswith("exec "):
        raise InfraFailure(f"cannot start {argv[0]}: {said[-1500:]}", reason=InfraReason.runtime)
    if said.startswith("own root: "):
        msg = f"cannot give the sandbox its own mount namespace: {said.removeprefix('own root: ')[-1500:]}"
        raise InfraFailure(msg, reason=InfraReason.runtime)
    if said:
        lower = overlay_options.split(",", 1)[0].removeprefix("lowerdir=")
        msg = f"cannot mount the sandbox root (overlay over {lower}): {said[-1500:]}"
        raise InfraFailure(msg, reason=InfraReason.storage)
    return rc


async def _launch(helper: Path, args: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run the helper; what it said on stderr (its own failures only: the runtime's stdio is
    /dev/null) and its exit code. The spawner's adopted child where a spawner runs: the
    runtime's detached processes (the sandbox's init, crun's intermediate) are then reaped by
    the spawner, not by the host's init (spawner.Adopted)."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        child = spawner.spawn_adopted(str(helper), [str(helper), *args], env, {0: null, 1: null, 2: err_w})
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
        os.close(null)
    if child is None:
        os.close(err_r)
        proc = await spawner.create_subprocess_exec(
            str(helper), *args, stdin=DEVNULL, stdout=DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
        )
        assert proc.stderr is not None
        told = await proc.stderr.read()
        return told.decode(errors="replace").strip(), await proc.wait()
    err = PipeReader(err_r)
    try:
        said = bytearray()
        while chunk := await err.read():
            said += chunk
        return said.decode(errors="replace").strip(), await child.wait()
    except BaseException:
        child.kill()
        raise
    finally:
        err.close()
        child.close()
