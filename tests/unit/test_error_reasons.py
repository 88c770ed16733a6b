"""Every error ``reason`` is a member of its class's enum (``protocol/errors.py``), one set on
every side, and the wire still carries the same plain strings.

The AST walk is what keeps a new ``raise InfraFailure(..., reason="whatever")`` from slipping
in: a reason written as a literal (or any expression that is not a member, or a name bound to
one) fails here, naming the file and line.
"""

from __future__ import annotations

import ast
import json
import socket
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

import pytest

import dsec
from dsec.apiserver.remote_edge import RemoteEdgeLink
from dsec.protocol import errors
from dsec.protocol.errors import (
    DSecError,
    InfraFailure,
    InfraReason,
    InvalidRequest,
    QuotaExceeded,
    SandboxNotFound,
    SessionLost,
    error_from_wire,
)
from dsec.sdk._transport import Transport

SRC = Path(dsec.__file__).parent
CLASSES: dict[str, type[DSecError]] = {c.__name__: c for c in errors._all_subclasses(DSecError)}
ENUMS: dict[str, type[StrEnum]] = {e.__name__: e for c in CLASSES.values() if (e := c.reasons) is not None}


def _members_bound_at_module_level(tree: ast.Module) -> dict[str, set[type[StrEnum]]]:
    """Names a module binds to reason members: ``NEVER_FITS = CapacityReason.never_fits``, or a
    tuple of members (``_DIMS``, indexed at the raise)."""
    out: dict[str, set[type[StrEnum]]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            enums = {_member_enum(v) for v in values}
            if enums and None not in enums:
                out[node.targets[0].id] = {e for e in enums if e is not None}
    return out


def _member_enum(node: ast.expr) -> type[StrEnum] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ENUMS:
        enum = ENUMS[node.value.id]
        return enum if node.attr in enum.__members__ else None
    return None


def _reason_uses() -> Iterator[tuple[str, int, type[DSecError], ast.expr, dict[str, set[type[StrEnum]]]]]:
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        bound = _members_bound_at_module_level(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            if name not in CLASSES:
                continue
            for kw in node.keywords:
                if kw.arg == "reason":
                    yield (
                        f"{path.relative_to(SRC)}:{node.lineno}",
                        node.lineno,
                        CLASSES[name],
                        kw.value,
                        bound,
                    )


def _enums_of(value: ast.expr, bound: dict[str, set[type[StrEnum]]]) -> set[type[StrEnum]] | None:
    """The enums ``value`` may be a member of, or None when it is not recognisably one."""
    if (enum := _member_enum(value)) is not None:
        return {enum}
    if isinstance(value, ast.Name) and value.id in bound:
        return bound[value.id]
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in bound:
        return bound[value.value.id]
    return None


def test_every_reason_in_src_is_a_member_of_its_class_enum() -> None:
    uses = list(_reason_uses())
    assert len(uses) > 100  # the walk found the raises (it would pass vacuously otherwise)
    wrong = []
    for where, _, cls, value, bound in uses:
        if isinstance(value, ast.Name) and value.id not in bound:
            continue  # a local computed from members (``kind`` in edge/commands.py): mypy types it
        enums = _enums_of(value, bound)
        if enums is None or cls.reasons is None or enums != {cls.reasons}:
            wrong.append(f"{where}: {cls.__name__}(reason={ast.unparse(value)})")
    assert not wrong, "reasons not written as members of their class's enum:\n" + "\n".join(wrong)


def test_a_literal_reason_is_what_the_walk_catches() -> None:
    bad = ast.parse('raise InfraFailure("x", reason="runtime")').body[0]
    assert isinstance(bad, ast.Raise) and isinstance(bad.exc, ast.Call)
    assert _enums_of(bad.exc.keywords[0].value, {}) is None


@pytest.mark.parametrize(
    "cls", [c for c in CLASSES.values() if c.reasons is not None], ids=lambda c: c.__name__
)
def test_every_member_round_trips_as_its_plain_string(cls: type[DSecError]) -> None:
    assert cls.reasons is not None
    for member in cls.reasons:
        wire = json.loads(json.dumps(cls("m", reason=member).to_wire()))
        assert wire == {"error": {"code": cls.code, "message": "m", "reason": member.value}}
        assert type(wire["error"]["reason"]) is str
        back = error_from_wire(cls.status, wire)
        assert type(back) is cls and back.reason is member and back.reason == member.value


def test_a_string_naming_a_member_becomes_the_member() -> None:
    assert InfraFailure("x", reason="node_lost").reason is InfraReason.node_lost
    assert SessionLost("x", reason="stopped").reason is InfraReason.stopped  # inherited enum
    assert SandboxNotFound("x", reason="stale_epoch").reason == "stale_epoch"
    assert str(InfraFailure("down", reason=InfraReason.edge_unreachable)) == "down [edge_unreachable]"


def test_an_unknown_reason_from_the_wire_still_parses_as_its_string() -> None:
    """Forward compatibility: a newer server's reason reaches an older client intact."""
    body = {"error": {"code": "infra_failure", "message": "m", "reason": "a_reason_from_the_future"}}
    err = error_from_wire(500, body)
    assert type(err) is InfraFailure and err.reason == "a_reason_from_the_future"
    assert type(err.reason) is str
    assert err.to_wire() == body
    # A member of another class's enum is not this class's member: kept as the plain string.
    assert type(QuotaExceeded("q", reason=InfraReason.runtime).reason) is str
    assert InvalidRequest("x").reason is None


@pytest.fixture
def refusing_url() -> Iterator[str]:
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_both_wire_clients_map_a_refused_connection_to_one_reason(refusing_url: str) -> None:
    sdk = Transport(refusing_url, "key", timeout=5)
    link = RemoteEdgeLink(refusing_url, "secret", "n1", connect_timeout=5)
    try:
        with pytest.raises(DSecError) as from_sdk:
            await sdk.request("GET", "/v1/sandboxes")
        with pytest.raises(DSecError) as from_link:
            await link.stats()
    finally:
        await sdk.close()
        await link.close()
    assert type(from_sdk.value) is type(from_link.value) is InfraFailure
    assert from_sdk.value.reason is from_link.value.reason is InfraReason.edge_unreachable
