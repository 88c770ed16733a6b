"""FnCall: warm pools of pre-created sandboxes for short stateless calls, run by the edge.

Not a ``Backend``: a pool drives the ``Edge`` (it creates and stops ordinary container
sandboxes through it), so it lives beside the edge rather than among the backends.

``runner.py`` is the program that runs *inside* a pool sandbox (one per sandbox, stdlib only,
shipped there as a single file); ``RUNNER_PATH`` is where to copy it from. The wire shapes it
speaks are ``dsec.protocol.fncall``.
"""

from __future__ import annotations

from pathlib import Path

RUNNER_PATH = Path(__file__).with_name("runner.py")

__all__ = ["RUNNER_PATH"]
