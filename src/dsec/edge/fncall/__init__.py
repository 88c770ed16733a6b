"""FnCall: warm pools of pre-created sandboxes for short stateless calls, run by the edge.

Not a ``Backend``: a pool drives the ``Edge`` (it creates and stops ordinary container
sandboxes through it), so it lives beside the edge rather than among the backends.

``runner/`` is the program that runs *inside* a pool sandbox (one per sandbox, stdlib only),
shipped there as a single file: ``runner_zip()`` gives its bytes (``ship.py`` says how it is
built), and ``RUNNER_PATH`` is that file on the host, written on first use, for tests and
benchmarks that start a runner outside a sandbox. The wire shapes it speaks are
``dsec.protocol.fncall``.
"""

from __future__ import annotations

from pathlib import Path

from dsec.edge.fncall.ship import runner_path, runner_zip

RUNNER_PATH: Path  # built on first use (module __getattr__): importing the package writes nothing


def __getattr__(name: str) -> Path:
    if name == "RUNNER_PATH":
        return runner_path()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RUNNER_PATH", "runner_zip"]
