"""One E2B template build, run by the apiserver as a DSec layer build.

The steps run in a build sandbox of the caller's project (its quota, its network grants) on
the base's layers, like `dsec layer build` (:mod:`dsec.sdk.build`), but driven here over the
edge link, since E2B's SDK only sends the steps and polls. What the steps changed is committed
as one layer ``e2b/<templateID>:<n>`` owned by the project; ENV, WORKDIR and USER shape the
later steps and become the template's sandbox defaults (a layer holds files only).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import posixpath
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsec.apiserver.e2b.template_models import BuildStart, Step, TemplateConfig
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.iam import Principal
from dsec.images.base import E2B_USER
from dsec.protocol.errors import BuildFailed, DSecError
from dsec.protocol.models import CommitRequest, ContainerSpec, NetworkRules
from dsec.protocol.processes import ProcessStart

log = logging.getLogger("dsec.apiserver.e2b.templates")

Status = Literal["waiting", "building", "ready", "error"]
STEP_TIMEOUT_S = 1800.0  # one RUN step
MAX_LOG_ENTRIES = 2000  # per build; older entries give way (the SDK reads them as they come)
MAX_LOG_LINE = 2000
_TAIL = 20  # log entries a failure's reason carries
_CHUNK = 1 << 20


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


@dataclass
class BuildState:
    """A build as the status route shows it (kept in memory: a restart ends builds)."""

    build_id: str
    template_id: str
    principal: Principal
    tags: list[str] = field(default_factory=list)  # what the template's tags point at once ready
    status: Status = "waiting"
    logs: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0  # entries that gave way to MAX_LOG_ENTRIES, so offsets stay stable
    reason: dict[str, Any] | None = None
    created_at: str = field(default_factory=_now)
    finished_at: str | None = None
    task: asyncio.Task[None] | None = None

    def log(self, message: str, *, level: str = "info", step: str | None = None) -> None:
        entry: dict[str, Any] = {"timestamp": _now(), "level": level, "message": message[:MAX_LOG_LINE]}
        if step is not None:
            entry["step"] = step
        self.logs.append(entry)
        if len(self.logs) > MAX_LOG_ENTRIES:
            del self.logs[0]
            self.dropped += 1

    def entries(self, offset: int, limit: int) -> list[dict[str, Any]]:
        start = max(0, offset - self.dropped)
        return self.logs[start : start + limit]

    def fail(self, message: str, step: str | None) -> None:
        self.log(message, level="error", step=step)
        self.status, self.finished_at = "error", _now()
        self.reason = {"message": message[:MAX_LOG_LINE], "logEntries": self.logs[-_TAIL:]}
        if step is not None:
            self.reason["step"] = step


def _copy_script(archive: str, src: str, dest: str, owner: str, mode: str) -> str:
    """Unpack the uploaded context and copy ``src`` (a path or glob in it) to ``dest`` as E2B
    does: a directory's contents into dest, a file into dest/ or as dest."""
    q = shlex.quote
    chown = f'chown -R {q(owner)} "$target"' if owner else ":"
    chmod = f'chmod {q(mode)} "$target"' if mode else ":"
    return f"""set -eu
t=$(mktemp -d); tar -xf {q(archive)} -C "$t"; rm -f {q(archive)}; cd "$t"
dest={q(dest)}; n=0; IFS='
'
for m in $SRC; do
  [ -e "$m" ] || [ -L "$m" ] || continue
  n=$((n + 1))
  if [ -d "$m" ] && [ ! -L "$m" ]; then mkdir -p "$dest"; cp -a "$m"/. "$dest"/; target="$dest"
  elif [ "${{dest%/}}" != "$dest" ] || [ -d "$dest" ]; then
    mkdir -p "$dest"; cp -a "$m" "$dest"/; target="${{dest%/}}/$(basename "$m")"
  else mkdir -p "$(dirname "$dest")"; cp -a "$m" "$dest"; target="$dest"; fi
  {chown}; {chmod}
done
cd /; rm -rf "$t"
[ "$n" -gt 0 ] || {{ echo "COPY: {src.replace('"', "")[:200]} matched no uploaded file" >&2; exit 1; }}
"""


