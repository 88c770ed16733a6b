"""Escapes through processes and the edge: what a sandbox sees in /proc, ptrace, signals, the
node's ports and sockets, the node's secrets, and the records the edge keeps of every command."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import uuid
from pathlib import Path

import aiohttp

from dsec import CommandResult, DSecClient, Sandbox
from dsec.edge.server import EdgeServer
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes
from tests.security.conftest import (
    PRELUDE,
    Witness,
    assert_host_process_untouched,
    assert_node_healthy,
    collect,
    host_ipv4_addresses,
    probe,
)

# ptrace without side effects: SEIZE (no SIGSTOP), INTERRUPT, wait for the stop, look, DETACH.
PTRACE = r"""
PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 17, 0x4206, 0x4207, 0x40000000

def seize(pid):
    ctypes.set_errno(0)
    if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        return errno.errorcode.get(ctypes.get_errno(), "?")
    libc.ptrace(PTRACE_INTERRUPT, pid, None, None)
    try:
        os.waitpid(pid, WALL)
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as e:
        exe = "gone:" + err(e)
    libc.ptrace(PTRACE_DETACH, pid, None, None)
    return "attached:" + exe
"""


async def test_proc_shows_only_the_sandbox_own_processes(
    sandbox: Sandbox, host_process: subprocess.Popen[bytes]
) -> None:
    # Each command the edge starts has a cgroup2 child of the sandbox's own (cmd-<hex>): the
    # same sandbox's cgroups, below that name.
    body = r"""
import re
def sandbox_cgroups(pid):
    return re.sub(r"/cmd-[0-9a-f]+$", "", open(f"/proc/{pid}/cgroup").read(), flags=re.M)
mine = sandbox_cgroups("self")
seen = {}
for pid in pids():
    try:
        root = os.stat(f"/proc/{pid}/root/").st_ino == os.stat("/").st_ino
    except OSError as e:
        root = err(e)
    try:
        seen[pid] = {"same_cgroup": sandbox_cgroups(pid) == mine, "same_root": root}
    except OSError as e:
        seen[pid] = {"error": err(e)}
outside = {}
for pid in map(int, sys.argv[1:]):
    if pid in seen:
        continue
    try:
        os.kill(pid, 0)
        outside[pid] = "signalled"
    except OSError as e:
        outside[pid] = err(e)
print(json.dumps({"seen": seen, "outside": outside, "me": os.getpid()}))
"""
    out = await probe(sandbox, body, host_process.pid, os.getpid(), 1 + max(host_process.pid, os.getpid()))
    seen = out["seen"]
    assert "1" in seen and len(seen) < 10, seen  # init, its sleep, the session shell, the probe
    # Its own root is this sandbox's; the roots of processes the edge started apart it cannot
    # look at (a Landlock domain each, dsec_enter.c --own-domain).
    assert all(v["same_cgroup"] is True and v["same_root"] in (True, "EACCES") for v in seen.values()), seen
    assert seen[str(out["me"])]["same_root"] is True, out
    assert out["outside"] and set(out["outside"].values()) == {"ESRCH"}, out
    assert_host_process_untouched(host_process)


async def test_ptrace_reaches_nothing_outside(
    sandbox: Sandbox, witness: Witness, host_process: subprocess.Popen[bytes]
) -> None:
    body = r"""
import time
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
out = {}
for pid in pids() + [int(p) for p in sys.argv[1:]]:
    if pid != os.getpid():
        out[pid] = seize(pid)
