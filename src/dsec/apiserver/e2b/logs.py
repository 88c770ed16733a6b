"""E2B's sandbox logs routes, from the trajectory the edge keeps of each sandbox
(:mod:`dsec.edge.trajectory`), and the log query helpers build logs share (``template_tags.py``).

Routes (e2b-dev/infra: ``handlers/sandbox_logs.go``, ``clusters/resources_local.go``)::

    GET /sandboxes/{id}/logs?start=&limit=                             (deprecated v1)
        -> {"logs": [{timestamp, line}], "logEntries": [SandboxLogEntry]}
    GET /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search=
        -> {"logs": [SandboxLogEntry]}      SandboxLogEntry: {timestamp, level, message, fields}

E2B's entries are envd's log lines: one per API call it served, and "Process with pid N
started"/"ended" around each command. DSec's are its trajectory: every request that changed the
sandbox (commands and processes, file writes, directories, removals, pause and resume, packs,
network rules), one entry when it started and one when it ended, with its outcome (exit code,
or the error at level ``error``; ``warn`` for a step an edge restart cut short). Reads of files
and directories are not logged (E2B logs them at debug level).

As E2B's: a sandbox the key may not see, or that no node knows any more, has no entries (200,
not 404: E2B asks its log store by team and sandbox without an existence check); a malformed
ID is a 400; v1 reads forward from ``start`` (ms since the epoch), v2 back from ``cursor``
(default now; ``direction=forward`` reads forward from it), at most ``limit`` entries (v2:
0-1000, default 1000, else 400; v1 has no maximum in E2B's spec and is clamped to 1000 here),
at or above ``level``, whose message contains ``search`` (case-sensitive, <= 256 characters).
Unlike E2B (7 days in its log store), a sandbox's entries last as long as its edge keeps its
record (``keep_finished_s`` after it ends), and at most its first :data:`MAX_STEPS` steps are
read (fewer past the edge's 32 MiB page).
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
from typing import Any

from aiohttp import web

from dsec.apiserver._http import PRINCIPAL
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.protocol.errors import Forbidden, InvalidRequest, SandboxNotFound
from dsec.protocol.http import MAX_TRAJECTORY_PAGE
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import TrajectoryEntry

LEVELS = ("debug", "info", "warn", "error")
RANK = {level: n for n, level in enumerate(LEVELS)}
MAX_LOGS = 1000  # E2B's maximum for a sandbox's logs (v2)
MAX_SEARCH = 256
# Steps read for one answer: one trajectory page, what DSec's own route may be asked for. A step
# keeps its request whole (a shell command up to 1 MiB), so more pages would let every logs call,
# which names no limit of its own, pull that much more through the edge.
MAX_STEPS = MAX_TRAJECTORY_PAGE
_MAX_TEXT = 1000  # characters of a command or path in a message or field
_MAX_MS = 10**15  # ~ year 33658: larger cursors are no times


def choice(request: web.Request, name: str, choices: tuple[str, ...], default: str) -> str:
    value = request.query.get(name, default)
    if value not in choices:
        raise InvalidRequest(f"{name} must be one of {', '.join(choices)}")
    return value


def ms_param(request: web.Request, name: str) -> int | None:
    """A query parameter of milliseconds since the epoch (None when absent)."""
    raw = request.query.get(name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 16) or int(raw) > _MAX_MS:
        raise InvalidRequest(f"{name} must be an integer of milliseconds since the epoch")
    return int(raw)


def limit_param(request: web.Request, default: int, maximum: int, *, clamp: bool = False) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 10) or (int(raw) > maximum and not clamp):
        raise InvalidRequest(f"limit must be an integer from 0 to {maximum}")
    return min(int(raw), maximum)


def timestamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def ms(stamp: str) -> int:
    return int(dt.datetime.fromisoformat(stamp).timestamp() * 1000)


def select(
    entries: list[dict[str, Any]],
    *,
    cursor: int | None,
    backward: bool,
    level: str,
    limit: int,
    search: str | None = None,
) -> list[dict[str, Any]]:
    """Log entries (oldest first, each with ``timestamp`` and ``level``) as E2B answers a query:
    from ``cursor`` (ms) on, or back from it newest first, at or above ``level``."""
    floor = RANK[level]
    picked = [e for e in entries if RANK.get(e.get("level", ""), 1) >= floor]
    if search is not None:
        picked = [e for e in picked if search in e.get("message", "")]
    if cursor is not None and backward:
        picked = [e for e in picked if ms(e["timestamp"]) <= cursor]
    elif cursor is not None:
        picked = [e for e in picked if ms(e["timestamp"]) >= cursor]
    if backward:
        picked.reverse()
    return picked[:limit]


def _subject(step: TrajectoryEntry) -> dict[str, str]:
    """What the step was about, as E2B-style string fields, bounded."""
    req = step.request
    fields: dict[str, str] = {}
    if isinstance(req.get("argv"), list):
        fields["command"] = shlex.join(str(a) for a in req["argv"])
    elif isinstance(req.get("command"), str):
        fields["command"] = req["command"]
    for key in ("path", "cwd", "user", "tag", "session"):
        if isinstance(req.get(key), str | int) and not isinstance(req.get(key), bool):
            fields[key] = str(req[key])
    return {k: v[:_MAX_TEXT] for k, v in fields.items()}


def _outcome(step: TrajectoryEntry) -> tuple[str, str, dict[str, str]]:
    """(level, how it ended, fields) of a finished step."""
    if step.status == "failed":
        err = (step.error or {}).get("error") or {}  # the DSec wire error: {"error": {code, message}}
        why = str(err.get("message") or err.get("code") or "no reason recorded")[:_MAX_TEXT]
        return "error", f"failed: {why}", {"error": why}
    if step.status == "interrupted":
        return "warn", "interrupted (its node restarted while it ran)", {}
    result = step.result or {}
    code, sig = result.get("exit_code"), result.get("signal")
    fields: dict[str, str] = {}
    if isinstance(sig, int) and sig:
        fields["signal"] = str(sig)
        how = f"killed by signal {sig}"
    elif isinstance(code, int):
        fields["exit_code"] = str(code)
        how = f"exited with code {code}"
    else:
        how = "done"
    if isinstance(result.get("error"), str):
        fields["error"] = result["error"][:_MAX_TEXT]
    return "info", how, fields


def log_entries(steps: list[TrajectoryEntry]) -> list[dict[str, Any]]:
    """E2B ``SandboxLogEntry`` dicts for a sandbox's steps, oldest first: one when each started,
    one when it ended."""
    out: list[tuple[float, int, dict[str, Any]]] = []
    for step in steps:
        what = _subject(step)
        name = step.kind.capitalize()
        base = {"event_type": f"{step.kind}_start", "step": str(step.seq), **what}
        said = f"{name} started" + (f": {what['command']}" if "command" in what else "")
        if "path" in what and "command" not in what:
            said += f": {what['path']}"
        out.append((step.started_at, 2 * step.seq, _entry(step.started_at, "info", said, base)))
        if step.finished_at is not None or step.status == "interrupted":
            level, how, extra = _outcome(step)
            when = step.finished_at if step.finished_at is not None else step.started_at
            fields = {**base, "event_type": f"{step.kind}_end", "status": step.status, **extra}
            out.append((when, 2 * step.seq + 1, _entry(when, level, f"{name} {how}", fields)))
    out.sort(key=lambda item: (item[0], item[1]))
    return [entry for _, _, entry in out]


def _entry(t: float, level: str, message: str, fields: dict[str, str]) -> dict[str, Any]:
    return {"timestamp": timestamp(t), "level": level, "message": message, "fields": fields}


def line(entry: dict[str, Any]) -> str:
    """The raw JSON line v1's ``logs`` carries for an entry (envd's lines are zerolog JSON)."""
    head = {"time": entry["timestamp"], "level": entry["level"], "message": entry["message"]}
    return json.dumps(head | entry["fields"])


class LogRoutes:
    def __init__(self, sandboxes: SandboxRoutes) -> None:
        self.sandboxes = sandboxes

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/sandboxes/{id}/logs", self.v1)
        r.add_get("/v2/sandboxes/{id}/logs", self.v2)

    async def v1(self, request: web.Request) -> web.Response:
        start = ms_param(request, "start")
        limit = limit_param(request, MAX_LOGS, MAX_LOGS, clamp=True)
        steps = await self._entries(request)
        entries = select(steps, cursor=start, backward=False, level="debug", limit=limit)
        return web.json_response(
            {"logs": [{"timestamp": e["timestamp"], "line": line(e)} for e in entries], "logEntries": entries}
        )

    async def v2(self, request: web.Request) -> web.Response:
        cursor = ms_param(request, "cursor")
        limit = limit_param(request, MAX_LOGS, MAX_LOGS)
        backward = choice(request, "direction", ("forward", "backward"), "backward") == "backward"
        level = choice(request, "level", LEVELS, "debug")
        search = request.query.get("search")
        if search is not None and len(search) > MAX_SEARCH:
            raise InvalidRequest(f"search must be at most {MAX_SEARCH} characters")
        entries = await self._entries(request)
        picked = select(entries, cursor=cursor, backward=backward, level=level, limit=limit, search=search)
        return web.json_response({"logs": picked})

    async def _entries(self, request: web.Request) -> list[dict[str, Any]]:
        raw = request.match_info["id"]
        try:
            SandboxId.parse(raw)
        except InvalidRequest:
            raise InvalidRequest("Invalid sandbox ID") from None
        try:
            link = self.sandboxes.link_for(raw)
            info = await link.get(raw)
            self.sandboxes.tenancy.check_visible(request[PRINCIPAL], raw, info.project)
            steps = await link.trajectory(raw, after=0, limit=MAX_STEPS)
        except (SandboxNotFound, Forbidden):
            return []
        return log_entries(steps)
