"""How the grader starts the test runner so that nothing in the workspace configures it, and the
channel each test's outcome leaves through.

What the interpreter and pytest read at start-up, and how each is shut out here:

* ``python3 -I``: no working directory or script directory on ``sys.path`` (``-P``), no
  ``PYTHON*`` variables, no user site directory (so no ``usercustomize`` in any form);
* ``-S``: ``site`` is not imported at start-up, so no ``sitecustomize`` (a file or a package,
  anywhere on the path) and no ``.pth`` file runs. The bootstrap then adds the image's own
  site directories with ``site.addsitedir`` (their ``.pth`` files are the trusted image's:
  the grader never applies a change outside the workspace), and appends the workspace last, so
  a workspace module can never shadow the standard library or the runner (``pytest.py``,
  ``json.py``) but can still be imported where nothing else has its name;
* ``env -i`` with a fixed environment: no inherited ``PYTEST_ADDOPTS``, ``PYTEST_PLUGINS``,
  ``LD_PRELOAD``...; ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``: no plugin from an ``entry_points.txt``
  of any ``*.dist-info`` on the path, only the manifest's ``-p`` plugins;
* ``-c CONFIG --rootdir WORKDIR``: pytest reads the hidden layer's configuration and no
  ``pytest.toml``/``.pytest.toml``/``pytest.ini``/``pyproject.toml``/``tox.ini``/``setup.cfg``
  of the workspace; ``-p no:cacheprovider``; ``--import-mode=importlib`` so collecting a test
  does not put its directory first on ``sys.path``.

The channel: the bootstrap keeps a private duplicate of the exec's stdout and points fd 1 at
stderr before any test code is imported, so a ``print`` cannot reach it. Each test's outcome is
written to it as one line ``NONCE<TAB>{json}`` the moment the test finishes; the nonce arrives on
stdin, which is then closed. The exec stream carries the lines out of the sandbox as they are
written: a later write (an ``atexit`` handler, a result file edited after the fact) cannot change
a line already sent, and the grader keeps the first line per test ID. A process that exits or
dies early leaves the remaining IDs unreported, and unreported is failed.

What this cannot stop: the code under test runs in the runner's process, so it can patch the
report objects before they reach the plugin, or find the nonce and the fd in memory and write a
forged line. :mod:`dsec.rl.suspicious` flags the code that does such things.
"""

from __future__ import annotations

import json
import posixpath
import secrets
from dataclasses import dataclass, field

from dsec.rl.manifest import Manifest

__all__ = ["BOOTSTRAP", "Channel", "RunPlan", "plan_run", "read_channel"]

ENV = "/usr/bin/env"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

# Runs as `python3 -I -S -c BOOTSTRAP`. Keep it free of anything the workspace could shadow: it
# imports only the standard library and the runner before the workspace joins sys.path. All of
# it is one function, so the nonce and the channel's fd are no module's globals: code under test
# has to walk frames or the garbage collector to find them, which the tripwire flags.
BOOTSTRAP = r"""
def _boot():
    import os, sys, json
    _write, _dumps, _exit = os.write, json.dumps, os._exit
    nonce = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    chan = os.dup(1)
    os.dup2(2, 1)
    _null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(_null, 0)
    os.close(_null)
    sys.stdin = open(os.devnull)
    sys.dont_write_bytecode = True
    import site
    sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
    site.venv(set())  # a virtualenv interpreter's own site-packages (pyvenv.cfg beside it)
    for _d in site.getsitepackages():
        if os.path.isdir(_d):
            site.addsitedir(_d)
    wanted = frozenset(spec["ids"])


    def emit(record):
        data = (nonce + "\t" + _dumps(record) + "\n").encode()
        while data:
            data = data[_write(chan, data):]


    def tell(test_id, outcome, message=""):
        if test_id in wanted:
            emit({"id": test_id, "outcome": outcome, "message": str(message)[-2000:]})


    def run_pytest():
        import pytest

        sys.path.extend(spec["pythonpath"])

        class Reporter:
            def __init__(self):
                self.parts = {}

            @pytest.hookimpl(trylast=True)
            def pytest_collection_modifyitems(self, session, config, items):
                drop = [i for i in items if i.nodeid not in wanted]
                if drop:
                    config.hook.pytest_deselected(items=drop)
                    items[:] = [i for i in items if i.nodeid in wanted]

            @pytest.hookimpl(tryfirst=True)
            def pytest_runtest_logreport(self, report):
                parts = self.parts.setdefault(report.nodeid, [])
                parts.append(report)
                if report.when != "teardown":
                    return
                outcome, message = "passed", ""
                for r in parts:
                    if r.failed:
                        outcome, message = ("failed" if r.when == "call" else "error"), r.longrepr
                        break
                    if r.skipped:
                        outcome = "xfailed" if hasattr(r, "wasxfail") else "skipped"
                        message = r.longrepr
                        break
                else:
                    if not any(r.when == "call" for r in parts):
                        outcome = "error"
                    elif any(hasattr(r, "wasxfail") for r in parts):
                        outcome = "xpassed"
                tell(report.nodeid, outcome, message)

        return pytest.main(spec["args"], plugins=[Reporter()])


    def run_unittest():
        import unittest

        sys.path.extend(spec["pythonpath"])

        class Result(unittest.TestResult):
            def addSuccess(self, test):
                tell(test.id(), "passed")

            def addFailure(self, test, err):
                tell(test.id(), "failed", self._exc_info_to_string(err, test))

            def addError(self, test, err):
                tell(test.id(), "error", self._exc_info_to_string(err, test))

            def addSkip(self, test, reason):
                tell(test.id(), "skipped", reason)

            def addExpectedFailure(self, test, err):
                tell(test.id(), "xfailed")

            def addUnexpectedSuccess(self, test):
                tell(test.id(), "xpassed")

            def addSubTest(self, test, subtest, err):
                if err is not None:
                    tell(test.id(), "failed", self._exc_info_to_string(err, test))

        loader, result = unittest.TestLoader(), Result()
        for test_id in spec["ids"]:
            try:
                suite = loader.loadTestsFromName(test_id)
            except Exception as exc:
                tell(test_id, "error", repr(exc))
                continue
            suite.run(result)
        return 0


    code = run_pytest() if spec["runner"] == "pytest" else run_unittest()
    emit({"done": True, "exit": int(code)})
    for _f in (sys.stdout, sys.stderr):
        try:
            _f.flush()
        except Exception:
            pass
    _exit(0)


_boot()
"""