os.kill(child, 9)
print(json.dumps({"traced": out, "child": child}))
"""
    outside = [host_process.pid, os.getpid()]
    out = await probe(sandbox, PTRACE + body, *outside)
    traced = out["traced"]
    for pid in outside:
        if str(pid) in traced and not traced[str(pid)].startswith("attached:"):
            assert traced[str(pid)] == "ESRCH", out
    # Its own child it may trace (same uid, same sandbox, its Landlock domain); what else the
    # sandbox runs (init, the session shells) was started apart from it: refused.
    attached = {pid: v for pid, v in traced.items() if v.startswith("attached:")}
    assert list(attached) == [str(out["child"])], out
    assert all(
        v == "EPERM" for pid, v in traced.items() if pid not in attached and int(pid) not in outside
    ), out
    assert_host_process_untouched(host_process)
    await witness.assert_intact()


async def test_racing_the_edge_exec_never_exposes_the_runtime(sandbox: Sandbox) -> None:
    """While the edge starts processes in the sandbox, a scanner inside tries every new pid the
    moment it appears: write its /proc/<pid>/exe (CVE-2019-5736) and ptrace it. A process still
    running the runtime's code on its way in must be neither; what it can trace are its own."""
    body = r"""
print("ready", flush=True)
seen = {}
while not os.path.exists("/tmp/stop"):
    for pid in pids():
        if pid in seen or pid == os.getpid():
            continue
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError as e:
            exe = err(e)
        try:
            os.close(os.open(f"/proc/{pid}/exe", os.O_WRONLY))
            writable = "WRITABLE"
        except OSError as e:
            writable = err(e)
        seen[pid] = [exe, writable, seize(pid)]
print(json.dumps(seen))
"""
    scanner = sandbox.exec_stream(["python3", "-c", PRELUDE + PTRACE + body], timeout=600)
    first = await anext(scanner)
    assert not isinstance(first, CommandResult) and first.data == b"ready\n", first
    collected = asyncio.create_task(collect(scanner))
    for i in range(60):
        r = await sandbox.exec(["sh", "-c", f"echo {i}"], timeout=60)
        assert r.stdout == f"{i}\n", r
    await sandbox.exec(["touch", "/tmp/stop"], timeout=60)
    result, stdout = await collected
    assert result.exit_code == 0, (result, stdout)
    seen = json.loads(stdout.splitlines()[-1])
    # It saw the edge's processes come in (not necessarily all 60: a short one can come and go
    # between two of its scans on a loaded machine); every one it saw is checked below.
    assert len(seen) >= 30, seen
    own_binaries = ("/usr/bin/dash", "/usr/bin/touch", "/.dsec/busybox", "/.dsec/dsec-init", "/usr/bin/bash")
    for exe, writable, traced in seen.values():
        assert writable != "WRITABLE", seen
        if traced.startswith("attached:"):
            target = traced.split(":", 1)[1]
            assert target in own_binaries or target.startswith("gone:"), seen
        if "crun" in exe or "memfd" in exe:
            assert traced in ("EPERM", "ESRCH"), seen


async def test_kill_everything_inside_spares_the_outside(
    client: DSecClient,
    make_sandbox: Sandboxes,
    witness: Witness,
    host_process: subprocess.Popen[bytes],
) -> None:
    attacker = await make_sandbox()
    await attacker.run_shell("sleep 1000000 >/dev/null 2>&1 &", timeout=60)
    body = r"""
visible = pids()
out = {}
for pid in [int(p) for p in sys.argv[1:] if int(p) not in visible] + [1]:
    try:
        os.kill(pid, 9)
        out[pid] = "sent"
    except OSError as e:
        out[pid] = err(e)
os.kill(-1, 9)  # everything it may signal, but itself
print(json.dumps({"out": out, "left": [p for p in pids() if p != os.getpid()]}))
"""
    out = await probe(attacker, body, host_process.pid, os.getpid())
    # The host's pids do not exist in its pid namespace; its init ignores the SIGKILL it sent,
    # or (Linux 6.12+: each command's Landlock domain scopes its signals) never gets it.
    assert out["out"].pop("1") in ("sent", "EPERM")
    assert out["out"] and set(out["out"].values()) == {"ESRCH"}, out
    assert 1 in out["left"], out
    assert_host_process_untouched(host_process)
    await witness.assert_intact()
    # The attacker lost its own processes only; it is usable again (a fresh session).
    r = await attacker.run_shell("echo back", timeout=60)
    assert r.stdout == "back\n", r
    await assert_node_healthy(client, make_sandbox)


