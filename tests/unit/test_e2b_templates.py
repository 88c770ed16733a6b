"""E2B template builds without a node: the edge checks of the build bodies, and the start and
ready commands a sandbox from a template runs (:mod:`dsec.apiserver.e2b.templates`)."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from dsec.apiserver.e2b import templates as templates_mod
from dsec.apiserver.e2b.template_build import BuildState
from dsec.apiserver.e2b.template_models import BuildRequest, BuildStart, TemplateConfig, split_name
from dsec.iam import Principal
from dsec.protocol.errors import CommandTimeout, InvalidRequest
from dsec.protocol.processes import ProcessEvent, ProcessStart


class _Link:
    """Answers start_process: the ready command fails ``failures`` times, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.started: list[ProcessStart] = []
        self.closed = 0

    async def start_process(self, sandbox_id: str, req: ProcessStart) -> AsyncGenerator[ProcessEvent, None]:
        self.started.append(req)
        try:
            yield ProcessEvent(t="start", pid=len(self.started))
            if req.tag == "e2b-start-cmd":
                raise AssertionError("the start command must be detached after its start event")
            code = 1 if self.failures > 0 else 0
            self.failures -= 1
            yield ProcessEvent(t="end", pid=len(self.started), exit_code=code)
        finally:
            self.closed += 1


def _templates(tmp_path: Path) -> templates_mod.Templates:
    class Store:
        root = tmp_path

    async def base() -> str:
        return "debian:bookworm"

    async def internet(link: Any, node: str) -> bool:
        return False

    return templates_mod.Templates(None, Store(), base, internet)  # type: ignore[arg-type]


async def test_start_command_detaches_and_ready_is_polled_until_it_succeeds(tmp_path: Path) -> None:
    link = _Link(failures=2)
    config = TemplateConfig(refs=["x:1"], workdir="/srv", user="app", start_cmd="serve", ready_cmd="probe")
    await _templates(tmp_path).start(link, "sb", config)  # type: ignore[arg-type]
    start, *probes = link.started
    assert start.argv == ["/bin/sh", "-c", "serve"] and (start.cwd, start.user) == ("/srv", "app")
    assert [p.argv[-1] for p in probes] == ["probe"] * 3  # failed twice, then ready
    assert link.closed == 4


async def test_a_ready_command_that_never_succeeds_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(templates_mod, "READY_TIMEOUT_S", 0.0)  # the bound already spent
    config = TemplateConfig(refs=["x:1"], ready_cmd="false")
    with pytest.raises(CommandTimeout, match="ready command"):
        await _templates(tmp_path).start(_Link(failures=1), "sb", config)  # type: ignore[arg-type]


async def test_records_survive_a_restart_and_unfinished_builds_become_errors(tmp_path: Path) -> None:
    first = _templates(tmp_path)
    principal = Principal(project="root/a", admin=False)
    records = await first._records()
    rec = templates_mod.TemplateRecord(
        template_id="t1", project="root/a", name="web", created_at=1.0, updated_at=1.0, last_status="building"
    )
    rec.tags["default"] = TemplateConfig(refs=["e2b/t1:1"], env={"A": "1"})
    records["t1"] = rec
    await first._save()
    again = _templates(tmp_path)
    config = await again.resolve(principal, "web")
    assert config is not None and config.refs == ["e2b/t1:1"] and config.env == {"A": "1"}
    assert (await again._records())["t1"].last_status == "error"
    assert await again.resolve(Principal(project="root/b", admin=False), "web") is None  # not theirs
    assert await again.resolve(principal, "web:other") is None  # a layer "web:other", if any


def test_build_state_pages_logs_by_offset_past_dropped_entries() -> None:
    state = BuildState("b", "t", Principal(project="root", admin=False))
    for n in range(2005):  # MAX_LOG_ENTRIES + 5
        state.log(str(n))
    assert state.dropped == 5
    assert [e["message"] for e in state.entries(10, 3)] == ["10", "11", "12"]
    assert state.entries(0, 1)[0]["message"] == "5"  # the oldest kept


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"steps": [{"type": "WORKDIR", "args": []}]}, "args are [path]"),
        ({"steps": [{"type": "COPY", "args": ["a", "/b", "root", "999"], "filesHash": "h"}]}, "not octal"),
        ({"steps": [{"type": "ENV", "args": ["A", "x" * 60000] * 20}]}, "KiB"),
        ({"startCmd": "a\0b"}, "NUL"),
    ],
)
def test_build_start_checks(body: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(why)):
        BuildStart.model_validate(body).check()


def test_names_and_tags() -> None:
    assert split_name("my-tpl") == ("my-tpl", "default")
    assert split_name("my-tpl:v1") == ("my-tpl", "v1")
    assert BuildRequest.model_validate({"name": "a:v1", "tags": ["v1", "stable"]}).name_and_tags() == (
        "a",
        ["v1", "stable"],
    )
    for bad in ("Upper", "a b", "", "a:bad tag", "-lead"):
        with pytest.raises(InvalidRequest):
            split_name(bad)