# E2B's account (images/base.py's E2B_USER): uid 1000 when free, a home, bash when there is one.
_PROVISION_USER = f"""id -u {E2B_USER} >/dev/null 2>&1 && exit 0
echo "adding E2B's {E2B_USER} account"
shell=/bin/sh; [ -x /bin/bash ] && shell=/bin/bash
if command -v useradd >/dev/null 2>&1; then
  useradd -m -s "$shell" -u 1000 {E2B_USER} 2>/dev/null || useradd -m -s "$shell" {E2B_USER}
else
  adduser -D -s "$shell" {E2B_USER}
fi
"""


class Build:
    """The steps of one build in its sandbox."""

    def __init__(
        self,
        sandboxes: SandboxRoutes,
        state: BuildState,
        start: BuildStart,
        base: TemplateConfig,
        files: Callable[[str], Path],
        internet: Callable[[EdgeLink, str], Any],
    ) -> None:
        self.sandboxes, self.state, self.start = sandboxes, state, start
        self.config = base.model_copy(deep=True)
        self.files = files  # files hash -> the uploaded archive
        self.internet = internet  # (link, node) -> awaitable bool: the node offers "internet"
        self.total = len(start.steps)
        self._provisioned = False

    async def run(self, ref: str, cpu: int, memory_mb: int) -> TemplateConfig:
        cfg = self.config
        cfg.start_cmd, cfg.ready_cmd = self.start.start_cmd, self.start.ready_cmd
        cfg.build_id = self.state.build_id
        if not self.start.steps:
            self.state.log(f"no steps: the template is {'+'.join(cfg.refs)}", step="finalize")
            return cfg
        self.state.log(f"build sandbox on {' + '.join(cfg.refs)}", step="base")
        spec = ContainerSpec(
            image=None,
            layers=cfg.refs,
            cpu_cores_limit=cpu,
            memory_limit_mb=memory_mb,
            labels={"e2b.template-build": self.state.build_id},
        )
        principal = self.state.principal
        spec = self.sandboxes.tenancy.admit(principal, None, spec)
        spec = await self.sandboxes.admit_layers(principal, spec)
        [info] = await self.sandboxes.create_many(principal, spec, 1, 120)
        link = self.sandboxes.link_for(info.id)
        try:
            if await self.internet(link, info.node):
                rules: NetworkRules = {"internet": True}  # E2B's builds reach the internet
                await link.set_network_rules(info.id, rules)
            for number, step in enumerate(self.start.steps, 1):
                await self._step(link, info.id, number, step)
            self.state.log(f"commit {ref}", step="finalize")
            layer = await link.commit(info.id, CommitRequest(ref=ref))
            self.state.log(f"layer {ref} ({layer.digest[:19]}) committed", step="finalize")
        finally:
            await asyncio.shield(self._stop(link, info.id))
        cfg.refs = [*cfg.refs, ref]
        return cfg

    async def _stop(self, link: EdgeLink, sandbox_id: str) -> None:
        try:
            await link.stop(sandbox_id)
        finally:
            await self.sandboxes.tenancy.release(sandbox_id)

    def _path(self, path: str, *, unset: str | None = None) -> str:
        """``path`` from the workdir; without one, from ``unset`` or else where RUN steps run
        then (the user's home, the edge's default cwd), so ``copy(src, "d")`` then
        ``run_cmd("cat d/f")`` meet."""
        user = self.config.user
        home = "/root" if user in (None, "", "root") else f"/home/{user}"
        return posixpath.normpath(posixpath.join(self.config.workdir or unset or home, path))

    async def _step(self, link: EdgeLink, sid: str, number: int, step: Step) -> None:
        cfg, name = self.config, str(number)
        shown = f"{step.type} {' '.join(step.args)}"[:200]
        self.state.log(f"[{number}/{self.total}] {shown}", step=name)
        if step.type == "ENV":
            cfg.env.update(zip(step.args[::2], step.args[1::2], strict=True))
        elif step.type == "WORKDIR":
            cfg.workdir = self._path(step.args[0], unset="/")  # Docker's WORKDIR starts at /
            await self._run(link, sid, name, f"mkdir -p {shlex.quote(cfg.workdir)}", "root", "/")
            if cfg.user and cfg.user != "root":
                await self._run(link, sid, name, f"chown {cfg.user} {shlex.quote(cfg.workdir)}", "root", "/")
        elif step.type == "USER":
            if step.args[0] == E2B_USER and not self._provisioned:
                # E2B's builds give every template its `user` (what from_dockerfile ends on):
                # made here when the base lacks it, as DSec's e2b:base has it.
                self._provisioned = True
                await self._run(link, sid, name, _PROVISION_USER, "root", "/")
            cfg.user = step.args[0]
        elif step.type == "RUN":
            user = step.args[1] if len(step.args) > 1 and step.args[1] else cfg.user
            await self._run(link, sid, name, step.args[0], user, cfg.workdir)
        else:
            await self._copy(link, sid, name, step)

    async def _copy(self, link: EdgeLink, sid: str, name: str, step: Step) -> None:
        src, dest, *rest = step.args
        owner = (rest[0] if rest and rest[0] else None) or self.config.user or ""
        mode = rest[1] if len(rest) > 1 else ""
        assert step.files_hash is not None  # Step.check
        archive = self.files(step.files_hash)
        staged = f"/tmp/.e2b-copy-{name}.tar"
        await link.write_stream(sid, staged, _read_chunks(archive), mode=0o600)
        # Several sources (a glob) make dest a directory, as Docker's COPY (E2B's model) does.
        many = dest.endswith("/") or any(c in src for c in "*?[")
        target = self._path(dest) + ("/" if many else "")
        script = _copy_script(staged, src, target, "" if owner == "root" else owner, mode)
        await self._run(link, sid, name, script, "root", "/", env={"SRC": src})

    async def _run(
        self,
        link: EdgeLink,
        sid: str,
        step: str,
        script: str,
        user: str | None,
        cwd: str | None,
        env: dict[str, str] | None = None,
    ) -> None:
        req = ProcessStart(
            argv=["/bin/sh", "-c", script],
            env={**self.config.env, **(env or {})},
            cwd=cwd,
            user=user,
            stdin=False,
            timeout=STEP_TIMEOUT_S,
        )
        pending = b""
        end = None
        async for event in link.start_process(sid, req):
            if event.t in ("out", "err", "pty") and event.data:
                lines = (pending + event.data).split(b"\n")
                pending = lines.pop()[-MAX_LOG_LINE:]
                for line in lines:
                    self.state.log(line.decode(errors="replace"), step=step)
            elif event.t == "end":
                end = event
        if pending:
            self.state.log(pending.decode(errors="replace"), step=step)
        if end is None or end.exit_code != 0:
            why = "was killed" if end is None or end.signal else f"exited with code {end.exit_code}"
            raise BuildFailed(
                f"step {step} failed: the command {why}" + (f" ({end.error})" if end and end.error else "")
            )


