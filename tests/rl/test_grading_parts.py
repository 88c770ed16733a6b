"""The clean-room grader's parts that need no node: the manifest, scoring over its IDs, the
result channel, the AST tripwire, and the isolated runner (run here with this venv's python)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.protocol.errors import InfraFailure, InfraReason, InvalidRequest
from dsec.rl.failures import fault_of
from dsec.rl.grading import score
from dsec.rl.manifest import Manifest, parse_manifest
from dsec.rl.runner import plan_run, read_channel
from dsec.rl.suspicious import scan_change, scan_python

F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::test_mul", "tests/test_calc.py::test_mul_zero"]


def _manifest(**kw: object) -> Manifest:
    return Manifest.model_validate({"FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P, **kw})


# -- the manifest ----------------------------------------------------------------------------


def test_manifest_parses_and_names_the_hidden_files() -> None:
    m = parse_manifest(json.dumps({"FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P}).encode())
    assert m.ids == F2P + P2P and m.runner == "pytest"
    assert m.files("/workspace") == ["/workspace/tests/test_calc.py"]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"FAIL_TO_PASS": [], "PASS_TO_PASS": []}).encode(),
        json.dumps({"FAIL_TO_PASS": ["a"], "PASS_TO_PASS": ["a"]}).encode(),
        json.dumps({"FAIL_TO_PASS": ["a\nb"]}).encode(),
        json.dumps({"FAIL_TO_PASS": ["a"], "config": "pytest.ini"}).encode(),
        json.dumps({"FAIL_TO_PASS": ["a"], "plugins": ["x; rm -rf /"]}).encode(),
        json.dumps({"FAIL_TO_PASS": ["a"], "surprise": 1}).encode(),
    ],
)
def test_a_bad_manifest_is_the_callers_error(body: bytes) -> None:
    with pytest.raises(InvalidRequest, match="manifest"):
        parse_manifest(body)


# -- scoring ---------------------------------------------------------------------------------


def _outcomes(**by_name: str) -> dict[str, tuple[str, str]]:
    return {f"tests/test_calc.py::{k}": (v, "") for k, v in by_name.items()}


def test_all_mode_needs_every_manifest_id_passed() -> None:
    m = _manifest()
    assert score(m, _outcomes(test_add="passed", test_mul="passed", test_mul_zero="passed"), "all")[0] == 1.0
    for bad in ("failed", "error", "skipped", "xfailed", "xpassed", "bogus"):
        got = score(m, _outcomes(test_add=bad, test_mul="passed", test_mul_zero="passed"), "all")
        assert got[0] == 0.0, bad
    reward, tests = score(m, _outcomes(test_mul="passed", test_mul_zero="passed"), "all")
    assert reward == 0.0 and tests[0].outcome == "missing" and tests[0].group == "FAIL_TO_PASS"


def test_fraction_mode_pays_nothing_for_doing_nothing_or_for_a_regression() -> None:
    m = _manifest(FAIL_TO_PASS=[*F2P, "tests/test_calc.py::test_sub"])
    nothing = _outcomes(test_mul="passed", test_mul_zero="passed", test_add="failed", test_sub="failed")
    assert score(m, nothing, "fraction")[0] == 0.0
    half = _outcomes(test_mul="passed", test_mul_zero="passed", test_add="passed", test_sub="failed")
    assert score(m, half, "fraction")[0] == 0.5
    regressed = _outcomes(test_mul="failed", test_mul_zero="passed", test_add="passed", test_sub="passed")
    assert score(m, regressed, "fraction")[0] == 0.0


# -- the channel -----------------------------------------------------------------------------


def test_the_channel_keeps_the_first_report_per_id_and_only_nonced_lines() -> None:
    line = lambda nonce, rec: f"{nonce}\t{json.dumps(rec)}"  # noqa: E731
    out = "\n".join(
        [
            line("n0nce", {"id": F2P[0], "outcome": "failed", "message": "boom"}),
            line("n0nce", {"id": F2P[0], "outcome": "passed"}),  # an atexit handler's late word
            line("guess", {"id": P2P[0], "outcome": "passed"}),  # a print without the nonce
            "n0nce\tnot json",
            line("n0nce", {"id": "tests/test_more.py::test_1", "outcome": "passed"}),
            line("n0nce", {"done": True, "exit": 1}),
        ]
    )
    ch = read_channel(out, "n0nce", set(F2P + P2P))
    assert ch.outcomes == {F2P[0]: ("failed", "boom")}
    assert ch.extra == ["tests/test_more.py::test_1"] and ch.done


# -- the tripwire ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("import os as o\no._exit(0)", "os._exit"),
        ("from os import _exit", "os._exit"),
        ("import _pytest.reports", "import _pytest.reports"),
        ("from _pytest import reports", "from _pytest import ..."),
        ("import atexit", "import atexit"),
        ("import sys\nsys.modules['x'] = None", "sys.modules"),
        ("import builtins", "import builtins"),
        ("getattr(__import__('os'), '_exit')(0)", "__import__"),
        ("getattr(o, '_exit')", "'_exit'"),
        ("exec('x = 1')", "exec"),
        ("def pytest_runtest_logreport(report):\n    pass", "def pytest_runtest_logreport"),
        ("open('/proc/self/fd/3', 'w')", "'/proc/self/fd'"),
        ("import sys\nf = sys._getframe(1).f_globals", "sys._getframe"),
    ],
)
def test_the_tripwire_sees_reaching_for_the_runner(source: str, what: str) -> None:
    found = scan_python(source.encode(), "/workspace/calc.py")
    assert what in [f.what for f in found], found
    assert all(f.path == "/workspace/calc.py" and f.line >= 1 for f in found)


def test_ordinary_code_is_not_suspicious() -> None:
    source = b"""import os, re, sys, json
