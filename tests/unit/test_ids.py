"""Sandbox IDs route requests by themselves: they must round-trip and reject anything else."""

from __future__ import annotations

import pytest

from dsec.protocol.errors import InvalidRequest
from dsec.protocol.ids import SandboxId, validate_node_name


@pytest.mark.parametrize("node", ["local", "n", "node-7", "a1-b2-c3", "x" * 40])
def test_new_ids_parse_back_to_the_same_node_epoch_and_tag(node: str) -> None:
    sid = SandboxId.new(node, 1_700_000_000)
    text = str(sid)
    assert text.startswith(f"sb-{node}-1700000000-")
    back = SandboxId.parse(text)
    assert back == sid
    assert (back.node, back.epoch) == (node, 1_700_000_000)
    assert str(back) == text


def test_tags_are_unguessable_and_distinct() -> None:
    tags = {SandboxId.new("local", 1).tag for _ in range(1000)}
    assert len(tags) == 1000
    for tag in tags:
        assert len(tag) == 20
        assert set(tag) <= set("abcdefghijklmnopqrstuvwxyz234567")


GOOD = str(SandboxId("local", 12, "a" * 20))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "sb-",
        "sb-local-12",
        "sb-local-12-" + "a" * 19,  # tag too short
        "sb-local-12-" + "a" * 21,  # tag too long
        "sb-local-12-" + "A" * 20,  # upper case
        "sb-local-12-" + "1" * 20,  # 0, 1, 8, 9 are not base32
        "sb-local-x-" + "a" * 20,  # epoch not a number
        "sb-local-12345678901-" + "a" * 20,  # epoch beyond 10 digits
        "sb-Local-12-" + "a" * 20,
        "sb--12-" + "a" * 20,  # no node
        "xx-local-12-" + "a" * 20,
        pytest.param(GOOD + "\n", id="trailing-newline"),
        " " + GOOD,
        GOOD + "/../x",
        "sb-" + "n" * 41 + "-12-" + "a" * 20,
    ],
)
def test_malformed_ids_are_the_callers_error(text: str) -> None:
    with pytest.raises(InvalidRequest, match="malformed sandbox id"):
        SandboxId.parse(text)


def test_a_well_formed_id_parses() -> None:
    assert SandboxId.parse(GOOD) == SandboxId("local", 12, "a" * 20)


@pytest.mark.parametrize(
    "node",
    [
        "",
        "-a",
        "a-",
        "A",
        "a_b",
        "a.b",
        "x" * 41,
        "a b",
        pytest.param("a\n", id="a-nl"),
    ],
)
def test_bad_node_names_are_rejected(node: str) -> None:
    with pytest.raises(InvalidRequest):
        validate_node_name(node)
    with pytest.raises(InvalidRequest):
        SandboxId.new(node, 1)
