"""runtime="gvisor" end to end through the SDK: the same calls as a crun sandbox, on gVisor's
kernel (runsc), and what that kernel hides from a sandbox that a crun sandbox shares."""

from __future__ import annotations

import os
import shutil

import pytest

from dsec import InvalidRequest, SandboxState
from dsec.backends.container import cgroups
from dsec.netpolicy import links
from tests.conftest import Sandboxes

pytestmark = pytest.mark.skipif(
    shutil.which("runsc") is None, reason="runtime='gvisor' needs runsc (Debian package runsc): not installed"
)


async def test_a_gvisor_sandbox_runs_shell_exec_files_and_pauses(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(runtime="gvisor")
    r = await sb.run_shell("cd /tmp && X=kept && echo hi")
    assert (r.stdout, r.exit_code) == ("hi\n", 0)
    r = await sb.run_shell('pwd; echo "$X"; echo err >&2; exit 3')
    assert (r.stdout, r.stderr, r.exit_code) == ("/tmp\nkept\n", "err\n", 3), "the session keeps its state"
    r = await sb.exec(["cat"], stdin="from stdin", cwd="/root")
    assert (r.stdout, r.exit_code) == ("from stdin", 0)

    # Files both ways: the host-side file API and the sandbox see each other's writes at once.
    await sb.write_file("/root/from-host", "host\n")
    assert (await sb.run_shell("cat /root/from-host")).stdout == "host\n"
    await sb.run_shell("echo inside > /root/from-inside")
    assert await sb.read_file("/root/from-inside") == b"inside\n"
    await sb.write_file("/root/from-inside", "rewritten\n")  # cached inside before: revalidated
    assert (await sb.run_shell("cat /root/from-inside")).stdout == "rewritten\n"
    changed = {c.path for c in await sb.changes("/root")}
    assert {"/root/from-host", "/root/from-inside"} <= changed, "writes land in the upper directory"

    # A timeout kills the command inside gVisor, and the next call gets a fresh shell.
    r = await sb.run_shell("sleep 1000", timeout=1)
    assert r.timed_out
    assert (await sb.run_shell("echo again")).stdout == "again\n"
    assert "sleep 1000" not in (await sb.run_shell("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")).stdout

    info = await sb.pause()
    assert info.state is SandboxState.paused
    frozen = (cgroups.sandbox_dir("freezer", sb.id) / "freezer.state").read_text().strip()
    assert frozen == "FROZEN", "the freezer stops the sentry, its stubs and its gofer"
    assert (await sb.run_shell("echo resumed")).stdout == "resumed\n"
    assert (await sb.refresh()).state is SandboxState.running


async def test_gvisor_shows_its_own_kernel_not_the_hosts(make_sandbox: Sandboxes) -> None:
    crun = await make_sandbox()
    gv = await make_sandbox(runtime="gvisor")
    host_release = os.uname().release
    assert (await crun.run_shell("uname -r")).stdout.strip() == host_release, "crun shares the host kernel"
    assert (await gv.run_shell("uname -r")).stdout.strip() != host_release
    # The kernel log is gVisor's own boot banner; under crun, syslog(2) is refused outright.
    assert "gVisor" in (await gv.run_shell("dmesg")).stdout
    assert (await crun.run_shell("dmesg")).exit_code != 0


async def test_a_gvisor_sandbox_created_without_rules_refuses_a_grant(make_sandbox: Sandboxes) -> None:
    # Its netstack took its links when it started: a veth added now would never be seen.
    sb = await make_sandbox(runtime="gvisor")
    with pytest.raises(InvalidRequest, match="created without network rules"):
        await sb.set_network_rules({"mirror": True})
    assert (await sb.refresh()).network_rules == {}
    assert not links.exists(links.link_name(sb.id))
    await sb.set_network_rules({"mirror": False})  # granting nothing needs no link
