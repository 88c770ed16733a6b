"""The permissions a sandbox held, journaled (what a layer packed from it records): they
survive a reopen of the journal (an edge restart), are bounded per sandbox, and go with the
sandbox."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dsec.edge import journal as journal_module
from dsec.edge.journal import Journal, Record
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec, SandboxState


def _record(state: SandboxState, last_active_at: float) -> Record:
    return Record(
        id=str(SandboxId.new("n", 1)),
        state=state,
        backend="container",
        spec=ContainerSpec(image="tiny"),
        layers=[],
        user={},
        last_active_at=last_active_at,
    )


def test_held_permissions_survive_a_reopen_and_go_with_their_sandbox(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    kept, gone = _record(SandboxState.running, time.time()), _record(SandboxState.stopped, 0)
    try:
        for rec in (kept, gone):
            journal.insert(rec)
        journal.add_network_held(kept.id, {"mirror", "pypi@2025-06-01"})
        journal.add_network_held(kept.id, {"mirror", "other"})  # adds what is new
        journal.add_network_held(gone.id, {"mirror"})
    finally:
        journal.close()
    again = Journal(path)
    try:
        assert again.network_held(kept.id) == {"mirror", "other", "pypi@2025-06-01"}
        again.drop_network_held(kept.id)
        assert again.network_held(kept.id) == set()
        assert again.forget_before(time.time() - 100) == [gone.id]
        assert again.network_held(gone.id) == set()  # a record forgotten takes its history along
    finally:
        again.close()


def test_held_permissions_are_bounded_per_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "MAX_HELD_PERMISSIONS", 3)
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        for day in range(1, 10):  # a sandbox cycling through cutoffs
            journal.add_network_held("sb", {f"pypi@2025-01-0{day}"})
        assert len(journal.network_held("sb")) == 3
        assert journal.network_held("other") == set()
    finally:
        journal.close()