async def test_raw_and_packet_sockets_fail(sandbox: Sandbox) -> None:
    body = r"""
import socket
out = {}
for name, fam, typ, proto in (
    ("inet raw icmp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    ("inet raw tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
    ("inet raw any", socket.AF_INET, socket.SOCK_RAW, 255),
    ("inet6 raw", socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),
    ("packet raw", socket.AF_PACKET, socket.SOCK_RAW, 0x0300),
    ("packet dgram", socket.AF_PACKET, socket.SOCK_DGRAM, 0x0300),
):
    try:
        socket.socket(fam, typ, proto).close()
        out[name] = "ok"
    except OSError as e:
        out[name] = err(e)
print(json.dumps(out))
"""
    out = await probe(sandbox, body)
    assert set(out.values()) == {"EPERM"}, out


# Connects to every (address, port) given: nothing may answer.
CONNECT = r"""
import socket
out = {}
for target in sys.argv[1:]:
    host, _, port = target.rpartition(":")
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host.strip("[]"), int(port)))
        out[target] = "CONNECTED"
    except OSError as e:
        out[target] = err(e) if e.errno else "timeout"
    finally:
        s.close()
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    abstract.connect(os.environ["ABSTRACT"].encode().replace(b"@", b"\0", 1))
    out["abstract"] = "CONNECTED"
except OSError as e:
    out["abstract"] = err(e)
print(json.dumps(out))
"""


async def test_edge_and_apiserver_ports_are_unreachable(sandbox: Sandbox, node: EmbeddedNode) -> None:
    """The node's HTTP ports (the apiserver, and an edge's HTTP face as a cluster serves it, on
    every host address) and a host abstract unix socket: a sandbox has no link to any of them."""
    edge_secret = secrets.token_hex(24)
    edge_server = EdgeServer(node.edge, edge_secret)
    edge_url = await edge_server.start("0.0.0.0", 0)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_name = f"@dsec-escape-{uuid.uuid4().hex}"
    abstract.bind(abstract_name.encode().replace(b"@", b"\0", 1))
    abstract.listen()
    try:
        edge_port = int(edge_url.rsplit(":", 1)[1])
        api_port = int(node.url.rsplit(":", 1)[1])
        addresses = host_ipv4_addresses()
        assert "127.0.0.1" in addresses and len(addresses) > 1, addresses
        targets = [f"{a}:{p}" for a in addresses for p in (edge_port, api_port)] + [
            f"[::1]:{edge_port}",
            f"[::1]:{api_port}",
        ]
        # From the host they answer (the edge's face on every address): the test is not empty.
        async with aiohttp.ClientSession() as http:
            for a in addresses:
                headers = {"Authorization": f"Bearer {edge_secret}"}
                async with http.get(f"http://{a}:{edge_port}/edge/v1/stats", headers=headers) as resp:
                    assert resp.status == 200
        with socket.create_connection(("127.0.0.1", api_port), timeout=5):
            pass

        r = await sandbox.exec(
            ["python3", "-c", PRELUDE + CONNECT, *targets], env={"ABSTRACT": abstract_name}, timeout=120
        )
        out = json.loads(r.stdout.splitlines()[-1])
        assert "CONNECTED" not in out.values(), out
        assert set(out.values()) <= {"ECONNREFUSED", "ENETUNREACH", "EADDRNOTAVAIL", "EHOSTUNREACH"}, out
    finally:
        abstract.close()
        await edge_server.close()