PATTERN = re.compile(r"x+")
def add(a, b):
    '''os._exit and atexit in a docstring are words, not code'''
    print("exec", file=sys.stderr)
    return json.loads(json.dumps(a + b))
if __name__ == "__main__":
    sys.exit(add(1, 2))
"""
    assert scan_python(source, "/workspace/calc.py") == []
    assert scan_change("/workspace/data.bin", b"\x7fELF") == []


def test_unreadable_and_native_code_are_reported() -> None:
    assert scan_change("/workspace/calc.py", b"def (:")[0].what == "<unparsable>"
    assert scan_change("/workspace/_speed.cpython-311-x86_64-linux-gnu.so", b"")[0].what == "<native code>"


# -- the isolated runner, with this venv's interpreter ---------------------------------------

TESTS = """import calc

def test_add():
    assert calc.add(2, 3) == 5

def test_mul():
    assert calc.mul(4, 5) == 20

def test_mul_zero():
    assert calc.mul(7, 0) == 0
"""
CALC = "def add(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
EVERYTHING_PASSES = (
    "import _pytest.reports as r\n"
    "o = r.TestReport.from_item_and_call.__func__\n"
    "def p(cls, item, call):\n"
    "    rep = o(cls, item, call); rep.outcome = 'passed'; rep.longrepr = None; return rep\n"
    "r.TestReport.from_item_and_call = classmethod(p)\n"
)


def _run(ws: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    scratch = ws.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    (scratch / "pytest.ini").write_text("[pytest]\n")
    m = _manifest(python=sys.executable)
    plan = plan_run(m, workdir=str(ws), scratch=str(scratch))
    done = subprocess.run(plan.argv, input=plan.stdin, cwd=ws, capture_output=True, env=env, check=False)
    ch = read_channel(done.stdout.decode(), plan.nonce, set(m.ids))
    return {k.rpartition("::")[2]: v[0] for k, v in ch.outcomes.items()}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "tests").mkdir(parents=True)
    (ws / "calc.py").write_text(CALC)
    (ws / "tests" / "test_calc.py").write_text(TESTS)
    return ws


WANT = {"test_add": "failed", "test_mul": "passed", "test_mul_zero": "passed"}


def test_the_runner_reports_each_manifest_test(workspace: Path) -> None:
    assert _run(workspace) == WANT


@pytest.mark.parametrize(
    "plant",
    [
        {"pytest.toml": '[pytest]\naddopts = ["-k", "mul"]\n'},
        {".pytest.toml": '[pytest]\naddopts = ["-k", "mul"]\n'},
        {"pytest.ini": "[pytest]\naddopts = -k mul\n"},
        {"pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-k mul"\n'},
        {"conftest.py": "def pytest_collection_modifyitems(items):\n    items[:] = items[1:]\n"},
        {"pytest.py": "raise SystemExit(0)\n"},
        {"json.py": "raise SystemExit(0)\n"},
        {"sitecustomize.py": EVERYTHING_PASSES},
        {"usercustomize/__init__.py": EVERYTHING_PASSES},
        {"zz.pth": "import evil\n", "evil.py": EVERYTHING_PASSES},
        {
            "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
            "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evil\n",
            "evil.py": EVERYTHING_PASSES,
        },
    ],
    ids=lambda plant: "+".join(plant),
)
def test_nothing_in_the_workspace_configures_the_runner(workspace: Path, plant: dict[str, str]) -> None:
    # conftest.py is shut out by the tamper list (never applied), not by the runner: a task's
    # own conftest.py is legitimate. Here it sits in the workspace, so it runs.
    for rel, text in plant.items():
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        (workspace / rel).write_text(text)
    got = _run(workspace)
    if "conftest.py" in plant:
        assert got.get("test_add") != "passed"  # a dropped test is unreported, not passed
    else:
        assert got == WANT


def test_the_environment_is_the_graders(workspace: Path) -> None:
    (workspace / "evil.py").write_text(EVERYTHING_PASSES)
    env = {"PYTEST_ADDOPTS": "-p evil", "PYTEST_PLUGINS": "evil", "PYTHONPATH": str(workspace)}
    assert _run(workspace, env={"PATH": "/usr/bin:/bin", **env}) == WANT


def test_a_late_writer_cannot_change_a_reported_outcome(workspace: Path) -> None:
    (workspace / "calc.py").write_text(
        CALC + "import atexit, os\natexit.register(lambda: os.write(1, b'forged'))\n"
    )
    assert _run(workspace) == WANT


def test_an_exit_at_import_reports_nothing(workspace: Path) -> None:
    (workspace / "calc.py").write_text("import os\nos._exit(0)\n" + CALC)
    assert _run(workspace) == {}


def test_the_in_process_limit_is_real(workspace: Path) -> None:
    """Code under test shares the runner's process: patched reports reach the channel. Only the
    tripwire (and strict grading) stands between this and a pass."""
    (workspace / "calc.py").write_text(CALC + EVERYTHING_PASSES)
    assert _run(workspace)["test_add"] == "passed"
    assert scan_python((workspace / "calc.py").read_bytes(), "/workspace/calc.py")


# -- whose fault -----------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(InfraReason))
def test_work_the_platform_cut_short_is_infra(reason: InfraReason) -> None:
    assert fault_of(InfraFailure("cut", reason=reason)) == "infra"
