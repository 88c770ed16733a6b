"""A microVM sandbox's root cannot change its guest kernel, and so cannot reach its agent.

Every result of a microVM sandbox reaches the host through the guest agent, PID 1 of the
guest. Root in the guest that could load kernel code (a module, kexec), run BPF or perf
programs, map the virtio devices' registers through /dev/mem, or have the kernel run a helper
of its choosing (core dumps to a pipe, modprobe) could rewrite what the agent reports. Each
attempt below must fail, through a real microVM (each test boots one), and the agent must go on
answering.
"""

from __future__ import annotations

import json

import pytest

from dsec import Sandbox
from tests.conftest import Sandboxes
from tests.security.test_session_end import MICROVM, on_backend

# Each attempt's result: "ok" or the errno's name. Arguments are harmless if a call were
# allowed (an unload, a module image of zeros, a NULL program), so a wrong success shows up as
# a result, not as damage; the writes put back what the kernel already holds.
ATTEMPTS = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(n, *args):
    return "ok" if libc.syscall(n, *args) >= 0 else errno.errorcode[ctypes.get_errno()]
def opening(path, mode, data=None):
    try:
        with open(path, mode) as f:
            if data is not None:
                f.write(data)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
zeros = ctypes.create_string_buffer(64)
image = os.open("/etc/hostname", os.O_RDONLY)
print(json.dumps({
    "init_module": call(175, zeros, 64, b""),
    "finit_module": call(313, image, b"", 0),
    "kexec_load": call(246, 0, 0, 0, 0),
    "kexec_file_load": call(320, -1, -1, 0, 0, 1),  # KEXEC_FILE_UNLOAD
    "bpf": call(321, 5, 0, 0),  # BPF_PROG_LOAD
    "iopl": call(172, 3),
    "ioperm": call(173, 0, 1024, 1),
    "reboot": call(169, 0xFEE1DEAD, 672274793, 0, 0),  # ctrl-alt-del off: no reboot
    "mount": call(165, b"none", b"/mnt", b"tmpfs", 0, 0),
    "/dev/mem": opening("/dev/mem", "rb"),
    "/dev/snapshot": opening("/dev/snapshot", "rb"),
    "/proc/1/mem": opening("/proc/1/mem", "rb"),
    "core_pattern": opening("/proc/sys/kernel/core_pattern", "w", "core\n"),
    "modprobe": opening("/proc/sys/kernel/modprobe", "w", "\n"),
    "sysrq-trigger": opening("/proc/sysrq-trigger", "w"),
}))
"""

# root may leave a chroot (chroot into a subdirectory, walk up past it, chroot there): it lands
# in the guest's initramfs, where the agent's binary, the kernel's helpers and a /proc are.
CHROOT_ESCAPE = r"""
import errno, json, os
os.makedirs("/tmp/esc", exist_ok=True)
os.chroot("/tmp/esc")
for _ in range(30):
    os.chdir("..")
os.chroot(".")
def opening(path):
    try:
        open(path, "a").close()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
names = ["/agent", "/bin/modprobe", "/init", "/proc/sys/kernel/core_pattern", "/sys/kernel/uevent_helper"]
print(json.dumps({"root": sorted(os.listdir("/")), **{name: opening(name) for name in names}}))
"""


async def _run_json(sandbox: Sandbox, script: str) -> dict[str, object]:
    await sandbox.write_file("/tmp/attempt.py", script)
    r = await sandbox.run_shell("python3 /tmp/attempt.py", timeout=120)
    assert r.exit_code == 0, r
    result: dict[str, object] = json.loads(r.stdout)
    return result


async def _agent_answers(sandbox: Sandbox) -> None:
    """The agent still spawns, and root still does what a root user expects."""
    r = await sandbox.run_shell("touch /tmp/f && chown 1000:1000 /tmp/f && stat -c %u /tmp/f", timeout=60)
    assert (r.exit_code, r.stdout) == (0, "1000\n"), r


@pytest.mark.parametrize("backend", [MICROVM])
async def test_guest_root_cannot_load_kernel_code_or_reach_the_agent(
    make_sandbox: Sandboxes, backend: str
) -> None:
    sandbox = await on_backend(make_sandbox, backend)
    result = await _run_json(sandbox, ATTEMPTS)
    # EPERM: a capability the process lacks or a switch that is off; EACCES: /proc/1 is outside
    # the process's Landlock domain; EROFS: the kernel's knobs are mounted read-only.
    assert result == {
        "init_module": "EPERM", "finit_module": "EPERM", "kexec_load": "EPERM",
        "kexec_file_load": "EPERM", "bpf": "EPERM", "iopl": "EPERM", "ioperm": "EPERM",
        "reboot": "EPERM", "mount": "EPERM", "/dev/mem": "EPERM", "/dev/snapshot": "EPERM",
        "/proc/1/mem": "EACCES", "core_pattern": "EROFS", "modprobe": "EROFS",
        "sysrq-trigger": "EROFS",
    }  # fmt: skip
    await _agent_answers(sandbox)


@pytest.mark.parametrize("backend", [MICROVM])
async def test_leaving_the_chroot_reaches_nothing_writable(make_sandbox: Sandboxes, backend: str) -> None:
    sandbox = await on_backend(make_sandbox, backend)
    result = await _run_json(sandbox, CHROOT_ESCAPE)
    assert "agent" in result.pop("root"), result  # (the escape itself works: root may chroot)
    assert result == {
        "/agent": "EROFS", "/bin/modprobe": "EROFS", "/init": "EROFS",
        "/proc/sys/kernel/core_pattern": "EROFS", "/sys/kernel/uevent_helper": "EROFS",
    }  # fmt: skip
    await _agent_answers(sandbox)
