"""The runner's main loop: start (preloads, the zygote), say ready, then one result per task line.

Speaks newline-delimited JSON on stdin and stdout, the shapes of ``dsec.protocol.fncall``
(the package docstring has the whole exchange). A bad task line gets an internal_error
result and the runner goes on; a bug of the runner's own is reported the same way, so the
edge recycles the sandbox.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from typing import Any

from . import layout
from .calls import Runner
from .layout import mark_mergeable, same_layout
from .wire import MAX_LINE, parse_task, result


def main(argv: list[str] | None = None) -> int:
    """Serve calls until stdin ends; the exit status (2: could not start)."""
    ap = argparse.ArgumentParser(description="FnCall pool runner (one per pool sandbox)")
    ap.add_argument("--workdir", required=True, help="calls get fresh directories under it")
    ap.add_argument("--preload", default="", help="comma-separated modules to import once")
    ap.add_argument("--uid", type=int, default=65534, help="calls run as this uid (when root)")
    ap.add_argument("--gid", type=int, default=65534)
    scrub_help = "writable dirs: their entries owned by the call uid go after each call"
    ap.add_argument("--scrub", default="/tmp,/var/tmp,/dev/shm,/run/lock,/dev/mqueue", help=scrub_help)
    merge_help = "the pool's hash seed: lay memory out as every runner of the pool does, for KSM"
    ap.add_argument("--mergeable", type=int, default=None, metavar="SEED", help=merge_help)
    args = ap.parse_args(argv)
    if args.mergeable is not None:
        same_layout(args.mergeable)

    def send(obj: dict[str, Any]) -> None:
        sys.stdout.buffer.write(json.dumps(obj).encode() + b"\n")
        sys.stdout.buffer.flush()

    mark = mark_mergeable if args.mergeable is not None else None
    try:  # before the preloads: its lean zygote forks the calls that need none of them
        runner = Runner(args.workdir, args.uid, args.gid, [d for d in args.scrub.split(",") if d], mark)
    except OSError as exc:
        send({"ready": False, "error": f"runner: {exc}"})
        return 2
    preloaded = []
    for name in filter(None, (n.strip() for n in args.preload.split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:
            send({"ready": False, "error": f"preload {name}: {exc!r}"})
            runner.close()
            return 2
        preloaded.append(name)
    runner.fork_warm(preloaded)
    marked = mark() if mark is not None else 0
    ready = {"ready": True, "preloaded": preloaded, "private_net": runner.private_net, "call_uid": runner.uid}
    send({**ready, "mergeable_bytes": marked, "fixed_layout": layout.own_layout})
    stdin = sys.stdin.buffer
    while line := stdin.readline(MAX_LINE + 1):
        if len(line) > MAX_LINE:
            while line and not line.endswith(b"\n"):  # skip the rest of the oversized line
                line = stdin.readline(1 << 20)
            send(result("internal_error", f"task line longer than {MAX_LINE} bytes", runner.healthy))
            continue
        try:
            task = parse_task(json.loads(line))
        except ValueError as exc:  # JSON, base64 and TaskError
            send(result("internal_error", f"invalid task: {exc}", runner.healthy))
            continue
        try:
            send(runner.call(task))
        except Exception:  # a runner bug: say so, and let the edge recycle the sandbox
            send(result("internal_error", "runner bug:\n" + traceback.format_exc()))
    runner.close()
    return 0