async def test_node_secrets_are_not_visible_inside(sandbox: Sandbox, node: EmbeddedNode) -> None:
    api_key = node.api_key
    body = r"""
import subprocess
key = sys.stdin.read().strip().encode()
hits = []
for pid in pids():
    for name in ("cmdline", "environ"):
        try:
            if key in open(f"/proc/{pid}/{name}", "rb").read():
                hits.append(f"{pid}/{name}")
        except OSError:
            pass
grep = subprocess.run(
    ["grep", "-rlsF", "--binary-files=text", "-f", "-", "/", "--exclude-dir=proc", "--exclude-dir=sys"],
    input=key + b"\n", capture_output=True,
)
hits += grep.stdout.decode().split()
print(json.dumps({"hits": hits, "env": sorted(os.environ)}))
"""
    out = await probe(sandbox, body, stdin=api_key, timeout=120)
    assert out["hits"] == [], out
    assert not [k for k in out["env"] if k.startswith("DSEC") or "KEY" in k or "SECRET" in k], out


async def test_edge_records_cannot_be_found_or_written_from_inside(
    sandbox: Sandbox, node: EmbeddedNode
) -> None:
    """The edge records every command (the trajectory, the journal) on the host: from inside
    there is no file, no open descriptor and no path that leads to them."""
    token = f"record-{uuid.uuid4().hex}"
    r = await sandbox.run_shell(f"echo {token} | rev", timeout=60)
    assert r.stdout == token[::-1] + "\n"
    data_dir = Path(node.config.data_dir)
    records = [p for p in (data_dir / "edge").iterdir() if p.name.endswith((".sqlite", ".sqlite-wal"))]
    assert records, "the edge keeps its records in SQLite files"
    body = r"""
import subprocess
token = sys.stdin.read().strip()
names = set(sys.argv[1:])
found = []
for top, dirs, files in os.walk("/"):
    if top in ("/proc", "/sys"):
        dirs[:] = []
        continue
    found += [os.path.join(top, f) for f in files if f in names]
grep = subprocess.run(
    ["grep", "-rlsF", "--binary-files=text", "-f", "-", "/", "--exclude-dir=proc", "--exclude-dir=sys"],
    input=(token + "\n").encode(), capture_output=True,
)
# Every descriptor of every visible process: a pipe, a socket, or a file of this sandbox.
foreign = []
for pid in pids():
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            link = os.readlink(path)
            here = os.stat(path)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("/"):
            try:
                there = os.stat(link)
            except OSError:
                there = None
            if there is None or (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
                foreign.append(link)
print(json.dumps({"found": found, "grep": grep.stdout.decode().split(), "foreign": foreign}))
"""
    out = await probe(sandbox, body, *(p.name for p in records), stdin=token, timeout=120)
    assert out == {"found": [], "grep": [], "foreign": []}, out
    # Where the records are, they hold the command and its real outcome.
    entry = [e for e in await sandbox.trajectory() if token in e.request.get("command", "")]
    assert len(entry) == 1 and entry[0].result is not None
    assert entry[0].result["stdout"] == token[::-1] + "\n" and entry[0].result["exit_code"] == 0


async def test_fake_end_markers_do_not_cut_a_result(sandbox: Sandbox) -> None:
    """The session protocol ends a command at a marker with a fresh random nonce: output that
    imitates markers (any guess) is output, and the exit code is the command's own."""
    fake = "".join(f"\\x00{secrets.token_hex(16)}:0\\x00" for _ in range(3))
    cmd = f"printf '{fake}'; printf '{fake}' >&2; echo after; echo err-after >&2; (exit 5)"
    r = await sandbox.run_shell(cmd, timeout=60)
    assert r.exit_code == 5, r
    assert r.stdout.endswith("after\n") and r.stdout.count("\0") == 6, r
    assert r.stderr.endswith("err-after\n"), r
    assert (await sandbox.run_shell("echo next", timeout=60)).stdout == "next\n"
    last = (await sandbox.trajectory())[-2]
    assert last.result is not None and last.result["exit_code"] == 5
