"""Escapes through the file system: another sandbox's files and output, the host's paths, the
shared layers and the node's own tools mounted into every sandbox."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Awaitable
from pathlib import Path

from dsec import CommandResult, DSecClient, DSecError, Sandbox
from dsec.node.embedded import EmbeddedNode
from tests.conftest import Sandboxes
from tests.security.conftest import PRELUDE, Witness, assert_node_healthy, collect, probe

# Looks everywhere a process can look for another sandbox's secret: every visible process
# (cmdline, environ, open files, cwd, root), the whole file tree (grep, /proc and /sys apart),
# and the host paths this sandbox can learn or guess (its own overlay dirs from mountinfo, with
# the victim's id put in). The secret comes on stdin, so no cmdline of the probe carries it.
SNOOP = r"""
import subprocess
secret = sys.stdin.read().strip().encode()
me, victim = sys.argv[1], sys.argv[2]
hits, opened = [], []

def look(path, data):
    if secret in data:
        hits.append(path)

for pid in pids():
    if pid == os.getpid():
        continue
    base = f"/proc/{pid}"
    for name in ("cmdline", "environ"):
        try:
            look(f"{base}/{name}", open(f"{base}/{name}", "rb").read())
        except OSError:
            pass
    for link in ("cwd", "root"):
        try:
            look(f"{base}/{link}", os.readlink(f"{base}/{link}").encode())
            look(f"{base}/{link}/root/secret.txt", open(f"{base}/{link}/root/secret.txt", "rb").read())
        except OSError:
            pass
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            look(f"{base}/fd/{fd}", os.readlink(f"{base}/fd/{fd}").encode())
            with open(f"{base}/fd/{fd}", "rb", buffering=0) as f:
                os.set_blocking(f.fileno(), False)
                look(f"{base}/fd/{fd} (read)", f.read(1 << 16) or b"")
        except (OSError, TypeError):
            pass

# The whole tree (the pattern comes on grep's stdin, so not even grep's cmdline holds it).
grep = subprocess.run(
    ["grep", "-rlsF", "--binary-files=text", "-f", "-", "/", "--exclude-dir=proc", "--exclude-dir=sys"],
    input=secret + b"\n", capture_output=True,
)
hits += grep.stdout.decode().split()

# Host paths: this sandbox's overlay dirs are named in its mountinfo; put the victim's id in.
guesses = []
for line in open("/proc/self/mountinfo"):
    for opt in line.split()[-1].split(","):
        key, _, value = opt.partition("=")
        if key in ("upperdir", "workdir", "lowerdir"):
            for path in value.split(":"):
                guesses += [path, path.replace(me, victim), path.replace(me, victim) + "/root/secret.txt"]
for data_dir in ("/var/lib/dsec-test/node", "/var/lib/dsec", "/tmp"):
    guesses += [f"{data_dir}/sandboxes/{victim}/upper/root/secret.txt", f"{data_dir}/edge/journal.sqlite"]
for path in guesses:
    for candidate in (path, "/proc/1/root" + path, "/proc/self/root" + path, "/proc/self/cwd/../.." + path):
        try:
            with open(candidate, "rb") as f:
                opened.append(candidate)
                look(candidate, f.read())
        except OSError:
            pass
        if os.path.isdir(candidate) and candidate not in ("/tmp", "/proc/1/root/tmp"):
            opened.append(candidate)
print(json.dumps({"hits": hits, "opened": sorted(set(opened)), "guesses": len(guesses)}))
"""


async def test_another_sandbox_files_and_running_output_are_unreachable(make_sandbox: Sandboxes) -> None:
    victim = await make_sandbox()
    attacker = await make_sandbox()
    secret = f"victim-secret-{uuid.uuid4().hex}"
    await victim.write_file("/root/secret.txt", secret)
    # The victim has a command running whose output (the secret) sits in pipes the edge holds;
    # it ends when told through a FIFO, so the attack runs while it is alive.
    await victim.run_shell("mkfifo /tmp/go", timeout=60)
    stream = victim.exec_stream(
        ["sh", "-c", 'echo "$S"; read x < /tmp/go; echo done'], env={"S": secret}, timeout=120
    )
    first = await anext(stream)
    assert not isinstance(first, CommandResult) and first.data == f"{secret}\n".encode()

    found = await probe(attacker, SNOOP, attacker.id, victim.id, stdin=secret, timeout=120)
    assert found["guesses"] > 0
    assert found["hits"] == [], found
    assert found["opened"] == [], found

    await victim.run_shell("echo > /tmp/go", session="release", timeout=60)
    rest = [item async for item in stream]
    result = rest[-1]
    assert isinstance(result, CommandResult) and result.exit_code == 0, result
    assert b"".join(c.data for c in rest[:-1] if not isinstance(c, CommandResult)) == b"done\n"
    assert await victim.read_file("/root/secret.txt") == secret.encode()


async def test_host_paths_and_proc_roots_lead_nowhere(sandbox: Sandbox, host_secret: Path) -> None:
    body = r"""
