"""The two ways people meet DSec besides the async SDK: `dsec up` + CLI, and the sync client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from dsec import DSec, DSecClient, DSecContainerRunArgs, SandboxNotFound, SyncSandbox
from dsec.node.embedded import EmbeddedNode
from dsec.rl.demo import build_repository
from tests.conftest import BASE, DATA_DIR
from tests.support import DSEC, dsec_env, start_dsec_up


async def test_sync_client_has_the_same_surface(node: EmbeddedNode) -> None:
    def use_sync() -> tuple[str, str, bytes, list[str]]:
        with DSec(node.url, node.api_key) as client:
            sb = client.run_container(DSecContainerRunArgs(container_image=BASE))
            assert isinstance(sb, SyncSandbox)
            with sb:
                out = sb.run_shell("echo sync").stdout
                sb.write_file("/tmp/s.txt", b"sync-bytes")
                data = sb.read_file("/tmp/s.txt")
                streamed = [type(item).__name__ for item in sb.exec_stream(["echo", "x"])]
                listed = [s.id for s in client.list()]
                assert sb.id in listed
                assert sb.pause().state.value == "paused"
                copies = sb.fork(2)
                assert all(isinstance(c, SyncSandbox) for c in copies)
                assert [c.read_file("/tmp/s.txt") for c in copies] == [b"sync-bytes"] * 2
                for c in copies:
                    c.stop()
            with pytest.raises(SandboxNotFound):
                sb.run_shell("true")
            return sb.id, out, data, streamed

    sid, out, data, streamed = await asyncio.to_thread(use_sync)
    assert out == "sync\n" and data == b"sync-bytes"
    assert streamed == ["ExecChunk", "CommandResult"]
    assert (await DSecClient(node.url, node.api_key).get(sid)).info.state.value == "stopped"


async def test_dsec_up_then_sdk_and_cli_connect_by_default(
    base_layer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.json"
    env = dsec_env(config)
    up = await asyncio.to_thread(start_dsec_up, tmp_path / "node", DATA_DIR / "layers", config, "cli")
    try:
        assert set(json.loads(config.read_text())) == {"url", "api_key"}
        monkeypatch.setenv("DSEC_CONFIG", str(config))
        monkeypatch.delenv("DSEC_URL", raising=False)
        monkeypatch.delenv("DSEC_API_KEY", raising=False)
        client = DSecClient()  # no arguments: the node `dsec up` just wrote down
        await client.open()
        try:
            sb = await client.run_container(DSecContainerRunArgs(container_image=BASE))
            assert (await sb.run_shell("echo hello world")).stdout == "hello world\n"

            layer_dir = tmp_path / "layer"
            (layer_dir / "opt").mkdir(parents=True)
            (layer_dir / "opt" / "tool.sh").write_text("echo tool\n")
            ref = f"cli-test:{uuid.uuid4().hex[:8]}"
            run = lambda *a: subprocess.run([DSEC, *a], env=env, capture_output=True, text=True)  # noqa: E731
            imported = await asyncio.to_thread(run, "layer", "import", str(layer_dir), "--name", ref)
            assert imported.returncode == 0, imported.stderr
            assert json.loads(imported.stdout)["digest"].startswith("sha256:")
            listing = await asyncio.to_thread(run, "layer", "ls")
            assert ref in listing.stdout and BASE in listing.stdout
            shown = await asyncio.to_thread(run, "sandbox", "ls")
            assert sb.id in shown.stdout
            said = await asyncio.to_thread(run, "sandbox", "sh", sb.id, "echo from-cli; exit 3")
            assert said.stdout == "from-cli\n" and said.returncode == 3
            paused = await asyncio.to_thread(run, "sandbox", "pause", sb.id)
            assert paused.returncode == 0 and f"{sb.id} paused" in paused.stdout, paused.stderr
            assert (await sb.refresh()).state.value == "paused"
            log = await asyncio.to_thread(run, "sandbox", "log", sb.id, "--json")
            kinds = [json.loads(line)["kind"] for line in log.stdout.splitlines()]
            assert kinds == ["shell", "shell", "pause"], log.stdout
            renewed = await asyncio.to_thread(run, "job", "renew", "no-such-job", "--lease", "30")
            assert renewed.returncode == 0 and "0 sandboxes" in renewed.stdout, renewed.stderr
            await sb.stop()
            upstream = tmp_path / "upstream"
            base = build_repository(upstream)  # a base commit, then the fix after it
            ws_ref = f"cli-ws:{uuid.uuid4().hex[:8]}"
            made_ws = await asyncio.to_thread(
                run, "layer", "workspace", str(upstream), base, "--name", ws_ref
            )
            assert made_ws.returncode == 0, made_ws.stderr
            task = await client.run_container(DSecContainerRunArgs(layers=[BASE, ws_ref]))
            history = await task.run_shell("cd /workspace && git log --all --format=%H && cat calc.py")
            assert history.stdout.startswith(f"{base}\n") and "THE-FUTURE-FIX" not in history.stdout
            await task.stop()
            (layer_dir / "Dockerfile").write_text(
                "FROM debian:bookworm\nCOPY opt/tool.sh /opt/\nRUN echo built\n"
            )
            built_ref = f"cli-built:{uuid.uuid4().hex[:8]}"
            built = await asyncio.to_thread(run, "layer", "build", str(layer_dir), "--name", built_ref, "-v")
            assert built.returncode == 0, built.stderr
            assert "[1/2]" in built.stdout and "[commit]" in built.stdout and "built\n" in built.stdout
            made = await asyncio.to_thread(run, "project", "create", "root", "cli-team", "--sandboxes", "3")
            assert made.returncode == 0 and "root/cli-team" in made.stdout, made.stderr
            key = (await asyncio.to_thread(run, "key", "issue", "root/cli-team")).stdout.strip()
            assert key.startswith("dsec_")
            listed = await asyncio.to_thread(run, "project", "ls")
            assert "root/cli-team" in listed.stdout and "0 / 3" in listed.stdout
            async with DSecClient(json.loads(config.read_text())["url"], key) as team:
                with pytest.raises(SandboxNotFound):  # the admin's sandbox is not the team's to see
                    await team.get(sb.id)
                assert (await client.get(sb.id)).id == sb.id
            vol = await asyncio.to_thread(run, "volume", "create", "cli-vol", "--size-mb", "16")
            assert vol.returncode == 0 and vol.stdout.startswith("vol-"), vol.stderr
            vid = vol.stdout.strip()
            put = await asyncio.to_thread(
                run, "volume", "put", vid, str(layer_dir / "opt" / "tool.sh"), "/t.sh"
            )
            assert put.returncode == 0 and "/t.sh: 10 bytes" in put.stdout, put.stderr
            cat = await asyncio.to_thread(run, "volume", "cat", vid, "/t.sh")
            assert cat.stdout == "echo tool\n"
            assert vid in (await asyncio.to_thread(run, "volume", "ls")).stdout
            assert (await asyncio.to_thread(run, "volume", "rm", vid)).returncode == 0
            gone = await asyncio.to_thread(run, "volume", "cat", vid, "/t.sh")
            assert gone.returncode != 0 and "not found" in gone.stderr
            bad = await asyncio.to_thread(run, "sandbox", "create", "no-such:1")
            assert bad.returncode == 2 and "no-such:1" in bad.stderr
        finally:
            for left in await client.list():  # also when an assertion failed midway
                await left.stop()
            await client.close()
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = await asyncio.to_thread(up.communicate, timeout=60)
    assert up.returncode == 0, out.decode()
    assert b"DSec is up" in out
