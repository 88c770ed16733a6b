"""MicroVM templates of an earlier guest kit are removed at start; those of this kit stay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dsec.backends.microvm.templates import TemplateKey, Templates


def make(templates: Templates, key: TemplateKey, *, with_key: bool = True) -> Path:
    tdir = templates.dir(key)
    tdir.mkdir(parents=True)
    (tdir / "ram").write_bytes(b"x")
    (tdir / "complete").write_text("ok\n")
    if with_key:
        (tdir / "key.json").write_text(json.dumps(dataclasses.asdict(key)))
    return tdir


def test_templates_of_other_kits_and_half_built_ones_are_removed(tmp_path: Path) -> None:
    templates = Templates(tmp_path / "templates")
    assert templates.forget_other_kits("kit-b") == 0  # no directory yet: nothing to do
    current = TemplateKey("kit-b", ("sha256:aa",), 256, 1, 4096)
    old = TemplateKey("kit-a", ("sha256:aa",), 256, 1, 4096)
    keep = make(templates, current)
    make(templates, old)
    make(templates, TemplateKey("kit-b", ("sha256:bb",), 256, 1, 4096), with_key=False)  # pre-key.json
    building = templates.root / (current.name + ".building")
    building.mkdir()
    assert templates.forget_other_kits("kit-b") == 3
    assert sorted(p.name for p in templates.root.iterdir()) == [keep.name]
    assert templates.ready(current) == keep and templates.ready(old) is None