target = sys.argv[1]
tries = [target, "/proc/1/root" + target, "/proc/self/root" + target, "/../../../.." + target]
tries += [f"/proc/{p}/root{target}" for p in pids()] + [f"/proc/{p}/cwd/../../..{target}" for p in pids()]
got = {}
for t in tries:
    try:
        got[t] = open(t).read()
    except OSError as e:
        got[t] = err(e)
roots = {os.stat(f"/proc/{p}/root/").st_ino for p in pids() if os.path.exists(f"/proc/{p}/root/")}
print(json.dumps({"got": got, "roots": sorted(roots), "mine": os.stat("/").st_ino}))
"""
    out = await probe(sandbox, body, host_secret)
    # Through its own root: not there. Through the roots of processes the edge started apart
    # (init, sessions): not even looked up (each has a Landlock domain of its own).
    got = out["got"]
    assert got[str(host_secret)] == got[f"/proc/self/root{host_secret}"] == "ENOENT", out
    assert set(got.values()) <= {"ENOENT", "EACCES"}, out
    assert out["roots"] == [out["mine"]]  # every root it can see is this sandbox's
    assert host_secret.read_text() == "host only\n"


# The classic double-chroot escape: root with CAP_SYS_CHROOT chroots into a subdirectory, walks
# ".." from outside its new root, then chroots to where it ended up.
CHROOT_ESCAPE = r"""
target = sys.argv[1]
before = sorted(os.listdir("/"))
os.makedirs("/tmp/jail", exist_ok=True)
keep = os.open("/", os.O_RDONLY)
os.chroot("/tmp/jail")
os.fchdir(keep)
for _ in range(64):
    os.chdir("..")
os.chroot(".")
print(json.dumps({"same_root": sorted(os.listdir("/")) == before, "host_file": os.path.exists(target)}))
"""


async def test_double_chroot_stays_in_the_sandbox(sandbox: Sandbox, host_secret: Path) -> None:
    out = await probe(sandbox, CHROOT_ESCAPE, host_secret)
    assert out == {"same_root": True, "host_file": False}


async def test_overwriting_bash_harms_only_that_sandbox(
    client: DSecClient, make_sandbox: Sandboxes, witness: Witness
) -> None:
    attacker = await make_sandbox()
    before = (await attacker.exec(["sha256sum", "/bin/bash"], timeout=60)).stdout.split()[0]
    body = r"""
out = {}
for path in ("/bin/bash", "/usr/bin/bash"):
    with open(path, "wb") as f:
        f.write(b"#!/nonexistent\n" + os.urandom(4096))
    out[path] = "written"
# The layer under the overlay, by the host path the mount table names: not reachable.
for line in open("/proc/self/mountinfo"):
    for opt in line.split()[-1].split(","):
        if opt.startswith("lowerdir="):
            for lower in opt[len("lowerdir="):].split(":"):
                try:
                    open(lower + "/usr/bin/bash", "r+b").write(b"x")
                    out[lower] = "written"
                except OSError as e:
                    out[lower] = err(e)
