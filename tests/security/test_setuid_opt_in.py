"""no_new_privs and its one opt-out (issue 30: passwordless sudo in E2B's base).

Every process DSec starts in a container sandbox has no_new_privs, so a setuid program gains
nothing. A sandbox created with ``allow_setuid`` (the E2B front sets it for ``e2b:base``) starts
its processes without it, so ``sudo`` works; root reached that way must have exactly what a
command run as root has (capability sets, seccomp filter, cgroup, Landlock domain scoping),
since the sandbox's creator can run any command as root already. Both kinds run from E2B's
base layer (it has ``sudo`` and the ``user`` account)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest

from dsec import DSecClient, DSecContainerRunArgs, Sandbox
from dsec.images.base import E2B_BASE_REF, E2B_PACKAGES, E2B_RECIPE, add_e2b_user, ensure_base_layer
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.processes import ProcessStart
from dsec.sdk._pty import _events

# What must be equal between root via sudo and a command run as root.
_FIELDS = (
    "Uid",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
)
_SUID = "cp /usr/bin/python3 /tmp/suid-python && chmod 4755 /tmp/suid-python"
_SUID_STATUS = ["/tmp/suid-python", "-c", "print(open('/proc/self/status').read())"]


@pytest.fixture(scope="module")
async def e2b_layer(node: EmbeddedNode) -> str:
    await asyncio.to_thread(
        ensure_base_layer,
        node.store,
        E2B_BASE_REF,
        packages=E2B_PACKAGES,
        customize=add_e2b_user,
        recipe=E2B_RECIPE,
    )
    return E2B_BASE_REF


@pytest.fixture
async def boxes(client: DSecClient, e2b_layer: str) -> AsyncIterator[dict[str, Sandbox]]:
    """One sandbox without the opt-in and one with it, both from E2B's base."""
    made: dict[str, Sandbox] = {}
    try:
        made["plain"] = await client.run_container(DSecContainerRunArgs(container_image=e2b_layer))
        made["setuid"] = await client.run_container(
            DSecContainerRunArgs(container_image=e2b_layer, allow_setuid=True)
        )
        yield made
    finally:
        for sb in made.values():
            await sb.stop()


async def run_as(sb: Sandbox, user: str, argv: list[str]) -> tuple[int | None, str]:
    """``argv`` as ``user`` over the process route (as E2B's envd calls it): exit code and
    stdout with stderr after it."""
    req = ProcessStart(argv=argv, user=user, stdin=False)
    lines = sb._t.lines("POST", sb._base + "/processes", json_body=req.model_dump(exclude_none=True))
    out, err, code = bytearray(), bytearray(), None
    async for ev in _events(lines):
        if ev.t == "out" and ev.data:
            out += ev.data
        elif ev.t == "err" and ev.data:
            err += ev.data
        elif ev.t == "end":
            code = ev.exit_code
    return code, (out + err).decode(errors="replace")


def status(text: str) -> dict[str, str]:
    """The fields of /proc/PID/status that tell privilege, whitespace-normalised."""
    found = dict(re.findall(r"^(\w+):\s*(.*?)\s*$", text, re.M))
    return {k: " ".join(found[k].split()) for k in _FIELDS}


async def test_without_opt_in_every_process_has_nnp(boxes: dict[str, Sandbox]) -> None:
    sb = boxes["plain"]
    grep = ["grep", "NoNewPrivs", "/proc/self/status"]
    seen = {
        "exec": (await sb.exec(grep)).stdout,
        "session": (await sb.run_shell("grep NoNewPrivs /proc/self/status")).stdout,
        "root": (await run_as(sb, "root", grep))[1],
        "user": (await run_as(sb, "user", grep))[1],
    }
    async with await sb.open_pty(["grep", "NoNewPrivs", "/proc/self/status"], user="user") as pty:
        seen["pty"] = b"".join([d async for d in pty.output()]).decode()
    assert {k: v.split() for k, v in seen.items()} == {k: ["NoNewPrivs:", "1"] for k in seen}, seen
    # A setuid-root program gains nothing: no euid 0, no capability.
    assert (await sb.run_shell(_SUID)).exit_code == 0
    code, text = await run_as(sb, "user", _SUID_STATUS)
    assert code == 0, text
    got = status(text)
    assert (got["Uid"], got["CapPrm"], got["CapEff"]) == ("1000 1000 1000 1000", "0" * 16, "0" * 16), got
    code, text = await run_as(sb, "user", ["sudo", "-n", "true"])
    assert code != 0 and "no new privileges" in text, text


