"""Warm pools for FnCall: pre-created container sandboxes, each serving calls through a runner.

A pool is a set of ordinary container sandboxes of one environment (an image or layer list),
created by the edge with no network and labelled as pool members (hidden from listings). In
each, the edge starts ``fncall-runner.py`` (bind-mounted read-only from the node at ``/.dsec``) and
holds its pipes: one ``FnTask`` JSON line in, one ``FnResult`` line out, one call at a time
per sandbox. Creating, namespacing and mounting happen when the pool fills, never on a call.

A sandbox is recycled (stopped, and a fresh one started in the background) after
``max_calls`` calls, when the runner reports it could not prove the sandbox clean, or when
the runner dies; the call that ended it has its answer first. Its successor starts a little
before ``max_calls`` (5% of it ahead), so that replacement costs no capacity. A call whose
runner died before answering is retried once on another sandbox: calls are stateless, and
the runner, not user code, is what died.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, get_args

from pydantic import ValidationError

from dsec.executor.process import SandboxProcess
from dsec.protocol.errors import CapacityExhausted, InfraFailure, InfraReason
from dsec.protocol.fncall import FnResult, FnRunnerReady, FnTask, Language
from dsec.protocol.models import RESERVED_LABEL_PREFIX, ContainerSpec, SandboxInfo

if TYPE_CHECKING:
    from dsec.density.ksm import Ksm

log = logging.getLogger("dsec.fncall")


class PoolHost(Protocol):
    """What a pool uses of the edge it runs on (:class:`dsec.edge.edge.Edge`), and nothing more:
    the pool does not import the edge, so no import cycle runs through it."""

    ksm: Ksm

    async def create(self, spec: ContainerSpec, sandbox_id: str | None = None) -> SandboxInfo: ...

    async def spawn_service(self, sandbox_id: str, argv: list[str]) -> SandboxProcess: ...

    async def stop(self, sandbox_id: str, *, reason: str = ...) -> SandboxInfo: ...


POOL_LABEL = RESERVED_LABEL_PREFIX + "pool"
RUNNER_IN_SANDBOX = "/.dsec/fncall-runner.py"  # the node's runtime directory, read-only in sandboxes
CALL_DIRS = "/tmp/fncall"  # the runner's --workdir: each call's directory is made in it
_READY_TIMEOUT_S = 60.0  # preloading heavy modules (numpy, torch) takes a while
_ANSWER_MARGIN_S = 30.0  # beyond the task's own timeouts: cleanup, compiling, fetching files
_LINE_LIMIT = 256 << 20
_CLOSE_TIMEOUT_S = 5.0  # a result carries at most two capped streams and fetched files
# Each pool sandbox runs its calls as a uid of its own: RLIMIT_NPROC counts a uid's processes
# and threads across the whole node (sandboxes have no user namespace), so with one shared uid
# a call's threads would count against every other sandbox's call at the same moment. Each edge
# process takes a slot of uids no other process on the host holds (a `dsec up` beside the tests:
# a runner kills every process of its call uid after each call), by a lock it holds for life.
_CALL_UID_SPAN = 1 << 16
_CALL_UID_SLOTS = 2000  # 1.9e9 + 2000 x 65,536 stays below 2^31
_CALL_UID_CLAIMS = Path("/run/dsec/fncall-uids")
_call_uid_base: int | None = None
_call_uids_in_use: set[int] = set()


def _claim_call_uid_slot() -> int:
    start = os.getpid() % _CALL_UID_SLOTS
    with contextlib.suppress(OSError):
        _CALL_UID_CLAIMS.mkdir(parents=True, exist_ok=True)
        for i in range(_CALL_UID_SLOTS):
            slot = (start + i) % _CALL_UID_SLOTS
            fd = os.open(_CALL_UID_CLAIMS / str(slot), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return slot  # fd stays open (and locked) until the process ends
    return start


def _take_call_uid() -> int:
    global _call_uid_base
    if _call_uid_base is None:
        _call_uid_base = 1_900_000_000 + _claim_call_uid_slot() * _CALL_UID_SPAN
    base = _call_uid_base
    uid = next(u for u in range(base, base + _CALL_UID_SPAN) if u not in _call_uids_in_use)
    _call_uids_in_use.add(uid)
    return uid


@dataclass
class PoolConfig:
    """One pool on every edge that has it configured."""

    name: str = "default"
    image: str = "debian:bookworm-cc"  # the base with gcc and g++: every language works
    # Instead of image: a layer list, base first (the python runtime on the toolchain base).
    layers: list[str] = field(default_factory=list)
    size: int = 2
    # Then the sandbox is replaced, whatever cleanup says (each call's cleanup is proven: this
    # is hygiene). A replacement costs ~0.7 s of CPU with numpy preloaded: at 500 it was ~1.5
    # of a /run_code call's ~5 ms (docs/decisions.md).
    max_calls: int = 10_000
    memory_mb: int = 4096  # the sandbox's cgroup; each call also has its own address-space limit
    # The calls' directories (their inputs, program, compiler output, what they write there)
    # are a tmpfs of this size: a call dir on the sandbox's overlay cost the runner ~0.15 ms
    # a call more (ext4's journal and truncate per mkdir, unlink, rmdir). Charged to memory_mb.
    call_files_mb: int = 1024
    cpu_cores: float = 1.0
    pids: int = 4096
    preload: list[str] = field(default_factory=list)
    # Calls without a pool name go to the first pool serving their language: a python pool with
    # heavy preloads and a small c/cpp pool on the toolchain image, say.
    languages: list[str] = field(default_factory=lambda: ["python", "bash", "c", "cpp"])


class WorkerLost(Exception):
    """The runner died or stopped answering: the sandbox is replaced."""


class Worker:
    def __init__(self, sandbox_id: str, proc: SandboxProcess, call_uid: int) -> None:
        self.sandbox_id = sandbox_id
        self.proc = proc
        self.call_uid = call_uid
        self.calls = 0
        self.succeeded = False  # its successor was started ahead of max_calls
        self._buffer = bytearray()
        self._stderr = asyncio.create_task(self._drain_stderr())

    async def _drain_stderr(self) -> None:
        # Read, or a chatty runner would block on a full pipe; kept in the edge's log.
        assert self.proc.stderr is not None
        rest = b""
        while chunk := await self.proc.stderr.read(1 << 16):
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                log.warning("fncall runner %s: %s", self.sandbox_id, line.decode(errors="replace").rstrip())
        if rest:
            log.warning("fncall runner %s: %s", self.sandbox_id, rest.decode(errors="replace").rstrip())

    async def ready(self) -> FnRunnerReady:
        line = await self._line(_READY_TIMEOUT_S)
        info = FnRunnerReady.model_validate_json(line)
        if not info.ready:
            raise WorkerLost(f"runner in {self.sandbox_id} did not start: {info.error}")
        return info

    async def call(self, task: FnTask) -> FnResult:
        assert self.proc.stdin is not None
        self.calls += 1
        try:
            self.proc.stdin.write(task.model_dump_json().encode() + b"\n")
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerLost(f"runner in {self.sandbox_id} is gone: {exc}") from exc
        budget = task.run_timeout_s + (task.compile_timeout_s if task.language in ("c", "cpp") else 0)
        line = await self._line(budget + _ANSWER_MARGIN_S)
        try:
            return FnResult.model_validate_json(line)
        except ValidationError as exc:
            raise WorkerLost(f"runner in {self.sandbox_id} answered nonsense: {exc}") from exc

    async def _line(self, timeout: float) -> bytes:
        try:
            return await asyncio.wait_for(self._read_line(), timeout)
        except TimeoutError as exc:
            raise WorkerLost(f"runner in {self.sandbox_id} did not answer within {timeout:g} s") from exc

    async def _read_line(self) -> bytes:
        # Not StreamReader.readline: its 64 KiB line limit is far below a result's size.
        assert self.proc.stdout is not None
        while (end := self._buffer.find(b"\n")) < 0:
            chunk = await self.proc.stdout.read(1 << 20)
            if not chunk:
                raise WorkerLost(f"runner in {self.sandbox_id} exited ({self.proc.returncode})")
            self._buffer += chunk
            if len(self._buffer) > _LINE_LIMIT:
                raise WorkerLost(f"runner in {self.sandbox_id} sent a line over {_LINE_LIMIT} bytes")
        line, self._buffer = bytes(self._buffer[:end]), self._buffer[end + 1 :]
        return line

    async def close(self) -> None:
        _call_uids_in_use.discard(self.call_uid)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        try:
            await asyncio.wait_for(self._stderr, _CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("fncall runner %s: its stderr stayed open after it was stopped", self.sandbox_id)


class FnPool:
    def __init__(self, edge: PoolHost, config: PoolConfig) -> None:
        self.edge = edge
        self.config = config
        # Free workers, and calls waiting for one (oldest first). A freed worker goes straight
        # to the oldest waiter: with an asyncio.Queue a call arriving meanwhile took it first
        # and the woken waiter queued again at the back (p99 at 64 callers was 2x the p50).
        self._idle: collections.deque[Worker] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Worker]] = collections.deque()
        self._workers: dict[str, Worker] = {}
        self._starting: set[asyncio.Task[None]] = set()
        self._retiring: set[asyncio.Task[None]] = set()
        self.closed = False
        self.recycled = 0
        self.error = ""
        # One per pool: its runners then build the same heap page for page, which KSM keeps once
        # (the runner's --mergeable). Every call of a sandbox shares its zygote's seed anyway.
        self._hash_seed = secrets.randbelow(1 << 32)

    # -- filling ------------------------------------------------------------------------------

    def spec(self) -> ContainerSpec:
        c = self.config
        return ContainerSpec.model_validate(
            {
                **({"layers": c.layers} if c.layers else {"image": c.image}),
                "memory_limit_mb": c.memory_mb,
                "cpu_cores_limit": c.cpu_cores,
                "pids_limit": c.pids,
                "tmpfs": {CALL_DIRS: c.call_files_mb},
                "labels": {POOL_LABEL: c.name},
            },
            context={"trusted": True},
        )

    async def start(self) -> None:
        """Fill the pool; returns when every sandbox that could start serves.

        A pool that cannot start at all (its image is missing, say) does not stop the edge: it
        reports why in the node's stats and the node does not offer FnCall for it.
        """
        results = await asyncio.gather(
            *(self._add() for _ in range(self.config.size)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures and len(failures) == len(results):
            self.error = f"could not start: {failures[0]}"
            log.error("fncall pool %s %s", self.config.name, self.error)
            return
        for exc in failures:
            log.warning("fncall pool %s: a sandbox failed to start: %s", self.config.name, exc)
            self._refill()

    async def _add(self) -> None:
        info = await self.edge.create(self.spec())
        call_uid = _take_call_uid()
        try:
            argv = ["python3", RUNNER_IN_SANDBOX, "--workdir", CALL_DIRS]
            argv += ["--uid", str(call_uid), "--gid", str(call_uid)]
            if self.config.preload:
                argv += ["--preload", ",".join(self.config.preload)]
            if self.edge.ksm.running:
                argv += ["--mergeable", str(self._hash_seed)]
            proc = await self.edge.spawn_service(info.id, argv)
        except BaseException:
            _call_uids_in_use.discard(call_uid)
            await self.edge.stop(info.id, reason="fncall runner failed to start")
            raise
        worker = Worker(info.id, proc, call_uid)
        try:
            await worker.ready()
        except BaseException:
            await self.edge.stop(info.id, reason="fncall runner failed to start")
            await worker.close()
            raise
        if self.closed:
            await self._retire(worker, "pool closed")
            return
        self._workers[info.id] = worker
        self._release(worker)

    def _refill(self) -> None:
        if self.closed:
            return

        async def add() -> None:
            try:
                await self._add()
            except Exception as exc:
                log.error("fncall pool %s: could not replace a sandbox: %s", self.config.name, exc)

        task = asyncio.create_task(add())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _retire(self, worker: Worker, reason: str) -> None:
        self._workers.pop(worker.sandbox_id, None)
        # The sandbox first: killing `crun exec` alone leaves the runner inside holding the pipes.
        try:
            await self.edge.stop(worker.sandbox_id, reason=f"fncall: {reason}")
        except Exception as exc:
            log.error("fncall pool %s: could not stop %s: %s", self.config.name, worker.sandbox_id, exc)
        await worker.close()

    async def _recycle(self, worker: Worker, reason: str) -> None:
        self.recycled += 1
        log.info("fncall pool %s: recycling %s (%s)", self.config.name, worker.sandbox_id, reason)
        if not worker.succeeded:
            self._refill()  # before the stop: the pool is whole again sooner
        await self._retire(worker, reason)

    def _recycle_later(self, worker: Worker, reason: str) -> None:
        """Recycle after the call that ended the worker has its answer (a stop takes a while)."""
        self._workers.pop(worker.sandbox_id, None)  # handed to no call from here on
        task = asyncio.create_task(self._recycle(worker, reason))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _succeed_ahead(self, worker: Worker) -> None:
        """Start the successor of a worker nearing ``max_calls`` while it still serves: the
        replacement (seconds, preloads included) then costs the pool no capacity."""
        ahead = max(1, self.config.max_calls // 20)
        if not worker.succeeded and worker.calls >= self.config.max_calls - ahead:
            worker.succeeded = True
            self._refill()

    # -- calls --------------------------------------------------------------------------------

    async def call(self, task: FnTask, *, queue_timeout_s: float = 60.0) -> FnResult:
        for attempt in (1, 2):
            worker = await self._take(queue_timeout_s)
            try:
                result = await worker.call(task)
            except WorkerLost as exc:
                await self._recycle(worker, str(exc))
                if attempt == 2:
                    raise InfraFailure(f"fncall: {exc}", reason=InfraReason.fncall_worker_lost) from exc
                continue
            except BaseException:
                # Cancelled mid-call: the runner may still be busy with it; start afresh.
                await asyncio.shield(self._recycle(worker, "call abandoned"))
                raise
            if not result.clean:
                self._recycle_later(worker, "cleanup could not prove the sandbox clean")
            elif worker.calls >= self.config.max_calls:
                self._recycle_later(worker, f"served {worker.calls} calls")
            else:
                self._succeed_ahead(worker)
                self._release(worker)
            return result
        raise AssertionError("unreachable")

    async def _take(self, timeout: float) -> Worker:
        if self._idle:
            return self._idle.popleft()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Worker] = loop.create_future()
        self._waiters.append(waiter)

        def expire() -> None:
            if not waiter.done():
                waiter.set_exception(TimeoutError())

        expired = loop.call_later(timeout, expire)
        try:
            return await waiter
        except TimeoutError:
            raise CapacityExhausted(
                f"fncall pool {self.config.name!r}: no sandbox free within {timeout:g} s"
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed over as this call was cancelled: pass it on
            raise
        finally:
            expired.cancel()
            if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
                waiter.cancel()  # never handed a worker: still queued
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def _release(self, worker: Worker) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def stats(self) -> dict[str, Any]:
        return {
            "size": self.config.size,
            "ready": len(self._workers),
            "idle": len(self._idle),
            "recycled": self.recycled,
            "languages": self.config.languages,
            **({"error": self.error} if self.error else {}),
        }

    def serves(self, language: str) -> bool:
        return language in self.config.languages and self.serving

    @property
    def serving(self) -> bool:
        return bool(self._workers) or bool(self._starting)

    async def close(self) -> None:
        self.closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, *self._retiring, return_exceptions=True)
        await asyncio.gather(*(self._retire(w, "pool closed") for w in list(self._workers.values())))


def default_pool(size: int) -> PoolConfig:
    """``dsec up``'s pool when no ``--fncall-pools`` names one (and what bench/fncall.py measures)."""
    # numpy preloaded: every HumanEval-style harness imports it (~0.1 s cold per call).
    return PoolConfig(size=size, preload=["numpy"])


def load_pools(text: str) -> list[PoolConfig]:
    """Pool configuration from JSON: a list of objects with :class:`PoolConfig`'s fields."""
    raw = json.loads(text)
    if not isinstance(raw, list):
        raise ValueError("fncall pools: expected a JSON list of pool objects")
    pools = [PoolConfig(**item) for item in raw]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"fncall pools: names must be unique, got {names}")
    for p in pools:
        unknown = set(p.languages) - set(get_args(Language))
        if unknown:
            raise ValueError(f"fncall pool {p.name!r}: unknown languages {sorted(unknown)}")
        if p.size < 0 or p.max_calls < 1 or p.call_files_mb < 1:
            raise ValueError(f"fncall pool {p.name!r}: size must be >= 0, max_calls and call_files_mb >= 1")
    return pools
