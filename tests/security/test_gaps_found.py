"""Attacks that SUCCEED today: gaps in isolation found by the escape suite, kept as tests.

Each test asserts what should happen and is marked ``xfail(strict=True)`` with what happens
instead: the suite stays green while the gap is open, and turns red (XPASS) the moment a fix
lands, so whoever fixes it removes the marker and the test joins the suite for good.
"""

from __future__ import annotations

import pytest

from dsec import Sandbox
from tests.security.conftest import probe

# clone(2) with namespace flags, as fork: the child reports what it got and exits.
CLONE = r"""
import socket
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
out = {}
for label, flags in (("user", CLONE_NEWUSER), ("user+net", CLONE_NEWUSER | CLONE_NEWNET)):
    r, w = os.pipe()
    pid, e = syscall(56, flags | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]
        got = {"cap_eff": caps}
        try:
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
            got["raw_socket"] = "ok"
        except OSError as exc:
            got["raw_socket"] = err(exc)
        try:
            nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
            nl.bind((0, 0))
            got["nfnetlink"] = "ok"
        except OSError as exc:
            got["nfnetlink"] = err(exc)
        os.write(w, json.dumps(got).encode())
        os._exit(0)
    os.close(w)
    if pid > 0:
        os.waitpid(pid, 0)
        out[label] = json.loads(os.read(r, 4096))
    else:
        out[label] = e
    os.close(r)
print(json.dumps(out))
"""


@pytest.mark.xfail(
    strict=True,
    reason="GAP: the seccomp profile denies unshare(2) but not clone(2)/clone3(2) with CLONE_NEWUSER: "
    "a child in a new user namespace has every capability there (CapEff 000001ffffffffff) and, "
    "with CLONE_NEWNET, raw sockets and nf_tables netlink (a large kernel attack surface)",
)
async def test_clone_into_a_new_user_namespace_is_refused(sandbox: Sandbox) -> None:
    out = await probe(sandbox, CLONE)
    assert out == {"user": "EPERM", "user+net": "EPERM"}, out


@pytest.mark.xfail(
    strict=True,
    reason="GAP: a session command can read its end-marker nonce ($__dsec_n, a variable of the "
    "shell that evals it) and print the marker itself: its recorded result ends early with the "
    "exit code it chose (0 for a command that exits 3); what it prints afterwards is dropped or "
    "lands in the NEXT command's result, and so does its real end marker",
)
async def test_a_command_cannot_forge_its_own_end_marker(sandbox: Sandbox) -> None:
    forge = (
        "printf '\\0%s:0\\0' \"$__dsec_n\"; printf '\\0%s\\0' \"$__dsec_n\" >&2; "
        "echo smuggled; echo smuggled-err >&2; (exit 3)"
    )
    first = await sandbox.run_shell(forge, session="s", timeout=60)
    second = await sandbox.run_shell("echo harness", session="s", timeout=60)
    # What the edge recorded must be what happened: exit 3 and "smuggled" for the first
    # command, exactly "harness" for the second.
    recorded = [e.result for e in (await sandbox.trajectory())[-2:]]
    assert (first.exit_code, second.stdout) == (3, "harness\n"), (first, second, recorded)
    assert "smuggled" in first.stdout, (first, second)
