"""Every DSec error survives the wire as its own class, so ``except SandboxNotFound`` works."""

from __future__ import annotations

import json

import pytest

import dsec
from dsec.protocol.errors import DSecError, InfraFailure, error_from_wire


def _all(cls: type[DSecError]) -> list[type[DSecError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all(sub))
    return out


ALL = _all(DSecError)


def test_the_documented_tree_is_complete() -> None:
    names = {c.__name__ for c in ALL}
    assert {
        "InvalidRequest",
        "LayerNotFound",
        "Unauthorized",
        "Forbidden",
        "SandboxNotFound",
        "FileNotFound",
        "Conflict",
        "QuotaExceeded",
        "CapacityExhausted",
        "CommandTimeout",
        "InfraFailure",
        "SessionLost",
    } <= names
    for cls in ALL:
        assert getattr(dsec, cls.__name__) is cls, f"{cls.__name__} is not exported by dsec"


def test_wire_codes_are_unique() -> None:
    codes = [c.code for c in ALL]
    assert len(codes) == len(set(codes)), "a subclass without its own code comes back as its parent"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("reason", [None, "runtime"])
def test_every_error_round_trips_through_json(cls: type[DSecError], reason: str | None) -> None:
    err = cls("something went wrong: ünïcode", reason=reason)
    body = json.loads(json.dumps(err.to_wire()))
    back = error_from_wire(cls.status, body)
    assert type(back) is cls
    assert back.message == err.message
    assert back.reason == reason
    assert str(back) == str(err)
    assert 400 <= cls.status < 600


def test_subclasses_are_caught_by_their_parents() -> None:
    back = error_from_wire(404, {"error": {"code": "layer_not_found", "message": "no layer"}})
    assert isinstance(back, dsec.InvalidRequest)
    back = error_from_wire(500, {"error": {"code": "session_lost", "message": "gone"}})
    assert isinstance(back, InfraFailure)


@pytest.mark.parametrize("body", ["<html>bad gateway</html>", None, {"detail": "x"}, {"error": "text"}, []])
def test_bodies_that_are_not_dsec_errors_become_protocol_infra_failures(body: object) -> None:
    back = error_from_wire(502, body)
    assert type(back) is InfraFailure
    assert back.reason == "protocol"
    assert "502" in back.message


def test_an_unknown_code_from_a_newer_server_is_still_a_dsec_error() -> None:
    back = error_from_wire(418, {"error": {"code": "from_the_future", "message": "m", "reason": "r"}})
    assert isinstance(back, DSecError)
    assert (back.message, back.reason) == ("m", "r")


STATUSES = [
    ("edge_starting", 503), ("edge_unreachable", 503), ("node_lost", 503), ("overflow_unreachable", 503),
    ("upstream", 502), ("runtime", 500), (None, 500),
]  # fmt: skip


@pytest.mark.parametrize(("reason", "status"), STATUSES)
def test_an_infra_failure_out_of_reach_for_now_answers_service_unavailable(
    reason: str | None, status: int
) -> None:
    """A starting or unreachable edge is not the server's bug: 503 tells a client, a proxy or a
    load balancer to try again; the code and reason on the wire stay the same."""
    err = InfraFailure("x", reason=reason)
    assert err.status == status
    back = error_from_wire(err.status, json.loads(json.dumps(err.to_wire())))
    assert type(back) is InfraFailure and back.reason == reason and back.status == status
    assert dsec.SandboxStopped("gone", reason="node_lost").status == 410  # its own status stays
