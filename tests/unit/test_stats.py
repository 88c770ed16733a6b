"""The load an edge reports to the placement watcher each second, kept as sandboxes come, go,
pause and resume (edge/tally.py) rather than counted each time: it must match a recount."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dsec import DSecClient, DSecContainerRunArgs
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.models import DEFAULT_PROJECT, PROJECT_LABEL, RESERVED_LABEL_PREFIX, SandboxState

from .conftest import TINY


def recount(node: EmbeddedNode) -> dict[str, Any]:
    records = [live.record for live in node.edge._live.values()]
    labels = Counter(
        f"{k}={v}"
        for r in records
        for k, v in r.spec.labels.items()
        if not k.startswith(RESERVED_LABEL_PREFIX)
    )
    return {
        "running": len(records),
        "paused": sum(r.state is SandboxState.paused for r in records),
        "by_backend": dict(Counter(r.backend for r in records)),
        "by_project": dict(Counter(r.spec.labels.get(PROJECT_LABEL, DEFAULT_PROJECT) for r in records)),
        "by_label": dict(labels),
    }


def reported(node: EmbeddedNode) -> dict[str, Any]:
    stats = node.edge.stats()
    return {k: stats[k] for k in ("running", "paused", "by_backend", "by_project", "by_label")}


async def test_the_reported_load_follows_creates_pauses_resumes_and_stops(
    client: DSecClient, node: EmbeddedNode
) -> None:
    a = await client.run_containers(DSecContainerRunArgs(container_image=TINY, labels={"job": "a"}), 3)
    b = await client.run_containers(
        DSecContainerRunArgs(container_image=TINY, labels={"job": "b", "x": "1"}), 2
    )
    assert reported(node) == recount(node)
    assert reported(node)["by_label"] == {"job=a": 3, "job=b": 2, "x=1": 2}
    await a[0].pause()
    await b[1].pause()
    assert reported(node) == recount(node) and reported(node)["paused"] == 2
    await a[0].resume()
    await b[1].stop()  # stopped while paused
    await a[1].stop()
    assert reported(node) == recount(node)
    assert reported(node)["by_label"] == {"job=a": 2, "job=b": 1, "x=1": 1}
    assert reported(node)["paused"] == 0
    for sb in (a[0], a[2], b[0]):
        await sb.stop()
    assert reported(node) == recount(node) == {
        "running": 0, "paused": 0, "by_backend": {}, "by_project": {}, "by_label": {}
    }  # fmt: skip
