"""Black-box tests of container sandboxes through the SDK, on real crun, EROFS and overlayfs."""

from __future__ import annotations

import hashlib
import os
import resource
import socket
import uuid
from pathlib import Path

import pytest

from dsec import (
    CommandResult,
    DSecClient,
    DSecContainerRunArgs,
    FileNotFound,
    InvalidRequest,
    LayerNotFound,
    Sandbox,
    SandboxNotFound,
    SandboxState,
)
from dsec.backends.container import cgroups
from dsec.node.embedded import EmbeddedNode
from tests.conftest import BASE, Sandboxes


async def test_paper_example_runs_unchanged(client: DSecClient, base_layer: str) -> None:
    args = DSecContainerRunArgs(
        container_image=base_layer,
        memory_limit_mb=4096,
        cpu_cores_limit=4,
        ttl_running_stop=300,
        network_rules={"npm": False, "pypi": True},
        init_user="root",
    )
    sandbox = await client.run_container(args, timeout=120)
    try:
        result = await sandbox.run_shell("echo hello world")
        assert result.exit_code == 0
        assert result.stdout == "hello world\n"
    finally:
        await sandbox.stop()
    assert (await client.get(sandbox.id)).info.state is SandboxState.stopped


async def test_base_image_has_bash_python_git(sandbox: Sandbox) -> None:
    result = await sandbox.run_shell("bash --version | head -1; python3 -c 'print(6*7)'; git --version")
    assert result.exit_code == 0, result
    assert "GNU bash" in result.stdout
    assert "42" in result.stdout
    assert "git version" in result.stdout


async def test_sessions_keep_cwd_and_env_and_are_separate(sandbox: Sandbox) -> None:
    await sandbox.run_shell("cd /tmp && export FOO=bar && myfn() { echo fn-$1; }")
    r = await sandbox.run_shell("pwd; echo $FOO; myfn x")
    assert r.stdout == "/tmp\nbar\nfn-x\n"
    other = await sandbox.run_shell("pwd; echo ${FOO:-unset}", session="other")
    assert other.stdout.splitlines()[1] == "unset"
    assert other.stdout.splitlines()[0] != "/tmp"


async def test_exit_codes_stderr_and_stdin_isolation(sandbox: Sandbox) -> None:
    r = await sandbox.run_shell("echo out; echo err >&2; (exit 7)")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    # A command reading stdin must see EOF, not swallow the session's command stream.
    r = await sandbox.run_shell("cat; echo done")
    assert r.stdout == "done\n"
    r = await sandbox.run_shell("printf 'no newline'")
    assert r.stdout == "no newline"
    r = await sandbox.run_shell("if then fi")  # a syntax error must not kill the session
    assert r.exit_code != 0 and "syntax" in r.stderr
    assert (await sandbox.run_shell("echo still here")).stdout == "still here\n"


