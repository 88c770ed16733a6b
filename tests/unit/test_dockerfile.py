"""The Dockerfile subset and the residue scrub, without a sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.images.commit import DEFAULT_SCRUB, scrub
from dsec.images.dockerfile import parse
from dsec.protocol.errors import InvalidRequest


def test_parse_steps_continuations_and_forms() -> None:
    plan = parse(
        "# comment\n"
        "FROM debian:bookworm tools:1\n"
        "ENV A=1 B='two words'\n"
        "ENV LEGACY value with spaces\n"
        "WORKDIR /app\n"
        'RUN ["python3", "-c", "print(1)"]\n'
        "RUN apt-get update && \\\n"
        "    echo done\n"
        "COPY --chown=1:1 a b /dst/\n"
    )
    assert plan.base == ["debian:bookworm", "tools:1"]
    kinds = [(s.kind, s.args, s.line) for s in plan.steps]
    assert kinds == [
        ("ENV", ("A=1", "B=two words"), 3),
        ("ENV", ("LEGACY=value with spaces",), 4),
        ("WORKDIR", ("/app",), 5),
        ("RUN", ("python3 -c 'print(1)'",), 6),
        ("RUN", ("apt-get update &&      echo done",), 7),
        ("COPY", ("a", "b", "/dst/"), 9),
    ]


def test_base_argument_supplies_or_overrides_from() -> None:
    assert parse("RUN true\n", base=["x:1"]).base == ["x:1"]
    assert parse("FROM a:1\nRUN true\n", base=["x:1"]).base == ["x:1"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("RUN true\n", "no base"),
        ("FROM a:1\nADD x /\n", "'ADD' is not supported"),
        ("FROM a:1 AS build\n", "no stages"),
        ("FROM a:1\nRUN true\nFROM b:1\n", "only one FROM"),
        ("FROM a:1\nCOPY onlyone\n", "COPY needs"),
        ("FROM a:1\nENV =x\n", "NAME=value"),
        ('FROM a:1\nRUN ["unterminated\n', "JSON form"),
        ("FROM a:1\nRUN --network=host true\n", "none or default"),
        ("FROM a:1\nRUN --mount=type=cache,target=/x true\n", "--mount is not supported"),
    ],
)
def test_bad_dockerfiles_are_rejected_with_their_line(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse(text)


def test_scrub_removes_residue_only_inside_the_upper_dir(tmp_path: Path) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    for rel in ("tmp/a", "root/.cache/pip/x", "root/.bash_history", "home/u/.cache/y", "app/keep"):
        (upper / rel).parent.mkdir(parents=True, exist_ok=True)
        (upper / rel).write_text("x")
    (upper / ".dsec").mkdir()
    os.mknod(upper / "tmp" / "deleted-lower-file", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    (upper / "var").mkdir()
    (upper / "var" / "log").symlink_to(outside)  # planted: must not lead the scrub outside
    removed = scrub(upper, [*DEFAULT_SCRUB, "app/*.tmp"])
    assert "root/.cache" in removed and "tmp/a" in removed and ".dsec" in removed
    assert sorted(p.name for p in (upper / "tmp").iterdir()) == []
    assert (upper / "app" / "keep").exists() and (outside / "precious").read_text() == "keep"
    assert not (upper / "home" / "u" / ".cache").exists()
    with pytest.raises(InvalidRequest):
        scrub(upper, ["../outside/*"])


def test_run_network_flags_choose_the_build_s_grants_or_none() -> None:
    plan = parse("FROM a:1\nRUN apt-get update\nRUN --network=none make test\nRUN --network=default true\n")
    assert [(s.args[0], s.network) for s in plan.steps] == [
        ("apt-get update", "default"),
        ("make test", "none"),
        ("true", "default"),
    ]
