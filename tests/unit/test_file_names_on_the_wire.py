"""File names are bytes: a name that is not UTF-8 crosses JSON and query strings exactly."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dsec.protocol.files import decode_name, path_query
from dsec.protocol.models import Change, ChangeKind, FileStat, FileType

ODD = "/w/odd-\udcff\udcfe"  # the bytes b"/w/odd-\xff\xfe", as os.fsdecode gives them


def test_a_change_with_odd_names_round_trips_through_json() -> None:
    change = Change(path=ODD, kind=ChangeKind.added, type=FileType.symlink, target="--t\udcfd")
    wire = change.model_dump_json()
    wire.encode("utf-8")  # valid UTF-8 JSON: any client can read it
    shown = json.loads(wire)
    assert shown["path"] == "/w/odd-\ufffd\ufffd" and "path_b64" in shown and "target_b64" in shown
    assert Change.model_validate_json(wire) == change
    assert Change.model_validate(json.loads(json.dumps(change.model_dump(mode="json")))) == change


def test_utf8_names_are_on_the_wire_as_before() -> None:
    stat = FileStat(path="/w/é", name="é", type=FileType.file, size=1, mode=0o644, mtime=0, uid=0, gid=0)
    assert "_b64" not in stat.model_dump_json()
    assert path_query("path", "/w/é") == {"path": "/w/é"}


def test_a_query_carries_the_bytes() -> None:
    (key, value), *_ = path_query("path", ODD).items()
    assert key == "path_b64" and decode_name(value, "path") == ODD


@pytest.mark.parametrize("bad", ["!!!", "AA", "L3cA", "QQ==" * 3000])  # not base64, NUL, too long
def test_bad_b64_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="path_b64"):
        decode_name(bad, "path")
    with pytest.raises(ValidationError):
        Change.model_validate({"path_b64": bad, "kind": "added", "type": "file"})
