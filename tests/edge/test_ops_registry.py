"""The set of sandbox operations is closed, and everything that serves them serves all of them.

No node here: these walk :data:`dsec.protocol.ops.OPS` against the local link's handler table,
the control-plane bench's simulated edge, the link conformance suite's cases and the wire
(every op serializes and parses back through the union the edge server reads).
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any, get_args

import pytest

from dsec.edge.op_handlers import CALLS, STREAMS
from dsec.protocol import ops
from dsec.protocol.errors import InvalidRequest
from dsec.protocol.models import ContainerSpec, InputEvent
from dsec.protocol.ops import ANY_OP, OPS, AnyOp, Call, Stream, parse_op

from .link_conformance import OP_CASES, LinkConformance

# One valid op of every kind (tests/security/test_route_fuzz.py fuzzes the edge's routes).
SAMPLES: dict[str, dict[str, Any]] = {
    "stat": {"path": "/work/odd-\udcff"},  # a name that is not UTF-8 travels as path_b64
    "list_dir": {"path": "/"},
    "mkdir": {"path": "/a/b", "parents": False},
    "remove": {"path": "/a", "recursive": True},
    "move": {"source": "/a", "destination": "/b-\udcfe"},
    "set_xattrs": {"path": "/f", "prefix": "user.e2b.", "attrs": {"k": "v"}},
    "xattrs": {"path": "/f", "prefix": "user.e2b."},
    "changes": {"under": "/work"},
    "watch_dir": {"path": "/tmp", "recursive": True},
    "pause": {},
    "resume": {},
    "set_network_rules": {"network_rules": {"pypi": {"before": "2025-06-01"}, "github": False}},
    "set_deadline": {"timeout_s": 60.5, "on_timeout": "pause"},
    "trajectory": {"after": 3, "limit": 10},
    "metrics": {"start": 1712345678.25, "end": 1712345679},
    "screenshot": {},
    "fork_local": {"ids": ["sb-n-1-" + "a" * 20], "labels": {"k": "v"}},
    "send_input": {"events": [InputEvent(type="key", keys=["ctrl", "c"])]},
    "fork_spec": {"ref": "forked:1"},
    "run_shell": {"command": "echo hi", "session": "s1", "timeout": 5, "idempotency_key": "k"},
    "commit": {"ref": "snap:2", "scrub_defaults": False, "exclude": ["/tmp/x"]},
    "exec": {"argv": ["sh", "-c", "cat"], "stdin_b64": "aGk=", "env": {"A": "1"}, "cwd": "/tmp"},
    "start_process": {"argv": ["sleep", "1"], "tag": "t", "pty": {"rows": 24, "cols": 80}},
    "connect_process": {"pid": 42},
    "list_processes": {},
    "send_process_input": {"pid": 42, "data": b"\xff\x00bytes"},
    "close_process_stdin": {"pid": 42},
    "signal_process": {"pid": 42, "signal": 15},
    "resize_process": {"pid": 42, "rows": 50, "cols": 132},
}


def _defined_ops() -> set[type]:
    """Every op model defined in dsec.protocol.ops (a Call[...] or Stream[...] with a kind)."""
    found = set()
    for _, obj in inspect.getmembers(ops, inspect.isclass):
        if issubclass(obj, (Call, Stream)) and "kind" in obj.model_fields and obj.__module__ == ops.__name__:
            if isinstance(obj.model_fields["kind"].default, str):  # not Call[X] itself
                found.add(obj)
    return found


def test_every_op_model_is_registered_and_in_the_union() -> None:
    assert _defined_ops() == set(OPS.values()), "an op model is missing from OPS"
    union = get_args(get_args(AnyOp)[0])
    assert set(union) == set(OPS.values()), "OPS and the AnyOp union differ"
    for kind, model in OPS.items():
        assert model.model_fields["kind"].default == kind
        assert model.streams == issubclass(model, Stream)
        assert model.streams or model.last is None


def test_the_local_link_has_a_handler_for_every_op() -> None:
    calls = {kind for kind, model in OPS.items() if not model.streams}
    streams = {kind for kind, model in OPS.items() if model.streams}
    assert {m.model_fields["kind"].default for m in CALLS} == calls
    assert {m.model_fields["kind"].default for m in STREAMS} == streams


def test_the_link_conformance_suite_exercises_every_op() -> None:
    assert set(OP_CASES) == set(OPS), "an op without a conformance case (or a case for none)"
    for kind, case in OP_CASES.items():
        assert callable(getattr(LinkConformance, case, None)), f"{kind}: no test {case} in the suite"


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_op_goes_over_the_wire_and_back(kind: str) -> None:
    op = OPS[kind](**SAMPLES[kind])
    wire = op.model_dump_json()
    assert ANY_OP.validate_json(wire) == op
    assert parse_op(kind, wire.encode()) == op  # what the edge server reads
    assert set(SAMPLES) == set(OPS)


def test_a_bad_op_is_the_callers_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="path"):
        ops.Stat(path="/a\0b")
    with pytest.raises(InvalidRequest, match="unknown sandbox operation"):
        parse_op("format_disk", b"{}")
    with pytest.raises(InvalidRequest, match="kind"):
        parse_op("stat", b'{"kind": "mkdir", "path": "/"}')  # the route names the model
    with pytest.raises(InvalidRequest, match="pid"):
        parse_op("signal_process", b'{"pid": 0, "signal": 9}')


def _simedge() -> ModuleType:
    path = Path(__file__).parents[2] / "bench" / "_controlplane" / "simedge.py"
    spec = importlib.util.spec_from_file_location("simedge_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_benchs_simulated_edge_names_every_op() -> None:
    simedge = _simedge()
    assert set(simedge.SIMULATED) == set(OPS)
    link = simedge.SimulatedEdgeLink("sim-a", 1, capacity=4)
    sid = (await link.create(ContainerSpec(image="x:1"))).id
    for kind, model in OPS.items():
        op = model(**SAMPLES[kind])
        if simedge.SIMULATED[kind] is not None:
            assert isinstance(op, Call)
            await link.call(sid, op)
        else:
            with pytest.raises(InvalidRequest, match=f"does not simulate {kind}"):
                if isinstance(op, Call):
                    await link.call(sid, op)
                else:
                    assert isinstance(op, Stream)
                    await anext(link.stream(sid, op))
    assert (await link.pause(sid)).state == "paused"
    assert (await link.resume(sid)).state == "running"