async def test_exit_in_session_ends_only_that_session(sandbox: Sandbox) -> None:
    r = await sandbox.run_shell("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert (await sandbox.run_shell("echo fresh")).stdout == "fresh\n"


async def test_exec_streams_output_and_takes_stdin(sandbox: Sandbox) -> None:
    chunks = []
    result: CommandResult | None = None
    async for item in sandbox.exec_stream(["sh", "-c", "cat; echo to-err >&2"], stdin=b"line1\nline2\n"):
        if isinstance(item, CommandResult):
            result = item
        else:
            chunks.append(item)
    assert result is not None and result.exit_code == 0
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == b"line1\nline2\n"
    assert b"".join(c.data for c in chunks if c.stream == "stderr") == b"to-err\n"
    r = await sandbox.exec(["env"], env={"EXTRA": "1"}, cwd="/tmp")
    assert "EXTRA=1" in r.stdout.splitlines()


# The base image has no procps: count processes straight from /proc.
COUNT_SLEEPS = "cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$'"


async def test_timeout_kills_whole_process_tree(sandbox: Sandbox) -> None:
    r = await sandbox.exec(["sh", "-c", "sleep 1000 & sleep 1000 & echo started; wait"], timeout=1)
    assert r.timed_out and r.exit_code is None
    assert r.stdout == "started\n"
    assert (await sandbox.run_shell(COUNT_SLEEPS)).stdout == "0\n"
    await sandbox.run_shell("sleep 1000 &")
    assert (await sandbox.run_shell(COUNT_SLEEPS)).stdout == "1\n"  # the count sees them
    s = await sandbox.run_shell("sleep 1000 & sleep 1000", timeout=1)
    assert s.timed_out
    assert (await sandbox.run_shell(COUNT_SLEEPS)).stdout == "0\n"


async def test_output_is_capped_and_marked(sandbox: Sandbox) -> None:
    r = await sandbox.run_shell("yes", timeout=2, max_output_bytes=1000)
    assert r.timed_out and r.truncated
    assert len(r.stdout) == 1000
    r = await sandbox.exec(["sh", "-c", "head -c 5000000 /dev/zero"], max_output_bytes=4096)
    assert r.truncated and len(r.stdout) == 4096 and r.exit_code == 0


async def test_memory_limit_oom_kills_and_says_so(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(memory_limit_mb=64)
    r = await sb.run_shell("python3 -c 'x = bytearray(256 * 1024 * 1024); print(len(x))'")
    assert r.oom_killed
    assert r.exit_code == 137
    assert (await sb.run_shell("echo alive")).stdout == "alive\n"


BOMB = """
import os, time
children = []
try:
    while len(children) < 10000:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError as e:
    print("fork failed after", len(children), e.errno)
for pid in children:
    os.kill(pid, 9)
"""


async def test_fork_bomb_is_contained_by_pids_limit(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(pids_limit=64)
    r = await sb.exec(["python3", "-c", BOMB], timeout=60)
    words = r.stdout.split()
    assert words[:3] == ["fork", "failed", "after"], r
    assert int(words[3]) < 64 and words[4] == "11"  # EAGAIN from the pids cgroup
    assert (await sb.run_shell("echo usable")).stdout == "usable\n"


async def test_no_network_but_loopback(sandbox: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        r = await sandbox.run_shell(
            "tail -n +3 /proc/net/dev | cut -d: -f1; tail -n +2 /proc/net/route | wc -l"
        )
        assert r.stdout.split() == ["lo", "0"]
        probe = (
            "import socket\n"
            "s = socket.socket()\n"
            "s.settimeout(2)\n"
            "try:\n"
            f"    s.connect(('127.0.0.1', {port}))\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        r = await sandbox.exec(["python3", "-c", probe])
        assert r.stdout.startswith("refused"), r  # the host's loopback is not the sandbox's
    finally:
        listener.close()


async def test_host_processes_and_files_are_invisible(sandbox: Sandbox, host_secret: Path) -> None:
    r = await sandbox.run_shell("ls -d /proc/[0-9]* | cut -d/ -f3")
    pids = [int(p) for p in r.stdout.split()]
    assert 1 in pids and os.getpid() not in pids and max(pids) < 100
    r = await sandbox.run_shell(f"cat {host_secret} 2>&1; echo rc=$?")
    assert "host only" not in r.stdout and "rc=1" in r.stdout
    # Every masked kernel file that exists on this host reads as empty inside.
    masked = [
        p
        for p in (
            "/proc/kpageflags",
            "/proc/kpagecgroup",
            "/proc/keys",
            "/proc/timer_list",
            "/proc/vmallocinfo",
            "/proc/kcore",
        )
        if Path(p).exists()
    ]
    assert masked, "this host has none of the masked /proc files to check"
    r = await sandbox.run_shell(" ; ".join(f"wc -c < {p}" for p in masked))
    assert r.stdout.split() == ["0"] * len(masked), r
    r = await sandbox.run_shell("touch /sys/x 2>&1; echo 1 > /proc/sys/kernel/panic 2>&1")
    assert (r.stdout + r.stderr).count("Read-only file system") == 2
    r = await sandbox.run_shell("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status")
    assert "NoNewPrivs:\t1" in r.stdout and "Seccomp:\t2" in r.stdout
    r = await sandbox.run_shell("mount -t tmpfs none /mnt 2>&1; echo rc=$?")
    assert "rc=0" not in r.stdout


async def test_limits_and_env_reach_the_kernel(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(memory_limit_mb=300, cpu_cores_limit=0.5, pids_limit=77, env={"TASK": "t-1"})

    def cg(controller: str) -> Path:
        return cgroups.sandbox_dir(controller, sb.id)

    assert (cg("cpu") / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert (cg("cpu") / "cpu.cfs_period_us").read_text().strip() == "100000"
    assert int((cg("memory") / "memory.limit_in_bytes").read_text()) == 300 << 20
    assert int((cg("memory") / "memory.memsw.limit_in_bytes").read_text()) == 300 << 20
    assert (cg("pids") / "pids.max").read_text().strip() == "77"
    assert (await sb.run_shell("echo $TASK")).stdout == "t-1\n"
    assert (await sb.exec(["sh", "-c", "echo $TASK"])).stdout == "t-1\n"


async def test_init_user(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(init_user="nobody")
    r = await sb.run_shell("id -u; id -g")
    assert r.stdout.split() == ["65534", "65534"]
    await sb.write_file("/tmp/mine", "x")
    assert (await sb.stat("/tmp/mine")).uid == 65534


async def test_workdir_is_where_commands_start_unless_they_name_a_cwd(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(workdir="/srv")
    assert (await sb.run_shell("pwd")).stdout == "/srv\n"
    assert (await sb.exec(["pwd"])).stdout == "/srv\n"
    assert (await sb.exec(["pwd"], cwd="/tmp")).stdout == "/tmp\n"
    home = await make_sandbox()
    assert (await home.run_shell("pwd")).stdout == "/root\n"
    with pytest.raises(InvalidRequest, match="absolute"):
        await make_sandbox(workdir="srv")


async def test_a_tmpfs_is_memory_of_the_sandbox_empty_at_start_and_bounded(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(tmpfs={"/scratch": 4}, memory_limit_mb=256)
    mounts = (await sb.exec(["cat", "/proc/self/mounts"])).stdout
    assert any(line.split()[1:3] == ["/scratch", "tmpfs"] for line in mounts.splitlines()), mounts
    assert (await sb.exec(["ls", "-A", "/scratch"])).stdout == ""
    assert (await sb.exec(["stat", "-c", "%a", "/scratch"])).stdout == "1777\n"
    await sb.write_file("/scratch/note", "via the API")  # the file routes see the sandbox's mounts
    assert (await sb.exec(["cat", "/scratch/note"])).stdout == "via the API"
    usage = cgroups.sandbox_dir("memory", sb.id) / "memory.usage_in_bytes"
    before = int(usage.read_text())
    assert (await sb.run_shell("head -c 3M /dev/zero > /scratch/fits")).exit_code == 0
    # Exact but for the kernel's per-CPU charge stock (64 pages): what the tmpfs holds is the
    # sandbox's memory.
    assert int(usage.read_text()) - before >= (3 << 20) - (64 << 12)
    full = await sb.run_shell("head -c 2M /dev/zero > /scratch/big; echo rc=$?")
    assert "No space left on device" in full.stderr and "rc=1" in full.stdout
    for bad, why in (
        ({"/proc/x": 1}, "not over"),
        ({"/a/../b": 1}, "normalized"),
        ({"//proc": 1}, "normalized"),
        ({"/s": 0}, "size"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            await make_sandbox(tmpfs=bad)
    with pytest.raises(InvalidRequest, match="crun containers only"):
        await make_sandbox(tmpfs={"/scratch": 4}, runtime="gvisor")


async def test_files_round_trip_text_binary_and_listing(sandbox: Sandbox) -> None:
    await sandbox.write_file("/work/notes.txt", "héllo\n")
    assert await sandbox.read_file("/work/notes.txt") == "héllo\n".encode()
    blob = bytes(range(256)) * 1000
    await sandbox.write_file("/work/blob.bin", blob, mode=0o600)
    assert await sandbox.read_file("/work/blob.bin") == blob
    st = await sandbox.stat("/work/blob.bin")
    assert (st.size, st.mode & 0o777, st.type.value) == (len(blob), 0o600, "file")
    r = await sandbox.run_shell("sha256sum /work/blob.bin | cut -d' ' -f1")
    assert r.stdout.strip() == hashlib.sha256(blob).hexdigest()
    await sandbox.mkdir("/work/sub/deeper")
    names = [e.name for e in await sandbox.list_dir("/work")]
    assert names == ["blob.bin", "notes.txt", "sub"]
    moved = await sandbox.move("/work/sub", "/work/moved")
    assert moved.path == "/work/moved" and (await sandbox.run_shell("ls /work/moved")).stdout == "deeper\n"
    await sandbox.remove("/work/moved", recursive=True)
    with pytest.raises(FileNotFound):
        await sandbox.stat("/work/moved")
    with pytest.raises(FileNotFound):
        await sandbox.read_file("/nope")


async def test_large_file_streams_both_ways_in_constant_memory(sandbox: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with src.open("wb") as fh:
        for i in range(1024):  # 1 GiB of non-repeating data
            chunk = hashlib.sha256(str(i).encode()).digest() * 32768
            digest.update(chunk)
            fh.write(chunk)
    # SDK, apiserver and edge all run in this process: its peak RSS bounds what any of them held.
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    await sandbox.upload(src, "/data/big.bin")
    r = await sandbox.run_shell("sha256sum /data/big.bin | cut -d' ' -f1")
    assert r.stdout.strip() == digest.hexdigest()
    back = tmp_path / "back.bin"
    assert await sandbox.download("/data/big.bin", back) == 1 << 30
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 256 * 1024, f"peak RSS grew by {grown_kib} KiB moving a 1 GiB file"
    h = hashlib.sha256()
    with back.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == digest.hexdigest()


async def test_paths_cannot_escape_the_sandbox(sandbox: Sandbox, host_secret: Path) -> None:
    await sandbox.run_shell(f"ln -s {host_secret} /tmp/link; ln -s / /tmp/rootlink")
    with pytest.raises((FileNotFound, InvalidRequest)):
        await sandbox.read_file("/tmp/link")
    await sandbox.write_file("/tmp/rootlink/etc/planted", "x")
    assert not Path("/etc/planted").exists()
    with pytest.raises((FileNotFound, InvalidRequest)):
        await sandbox.read_file("/../../../../" + str(host_secret))
    assert host_secret.read_text() == "host only\n"


async def test_bad_input_gets_typed_errors(client: DSecClient, base_layer: str) -> None:
    with pytest.raises(LayerNotFound, match="no-such-layer"):
        await client.run_container(DSecContainerRunArgs(container_image="no-such-layer:1"))
    with pytest.raises(InvalidRequest, match="memory_limit_mb"):
        await client.run_container(DSecContainerRunArgs(container_image=base_layer, memory_limit_mb=1))
    with pytest.raises(InvalidRequest, match="not a user"):
        await client.run_container(DSecContainerRunArgs(container_image=base_layer, init_user="ghost"))
    with pytest.raises(InvalidRequest, match="malformed sandbox id"):
        await client.get("not-an-id")
    with pytest.raises(SandboxNotFound):
        await client.get("sb-test-1-aaaaaaaaaaaaaaaaaaaa")


async def test_layers_compose_base_then_workspace(
    client: DSecClient, make_sandbox: Sandboxes, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    (ws / "workspace").mkdir(parents=True)
    (ws / "workspace" / "task.py").write_text("print('solved')\n")
    (ws / "etc").mkdir()
    (ws / "etc" / "motd").write_text("workspace layer\n")
    version = uuid.uuid4().hex[:12]  # the store outlives test runs; versions are immutable
    info = await client.import_layer(ws, f"ws-test:{version}")
    again = await client.import_layer(ws, f"ws-copy:{version}")
    assert again.digest == info.digest  # same content, stored once under two names
    assert {f"ws-test:{version}", f"ws-copy:{version}"} <= set(again.names)
    sb = await make_sandbox(container_image=None, layers=[BASE, f"ws-test:{version}"])
    r = await sb.run_shell("python3 /workspace/task.py; cat /etc/motd; test -x /bin/bash && echo base-ok")
    assert r.stdout == "solved\nworkspace layer\nbase-ok\n"
    # writes go to the sandbox's own upper layer, never into the shared layer
    await sb.run_shell("echo changed > /etc/motd")
    other = await make_sandbox(container_image=None, layers=[BASE, info.digest])
    assert (await other.run_shell("cat /etc/motd")).stdout == "workspace layer\n"


async def test_list_by_labels_and_get(client: DSecClient, make_sandbox: Sandboxes) -> None:
    a = await make_sandbox(labels={"job": "j1"})
    b = await make_sandbox(labels={"job": "j2"})
    listed = {s.id for s in await client.list(labels={"job": "j1"})}
    assert a.id in listed and b.id not in listed
    assert (await client.get(b.id)).info.labels == {"job": "j2"}


async def test_stop_all_of_a_job_in_one_call(client: DSecClient, make_sandbox: Sandboxes) -> None:
    job = uuid.uuid4().hex[:8]
    mine = [await make_sandbox(labels={"job": job}) for _ in range(3)]
    other = await make_sandbox(labels={"job": "someone-else"})
    stopped = await client.stop_all({"job": job})
    assert sorted(i.id for i in stopped) == sorted(s.id for s in mine)
    assert all(i.state is SandboxState.stopped for i in stopped)
    assert await client.list(labels={"job": job}) == []
    assert (await other.run_shell("echo alive")).stdout == "alive\n"
    with pytest.raises(InvalidRequest):
        await client.stop_all({})


async def test_what_a_sandbox_writes_is_out_of_every_host_user_s_reach(
    node: EmbeddedNode, make_sandbox: Sandboxes
) -> None:
    # Root in the sandbox makes a setuid-root program; on the host it sits in the sandbox's upper
    # layer, in the node's data directory, which only root may enter (as the journal and the
    # trajectory, which hold tenants' commands and env); the quota file system is nosuid too.
    sb = await make_sandbox()
    made = await sb.run_shell("cp /bin/true /tmp/suid && chmod 4755 /tmp/suid && stat -c %a /tmp/suid")
    assert made.stdout == "4755\n"
    data_dir = node.edge.config.data_dir
    assert node.edge.config.workdir(sb.id).is_relative_to(data_dir)
    assert data_dir.stat().st_mode & 0o777 == 0o700
    disk_quota = node.backend.disk_quota.root
    assert not disk_quota.exists() or disk_quota.stat().st_mode & 0o777 == 0o700
