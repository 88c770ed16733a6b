"""Starting the OCI runtime on a sandbox root mounted out of the host's sight: ``dsec-rootfs``.

The overlay root is mounted in a mount namespace of the helper's own, which becomes crun's
container's (``own_root``) or which runsc copies for its sandbox (see backend.py). That used to
happen in a ``preexec_fn``, and any preexec_fn makes Python fork() rather than vfork(): the
child copies the page tables of the whole edge and the edge then takes copy-on-write faults, a
cost that grows with the sandboxes the edge holds (perf at 3,000 held: about a third of the
edge's CPU per create). ``rootfs/dsec_rootfs.c`` does the unshare and mount after a plain
vfork+exec instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from dsec.backends.container import init
from dsec.executor import spawner
from dsec.protocol.errors import InfraFailure

SOURCE = Path(__file__).parent / "rootfs" / "dsec_rootfs.c"
NAME = "dsec-rootfs"


def build_helper(bin_dir: Path) -> Path:
    """Compile ``dsec-rootfs`` (static, once per source version) into ``bin_dir``, which
    sandboxes must not see: it runs as root on the host."""
    return init.build_static(SOURCE, NAME, bin_dir)


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
    proc = await spawner.create_subprocess_exec(
        str(helper),
        *(["--new-core-cookie"] if new_core_cookie else []),
        *(["--hide-net-sysctls"] if hide_net_sysctls else []),
        *(["--own-root"] if own_root else []),
        overlay_options,
        str(rootfs),
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        # The helper's own failures only: the runtime's stdio is /dev/null.
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stderr is not None
    said = (await proc.stderr.read()).decode(errors="replace").strip()
    rc = await proc.wait()
    if said.startswith("exec "):
        raise InfraFailure(f"cannot start {argv[0]}: {said[-1500:]}", reason="runtime")
    if said.startswith("own root: "):
        msg = f"cannot give the sandbox its own mount namespace: {said.removeprefix('own root: ')[-1500:]}"
        raise InfraFailure(msg, reason="runtime")
    if said:
        lower = overlay_options.split(",", 1)[0].removeprefix("lowerdir=")
        msg = f"cannot mount the sandbox root (overlay over {lower}): {said[-1500:]}"
        raise InfraFailure(msg, reason="storage")
    return rc