@dataclass(frozen=True)
class RunPlan:
    """One grading run: what to exec in the room and what to write to its stdin."""

    argv: list[str]
    stdin: bytes
    nonce: str
    cwd: str
    config_path: str  # where the grader writes an empty pytest config if the manifest has none


def plan_run(manifest: Manifest, *, workdir: str, scratch: str) -> RunPlan:
    """The argv and stdin that run ``manifest``'s tests in ``workdir`` of a grading sandbox.

    ``scratch`` is a directory the grader owns in the room (for the default pytest config)."""
    nonce = secrets.token_hex(16)
    config = manifest.config or posixpath.join(scratch, "pytest.ini")
    args: list[str] = []
    if manifest.runner == "pytest":
        files = sorted({i.split("::", 1)[0] for i in manifest.ids})
        args = ["-q", "-c", config, "--rootdir", workdir, "-p", "no:cacheprovider"]
        args += ["--import-mode=importlib"]
        for plugin in manifest.plugins:
            args += ["-p", plugin]
        args += ["--", *files]
    spec = {
        "runner": manifest.runner,
        "ids": manifest.ids,
        "args": args,
        "pythonpath": manifest.pythonpath if manifest.pythonpath is not None else [workdir],
    }
    env = [
        f"PATH={DEFAULT_PATH}",
        "HOME=/root",
        "LANG=C.UTF-8",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1",
    ]
    argv = [ENV, "-i", *env, manifest.python, "-I", "-S", "-c", BOOTSTRAP]
    stdin = (nonce + "\n" + json.dumps(spec) + "\n").encode()
    return RunPlan(argv=argv, stdin=stdin, nonce=nonce, cwd=workdir, config_path=config)


@dataclass
class Channel:
    """What the runner reported: the first outcome per expected ID, and anything else."""

    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (outcome, message)
    extra: list[str] = field(default_factory=list)  # IDs the manifest does not name
    done: bool = False  # the runner reached its end


def read_channel(stdout: str, nonce: str, wanted: frozenset[str] | set[str]) -> Channel:
    """Parse the channel lines in ``stdout``, in the order they were written.

    Only lines carrying ``nonce`` count; the first outcome per ID wins, so a report written after
    a test finished (a forged "passed" after a real "failed") changes nothing."""
    out = Channel()
    for line in stdout.splitlines():
        tag, sep, body = line.partition("\t")
        if not sep or tag != nonce:
            continue
        try:
            record = json.loads(body)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("done") is True:
            out.done = True
            continue
        test_id, outcome = record.get("id"), record.get("outcome")
        if not isinstance(test_id, str) or not isinstance(outcome, str):
            continue
        if test_id not in wanted:
            if test_id not in out.extra:
                out.extra.append(test_id)
        elif test_id not in out.outcomes:
            out.outcomes[test_id] = (outcome, str(record.get("message", ""))[:2000])
    return out