print(json.dumps(out))
"""
    out = await probe(attacker, body)
    assert out.pop("/bin/bash") == "written"  # its own copy: copied up into its writable layer
    assert out.pop("/usr/bin/bash") == "written"
    assert out and set(out.values()) == {"ENOENT"}, out
    after = (await attacker.exec(["sha256sum", "/bin/bash"], timeout=60)).stdout.split()[0]
    assert after != before  # the attack did land where it could: in the attacker

    await witness.assert_intact()
    fresh = await make_sandbox()
    for sb in (witness.sb, fresh):
        r = await sb.exec(["sha256sum", "/bin/bash"], timeout=60)
        assert r.stdout.split()[0] == before, r
        assert (await sb.run_shell("echo $BASH_VERSION | cut -c1", timeout=60)).stdout == "5\n"
    await assert_node_healthy(client, make_sandbox)


async def test_node_tools_mounted_inside_cannot_be_changed(
    client: DSecClient, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    """/.dsec (busybox, the FnCall runner) is one host directory bind-mounted into every sandbox:
    a change there would run in every other sandbox and every FnCall pool."""
    runtime_dir = Path(node.backend.runtime_dir)
    attacker = await make_sandbox()  # first: a node's first sandbox adds its resolv.conf there
    host = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in runtime_dir.iterdir() if p.is_file()}
    assert {"busybox", "fncall-runner.py"} <= host.keys()
    body = r"""
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = err(e)
for f in ("/.dsec/busybox", "/.dsec/dsec-init", "/.dsec/fncall-runner.py"):
    attempt(f + " write", lambda: open(f, "r+b").write(b"#!/bin/sh\necho pwned\n"))
    attempt(f + " truncate", lambda: os.truncate(f, 0))
    attempt(f + " chmod", lambda: os.chmod(f, 0o777))
    attempt(f + " utime", lambda: os.utime(f, (0, 0)))
    attempt(f + " rename", lambda: os.rename(f, f + ".old"))
    attempt(f + " unlink", lambda: os.unlink(f))
    attempt(f + " link", lambda: os.link(f, "/tmp/hardlink"))
attempt("/.dsec create", lambda: open("/.dsec/planted", "wb").write(b"x"))
attempt("/.dsec mkdir", lambda: os.mkdir("/.dsec/planted-dir"))
print(json.dumps(out))
"""
    out = await probe(attacker, body)
    assert "ok" not in out.values(), out
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in runtime_dir.iterdir() if p.is_file()}
    assert after == host
    fresh = await make_sandbox()
    r = await fresh.exec(["sha256sum", "/.dsec/busybox", "/.dsec/fncall-runner.py"], timeout=60)
    assert [line.split()[0] for line in r.stdout.splitlines()] == [host["busybox"], host["fncall-runner.py"]]
    await assert_node_healthy(client, make_sandbox)


async def test_host_file_operations_survive_symlink_swap_races(sandbox: Sandbox, host_secret: Path) -> None:
    host_dir = host_secret.parent
    # Flips /tmp/swap between a real directory and a symlink to a host directory (atomically,
    # renameat2 RENAME_EXCHANGE) as fast as it can while the host reads and writes through it.
    body = r"""
host_dir = sys.argv[1]
os.makedirs("/tmp/swap", exist_ok=True)
open("/tmp/swap/host-secret.txt", "w").write("sandbox copy\n")
os.symlink(host_dir, "/tmp/alt")
rename = libc.renameat2
rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
flips = 0
print("ready", flush=True)
while not os.path.exists("/tmp/stop"):
    if rename(-100, b"/tmp/swap", -100, b"/tmp/alt", 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
    flips += 1
print(json.dumps({"flips": flips}))
"""
    swapper = sandbox.exec_stream(["python3", "-c", PRELUDE + body, str(host_dir)], timeout=300)
    first = await anext(swapper)
    assert not isinstance(first, CommandResult) and first.data == b"ready\n", first
    drained = asyncio.create_task(collect(swapper))

    reads: set[bytes] = set()
    failures = 0

    async def attempt(op: Awaitable[object]) -> None:
        nonlocal failures
        try:
            value = await op
        except DSecError:
            failures += 1
            return
        if isinstance(value, bytes):
            reads.add(value)

    for i in range(150):
        await attempt(sandbox.write_file(f"/tmp/swap/planted-{i}", b"from the api"))
        await attempt(sandbox.read_file("/tmp/swap/host-secret.txt"))
        await attempt(sandbox.mkdir(f"/tmp/swap/dir-{i}"))
        await attempt(sandbox.remove("/tmp/swap/host-secret.txt"))
        await attempt(sandbox.list_dir("/tmp/swap"))
        if i % 10 == 0:  # keep the bait file there for the reads and removes
            await sandbox.exec(["sh", "-c", "echo 'sandbox copy' > /tmp/swap/host-secret.txt"], timeout=60)
    await sandbox.exec(["touch", "/tmp/stop"], timeout=60)
    result, stdout = await drained
    assert result.exit_code == 0, (result, stdout)
    flips = json.loads(stdout.splitlines()[-1])["flips"]
    assert flips > 0 and reads, (flips, reads, failures)  # the race ran, and the API got through
    assert b"host only\n" not in reads
    assert sorted(p.name for p in host_dir.iterdir()) == ["host-secret.txt"]
    assert host_secret.read_text() == "host only\n"