async def test_opt_in_sudo_is_root_and_nothing_more(boxes: dict[str, Sandbox]) -> None:
    sb = boxes["setuid"]
    # Quietly, as on E2B: the layer resolves the sandbox's hostname and asks no audit record.
    assert await run_as(sb, "user", ["sudo", "-n", "true"]) == (0, "")
    code, as_root = await run_as(sb, "root", ["cat", "/proc/self/status"])
    assert code == 0, as_root
    code, via_sudo = await run_as(sb, "user", ["sudo", "-n", "cat", "/proc/self/status"])
    assert code == 0, via_sudo
    root, sudo = status(as_root), status(via_sudo)
    assert root["NoNewPrivs"] == "0" and root["Uid"] == "0 0 0 0", root
    assert root["Seccomp"] == "2" and root["CapBnd"] == root["CapEff"] != "0" * 16, root
    assert sudo == root, (sudo, root)
    # A setuid-root copy of python gets the same (not sudo's doing).
    assert (await run_as(sb, "root", ["sh", "-c", _SUID]))[0] == 0
    code, text = await run_as(sb, "user", _SUID_STATUS)
    assert code == 0, text
    assert {k: v for k, v in status(text).items() if k != "Uid"} == {
        k: v for k, v in root.items() if k != "Uid"
    }
    # The cgroup is the caller's: sudo moves nothing out of the sandbox's accounting.
    code, text = await run_as(
        sb, "user", ["sh", "-c", "cat /proc/self/cgroup; echo --; sudo -n cat /proc/self/cgroup"]
    )
    mine, _, theirs = text.partition("--\n")
    assert code == 0 and mine and mine == theirs, text


async def test_opt_in_root_via_sudo_keeps_landlock_scoping(boxes: dict[str, Sandbox]) -> None:
    """Root via sudo stays in its caller's Landlock domain: it cannot read what another
    entrance's root process holds, exactly as a command run as root cannot."""
    sb = boxes["setuid"]
    held = (await sb.run_shell("SECRET=s3 exec sleep 600 >/dev/null 2>&1 &\necho $!")).stdout.strip()
    assert held.isdigit(), held
    read = f"cat /proc/{held}/environ >/dev/null 2>&1 && echo read || echo denied"
    assert (await run_as(sb, "root", ["sh", "-c", read]))[1].strip() == "denied"
    assert (await run_as(sb, "user", ["sudo", "-n", "sh", "-c", read]))[1].strip() == "denied"
    assert (await sb.run_shell(read)).stdout.strip() == "read"  # the probe can read: same domain


async def test_opt_in_refused_where_it_does_not_apply(client: DSecClient) -> None:
    """A 400 at the API for gVisor and VMs, whose processes DSec does not start through
    dsec-enter; the SDK's own check refuses it before any request."""
    with pytest.raises(InvalidRequest, match="allow_setuid applies to crun containers only"):
        DSecContainerRunArgs(container_image="debian:bookworm", runtime="gvisor", allow_setuid=True).to_spec()
    for extra in ({"runtime": "gvisor"}, {"type": "microvm"}, {"type": "vm"}):
        body = {"spec": {"image": "debian:bookworm", "allow_setuid": True, **extra}}
        with pytest.raises(InvalidRequest, match="allow_setuid applies to crun containers only"):
            await client._t.request("POST", "/v1/sandboxes", json_body=body)
