"""RL co-design on the real runtime: idempotent replay, trajectories, pack_diff and fork,
changes, clean-room grading against a hacking policy, and the preemption drill."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs, InvalidRequest, SandboxState
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import ChangeKind
from dsec.rl.demo import ensure_task, hacking_policy, honest_policy
from dsec.rl.env import SandboxEnv
from tests.conftest import Sandboxes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rollout_worker.py"


async def test_a_keyed_command_runs_once_and_repeats_get_the_record(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    first = await sb.run_shell("echo run >> /root/log; wc -l < /root/log", idempotency_key="k1")
    again = await sb.run_shell("echo run >> /root/log; wc -l < /root/log", idempotency_key="k1")
    assert first == again and first.stdout == "1\n"
    # Concurrent repeats join the one run in progress.
    racing = await asyncio.gather(
        *(
            sb.run_shell("sleep 0.3; echo x >> /root/race; wc -l < /root/race", idempotency_key="k2")
            for _ in range(5)
        )
    )
    assert {r.stdout for r in racing} == {"1\n"}
    out = await sb.exec(["sh", "-c", "echo e >> /root/exec; wc -l < /root/exec"], idempotency_key="k3")
    replay = await sb.exec(["sh", "-c", "echo e >> /root/exec; wc -l < /root/exec"], idempotency_key="k3")
    assert out.stdout == replay.stdout == "1\n" and replay.exit_code == 0
    assert (await sb.read_file("/root/exec")) == b"e\n"
    entries = await sb.trajectory()
    keyed = [(e.kind, e.key, e.status) for e in entries if e.key]
    assert keyed == [("shell", "k1", "done"), ("shell", "k2", "done"), ("exec", "k3", "done")]
    assert entries[0].request["command"].startswith("echo run")
    assert [e.seq for e in entries] == sorted(e.seq for e in entries)
    later = await sb.trajectory(after=entries[1].seq)
    assert [e.seq for e in later] == [e.seq for e in entries[2:]]


async def test_trajectory_records_files_pauses_and_failures(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    await sb.write_file("/root/a.txt", "hi")
    await sb.mkdir("/root/d")
    await sb.remove("/root/d", recursive=True)
    await sb.pause()
    r = await sb.run_shell("exit 3")
    assert r.exit_code == 3
    with pytest.raises(InvalidRequest):
        await sb.remove("/root")  # not empty, not recursive: the caller's error, recorded
    kinds = [(e.kind, e.status) for e in await sb.trajectory()]
    assert kinds == [
        ("write", "done"),
        ("mkdir", "done"),
        ("remove", "done"),
        ("pause", "done"),
        ("shell", "done"),
        ("resume", "done"),  # the transparent resume, inside the shell request
        ("remove", "failed"),
    ]
    last = (await sb.trajectory())[-1]
    assert last.error is not None and last.error["error"]["code"] == "invalid_request"
    info = await sb.stop()
    assert info.state is SandboxState.stopped
    assert len(await sb.trajectory()) == 7  # still readable after the sandbox stopped


async def test_pack_diff_restores_byte_identical_and_leaves_the_sandbox_alone(
    client: DSecClient, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox()
    await sb.run_shell(
        "head -c 3000000 /dev/urandom > /root/blob; ln -s /root/blob /root/link;"
        " rm /etc/issue; mkdir -p /srv/x && echo y > /srv/x/f; echo residue > /tmp/scratch"
    )
    want = hashlib.sha256(await sb.read_file("/root/blob")).hexdigest()
    first = await sb.pack_diff("test/packed")
    second = await sb.pack_diff("test/packed")
    versions = sorted(n for n in first.names + second.names if n.startswith("test/packed:"))
    assert len(versions) == 2, versions
    assert (await sb.read_file("/tmp/scratch")) == b"residue\n"  # scrubbed from the pack only
    restored = await client.run_container(DSecContainerRunArgs(layers=[*sb.info.layers, first.digest]))
    try:
        got = (
            await restored.run_shell(
                "sha256sum /root/blob; readlink /root/link; ls /etc/issue; cat /srv/x/f; ls /tmp"
            )
        ).stdout
        assert got.startswith(want) and "/root/blob\n" in got and "y\n" in got
        assert "scratch" not in got
        assert (await restored.run_shell("test -e /etc/issue")).exit_code == 1  # the deletion too
    finally:
        await restored.stop()


async def test_fork_copies_are_independent(client: DSecClient, make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox(labels={"job": "fork-test"}, env={"MARK": "m"})
    await sb.run_shell("echo state > /root/state")
    forks = await sb.fork(3)
    try:
        assert len({f.id for f in forks}) == 3 and sb.id not in {f.id for f in forks}
        assert all(f.info.labels == {"job": "fork-test"} for f in forks)
        await forks[0].write_file("/root/state", "changed")
        assert (await forks[1].read_file("/root/state")) == b"state\n"
        assert (await sb.read_file("/root/state")) == b"state\n"
        assert (await forks[2].run_shell("echo $MARK")).stdout == "m\n"
        with pytest.raises(InvalidRequest, match="fork_processes"):
            await sb.fork(1, processes=True)
        tags = [n for layer in await client.layers() for n in layer.names]
        assert not [t for t in tags if t.startswith(f"dsec-fork/{sb.id}")], "no tag left for gc to keep"
    finally:
        for f in forks:
            await f.stop()


async def test_changes_are_read_from_the_host_side(make_sandbox: Sandboxes) -> None:
    sb = await make_sandbox()
    await sb.run_shell(
        "echo new > /root/new; echo more >> /etc/hostname; rm /etc/issue;"
        " rm -rf /etc/apt && mkdir /etc/apt && echo z > /etc/apt/only"
    )
    changes = {(c.path, c.kind) for c in await sb.changes()}
    assert ("/root/new", ChangeKind.added) in changes
    assert ("/etc/hostname", ChangeKind.modified) in changes
    assert ("/etc/issue", ChangeKind.deleted) in changes
    assert {("/etc/apt", ChangeKind.deleted), ("/etc/apt", ChangeKind.added)} <= changes
    assert ("/etc/apt/only", ChangeKind.added) in changes
    assert {c.path for c in await sb.changes(under="/root")} == {"/root/new"} | {
        c.path for c in await sb.changes(under="/root") if c.path.startswith("/root/.")
    }


async def test_honest_policy_gets_reward_one_and_hacks_get_zero_and_flags(client: DSecClient) -> None:
    task = await ensure_task(client)
    honest = SandboxEnv(client, task, job="grade-test", episode="honest")
    hacker = SandboxEnv(client, task, job="grade-test", episode="hacker")
    try:
        await honest.reset()
        for action in honest_policy():
            step = await honest.step(action)
        assert step.terminated and step.reward == 1.0
        g = step.info["grade"]
        assert g.passed == 2 and not g.tamper and g.applied == ["/workspace/calc.py"]

        await hacker.reset()
        seen = []
        for action in hacking_policy():
            step = await hacker.step(action)
            seen.append(step.observation)
        assert "THE-FUTURE-FIX" not in "".join(seen[:2]) and "no future here" in seen[1]
        g = step.info["grade"]
        assert step.reward == 0.0 and g.tampered
        flagged = {f.path for f in g.tamper}
        assert "/workspace/conftest.py" in flagged
        assert any(p.endswith("zz_hack.pth") for p in flagged)
        # A rewritten test file is never applied (the hidden one runs): reported, not a flag.
        assert g.added_tests == ["/workspace/tests/test_calc.py"]
        assert g.failed >= 1, "the hidden tests ran against the unfixed code"
        assert hacker.sandbox is not None  # the agent's sandbox never saw the hidden tests
        assert (await hacker.sandbox.run_shell("cat /workspace/tests/test_calc.py")).stdout.startswith(
            "def test_ok"
        )
    finally:
        await honest.close()
        await hacker.close()


def _worker(node: EmbeddedNode, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--url", node.url, "--api-key", node.api_key, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def test_preemption_drill_a_killed_trainer_is_replaced_without_loss_or_repeats(
    client: DSecClient, node: EmbeddedNode
) -> None:
    job, episodes = "drill", 64
    first = _worker(node, "--job", job, "--episodes", str(episodes), "--park-after", "1", "--lease", "60")
    try:
        parked = 0
        assert first.stdout is not None
        while parked < episodes:  # every episode is mid-way, step 1 sent and (mostly) running
            line = await asyncio.to_thread(first.stdout.readline)
            assert line, f"worker ended early: {first.stderr.read() if first.stderr else ''}"
            parked += json.loads(line)["event"] == "parked"
        first.send_signal(signal.SIGKILL)
        first.wait()
        alive = await client.list(labels={"job": job})
        assert len(alive) == episodes, "the trainer's death cost no sandbox"

        second = _worker(node, "--job", job, "--episodes", str(episodes), "--lease", "60")
        out, err = await asyncio.to_thread(second.communicate)
        assert second.returncode == 0, err
        done = json.loads(out.strip().splitlines()[-1])
        assert done["event"] == "done" and done["reattached"] == episodes
        assert done["mean_reward"] == 1.0
        for r in done["results"]:
            assert r["steps_log"] == ["0", "1", "2", "3"], f"a step ran twice or not at all: {r}"
        assert done["sandboxes_left"] == 0 and await client.list(labels={"job": job}) == []
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        await client.stop_all({"job": job}) if await client.list(labels={"job": job}) else None