async def _read_chunks(path: Path) -> AsyncIterator[bytes]:
    with path.open("rb") as fh:
        while chunk := await asyncio.to_thread(fh.read, _CHUNK):
            yield chunk


def reuse_build(state: BuildState, start: BuildStart, cached: TemplateConfig) -> TemplateConfig:
    """End ``state`` ready on the layers of an identical earlier build (``cached``), each step
    logged as E2B logs a cached layer."""
    state.status = "building"
    state.log(f"building template {state.template_id}, build {state.build_id}")
    total = len(start.steps)
    for number, step in enumerate(start.steps, 1):
        shown = f"{step.type} {' '.join(step.args)}"[:200]
        state.log(f"CACHED [{number}/{total}] {shown}", step=str(number))
    state.log(f"an identical build made {' + '.join(cached.refs)}: its layers are reused", step="finalize")
    state.log("template is ready", step="finalize")
    state.status, state.finished_at = "ready", _now()
    update = {"start_cmd": start.start_cmd, "ready_cmd": start.ready_cmd, "build_id": state.build_id}
    return cached.model_copy(update=update, deep=True)


async def run_build(build: Build, ref: str, cpu: int, memory_mb: int) -> TemplateConfig | None:
    """Run ``build`` to its end: the config when ready, None when it failed (the state says why)."""
    state = build.state
    state.status = "building"
    state.log(f"building template {state.template_id}, build {state.build_id}")
    step: str | None = None
    try:
        config = await build.run(ref, cpu, memory_mb)
    except BuildFailed as exc:
        step = exc.message.split()[1] if exc.message.startswith("step ") else None
        state.fail(exc.message, step)
        return None
    except DSecError as exc:
        state.fail(f"build failed: {exc.message}", step)
        return None
    except Exception as exc:  # a build's end is a status, never a lost task
        log.exception("template build %s failed", state.build_id)
        state.fail(f"build failed: internal error: {type(exc).__name__}: {exc}", step)
        return None
    state.log("template is ready", step="finalize")
    state.status, state.finished_at = "ready", _now()
    return config
