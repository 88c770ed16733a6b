"""gVisor's platform probe runs once per host boot, not once per node: the answer is the host's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsec.backends.container import gvisor


@pytest.fixture
def host_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "run" / "gvisor-probe.json"
    monkeypatch.setattr(gvisor, "HOST_CACHE", cache)
    monkeypatch.setattr(gvisor, "_probed", {})  # as a new process: nothing memoised
    return cache


def node(root: Path) -> gvisor.GVisor:
    g = gvisor.GVisor(root)
    g.runsc = sys.executable  # any binary: the answer is keyed by its path, size and mtime
    return g


async def test_a_node_on_a_fresh_data_dir_takes_the_answer_another_node_probed(
    tmp_path: Path, host_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list[str] = []

    async def try_platform(self: gvisor.GVisor, platform: str, runtime_dir: Path) -> str | None:
        tried.append(platform)
        return None if platform == "ptrace" else "no KVM here"

    monkeypatch.setattr(gvisor.GVisor, "_try_platform", try_platform)
    first = node(tmp_path / "a")
    await first.probe(tmp_path)
    assert first.platform == "ptrace" and tried[-1] == "ptrace" and host_cache.exists()

    monkeypatch.setattr(gvisor, "_probed", {})
    tried.clear()
    second = node(tmp_path / "b")
    await second.probe(tmp_path)
    assert (second.platform, second.why_not, tried) == ("ptrace", None, [])


async def test_another_runsc_binary_is_probed_again(
    tmp_path: Path, host_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_cache.parent.mkdir(parents=True)
    host_cache.write_text('{"key": "/usr/bin/runsc:1:1", "platform": "kvm", "why_not": null}')

    async def try_platform(self: gvisor.GVisor, platform: str, runtime_dir: Path) -> str | None:
        return None if platform == "ptrace" else "no KVM here"

    monkeypatch.setattr(gvisor.GVisor, "_try_platform", try_platform)
    g = node(tmp_path / "a")
    await g.probe(tmp_path)
    assert g.platform == "ptrace"  # not the other binary's "kvm"
