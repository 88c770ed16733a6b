"""The hidden tests' manifest: which test IDs decide a task, and how the grader runs them.

A task's outcome must not depend on what happened to run: a test the submission made vanish
(skipped, never collected, an exit before it ran) is not a test that passed. So the hidden-tests
layer carries, next to the tests, a JSON file (:data:`MANIFEST_PATH` by default) naming the
expected test IDs, split as SWE-bench does:

* ``FAIL_TO_PASS``: tests the fix must make pass (they fail on the task as handed out);
* ``PASS_TO_PASS``: tests that passed before and must still pass (no regressions).

and the runner settings the grader uses instead of anything found in the workspace::

    {"FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
     "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
     "runner": "pytest",                       # or "unittest"
     "config": "/.dsec-grading/pytest.ini",    # pytest's -c; default: an empty one
     "plugins": [],                            # pytest plugins to load (-p), from the image
     "pythonpath": ["/workspace"],             # where the code under test is imported from
     "python": "/usr/bin/python3",
     "hidden_files": ["/workspace/tests/test_calc.py"],
     "timeout_s": 600}

IDs are pytest node IDs relative to the workspace (``--rootdir``), or dotted unittest IDs
(``test_calc.TestCalc.test_add``) for ``runner: unittest``. pytest runs with
``--import-mode=importlib``, so a test directory is not put on ``sys.path`` for it: tests that
import sibling helper modules (``from helpers import x``) need that directory in ``pythonpath``.
``pythonpath`` entries come after the image's own paths, so the code under test cannot shadow
the standard library or the runner.
"""

from __future__ import annotations

import json
import posixpath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.protocol.errors import InvalidRequest

__all__ = ["MANIFEST_PATH", "Manifest", "parse_manifest"]

MANIFEST_PATH = "/.dsec-grading/manifest.json"
_MAX_MANIFEST = 8 << 20
_MAX_IDS = 100_000


def _absolute(path: str) -> str:
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise ValueError(f"must be an absolute path without '..': {path!r}")
    return posixpath.normpath(path)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    fail_to_pass: list[str] = Field(default_factory=list, alias="FAIL_TO_PASS")
    pass_to_pass: list[str] = Field(default_factory=list, alias="PASS_TO_PASS")
    runner: Literal["pytest", "unittest"] = "pytest"
    config: str | None = None
    plugins: list[str] = Field(default_factory=list)
    pythonpath: list[str] | None = None  # None: the workdir
    python: str = "/usr/bin/python3"
    hidden_files: list[str] = Field(default_factory=list)
    timeout_s: float = Field(default=600, gt=0, le=86400)

    @field_validator("fail_to_pass", "pass_to_pass")
    @classmethod
    def _ids(cls, ids: list[str]) -> list[str]:
        for test_id in ids:
            if not test_id or "\0" in test_id or "\n" in test_id:
                raise ValueError(f"a test ID must be a non-empty single line, got {test_id!r}")
        return ids

    @field_validator("config", "python")
    @classmethod
    def _path(cls, path: str | None) -> str | None:
        return None if path is None else _absolute(path)

    @field_validator("pythonpath", "hidden_files")
    @classmethod
    def _paths(cls, paths: list[str] | None) -> list[str] | None:
        return None if paths is None else [_absolute(p) for p in paths]

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, names: list[str]) -> list[str]:
        for name in names:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"a plugin is a module name, got {name!r}")
        return names

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        ids = self.fail_to_pass + self.pass_to_pass
        if not ids:
            raise ValueError("the manifest names no test: FAIL_TO_PASS and PASS_TO_PASS are empty")
        if len(ids) > _MAX_IDS:
            raise ValueError(f"more than {_MAX_IDS} test IDs")
        if len(set(ids)) != len(ids):
            raise ValueError("a test ID is listed twice (or in both FAIL_TO_PASS and PASS_TO_PASS)")
        return self

    @property
    def ids(self) -> list[str]:
        return [*self.fail_to_pass, *self.pass_to_pass]

    def files(self, workdir: str) -> list[str]:
        """Absolute paths of the hidden test files: ``hidden_files`` plus, for pytest, the file
        part of each node ID."""
        out = set(self.hidden_files)
        if self.runner == "pytest":
            out |= {posixpath.join(workdir, i.split("::", 1)[0]) for i in self.ids}
        return sorted(out)


def parse_manifest(raw: bytes) -> Manifest:
    """The manifest in ``raw`` (JSON), or InvalidRequest saying what is wrong with it."""
    if len(raw) > _MAX_MANIFEST:
        raise InvalidRequest(f"the hidden-tests manifest is larger than {_MAX_MANIFEST} bytes")
    try:
        return Manifest.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(f"the hidden-tests manifest is not valid: {exc}") from exc
