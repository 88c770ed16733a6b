"""A lean HTTP/1.1 load generator: open loop (a fixed arrival rate) or closed loop.

Each request is one pre-built byte string on a keep-alive connection, and a response is
taken off the wire by its Content-Length: aiohttp's client spends 2.5x as much CPU per
request (59 vs 23 us, measured here), CPU that the apiserver needs on a 2-core machine. In open loop a
request's latency runs from its *scheduled* send time, so time spent queued for a free
connection counts (no coordinated omission): a server that falls behind shows it in p99.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from _controlplane.procfs import thread_cpu_seconds
from _stats import pct


@dataclass
class Run:
    label: str
    offered: float | None  # arrivals per second; None: closed loop
    duration_s: float
    expected: int  # status code of a success
    sent: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    errors: Counter[str] = field(default_factory=Counter)
    error_sample: str = ""
    started: float = 0.0
    last_done: float = 0.0
    server_cpu_s: float = 0.0  # every thread of every apiserver process
    server_loop_cpu_s: float = 0.0  # their event loop threads only
    client_cpu_s: float = 0.0
    drained: bool = True  # every scheduled request answered before the step's deadline

    @property
    def done(self) -> int:
        return len(self.latencies)

    @property
    def achieved(self) -> float:
        span = self.last_done - self.started
        return self.done / span if span > 0 else 0.0

    def ok(self, p99_limit_s: float, keep_up: float = 0.95) -> bool:
        return (
            self.drained
            and not self.errors
            and (self.offered is None or self.achieved >= keep_up * self.offered)
            and pct(self.latencies, 99) <= p99_limit_s
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "offered_per_s": self.offered,
            "achieved_per_s": self.achieved,
            "requests": self.done,
            "p50_ms": pct(self.latencies, 50) * 1000,
            "p99_ms": pct(self.latencies, 99) * 1000,
            "max_ms": max(self.latencies, default=float("nan")) * 1000,
            "errors": dict(self.errors),
            "error_sample": self.error_sample,
            "drained": self.drained,
            "server_cpu_us_per_request": self.server_cpu_s / self.done * 1e6 if self.done else None,
            "server_loop_cpu_us_per_request": self.server_loop_cpu_s / self.done * 1e6 if self.done else None,
            "client_cpu_us_per_request": self.client_cpu_s / self.done * 1e6 if self.done else None,
        }


class _Conn(asyncio.Protocol):
    def __init__(self, target: _Target) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.need = -1  # bytes of the whole response once its head is in
        self.status = 0
        self.t = 0.0  # when the request in flight was due

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, due: float) -> None:
        assert self.transport is not None
        self.t = due
        self.transport.write(self.target.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            self.status = int(head[9:12])
            at = head.index(b"content-length:") + 15
            eol = head.find(b"\r\n", at)
            self.need = end + 4 + int(head[at : eol if eol >= 0 else len(head)])
        if len(self.buf) >= self.need:
            body, self.buf, self.need = self.buf[: self.need], self.buf[self.need :], -1
            self.target.gen.completed(self, self.status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.target.gen.lost(self)


@dataclass
class _Target:
    gen: LoadGen
    host: str
    port: int
    request: bytes
    conns: list[_Conn] = field(default_factory=list)
    idle: list[_Conn] = field(default_factory=list)
    backlog: deque[float] = field(default_factory=deque)


class LoadGen:
    """``connections`` keep-alive connections spread over the apiservers at ``urls``."""

    def __init__(self, urls: list[str], connections: int) -> None:
        self.urls = urls
        self.connections = connections
        self.targets: list[_Target] = []
        self.run: Run | None = None
        self._closed_until = 0.0  # closed loop: resend on completion until then
        self._idle_event = asyncio.Event()
        self._busy = 0
        self._server_pids: list[int] = []

    async def open(self, requests: list[bytes]) -> None:
        """(Re)connect; every request to ``urls[i]`` is ``requests[i]``."""
        await self.close()
        loop = asyncio.get_running_loop()
        for n, (url, request) in enumerate(zip(self.urls, requests, strict=True)):
            host, port = url.removeprefix("http://").split(":")
            t = _Target(self, host, int(port), request)
            share = self.connections // len(self.urls) + (n < self.connections % len(self.urls))
            for _ in range(share):
                _, conn = await loop.create_connection(lambda t=t: _Conn(t), host, int(port))  # type: ignore[misc]
                t.conns.append(conn)
                t.idle.append(conn)
            self.targets.append(t)

    async def close(self) -> None:
        targets, self.targets = self.targets, []
        for t in targets:
            for c in list(t.conns):
                if c.transport is not None:
                    c.transport.close()
        await asyncio.sleep(0)

    # -- callbacks ------------------------------------------------------------------------------

    def completed(self, conn: _Conn, status: int, response: bytes) -> None:
        now = time.monotonic()
        run = self.run
        if run is not None:
            if status == run.expected:
                run.latencies.append(now - conn.t)
            else:
                run.errors[str(status)] += 1
                run.error_sample = run.error_sample or response[-300:].decode(errors="replace")
            run.last_done = now
        t = conn.target
        if t.backlog:
            conn.send(t.backlog.popleft())
        elif now < self._closed_until:
            conn.send(now)
            if run is not None:
                run.sent += 1
        else:
            t.idle.append(conn)
            self._busy -= 1
            if self._busy == 0:
                self._idle_event.set()

    def lost(self, conn: _Conn) -> None:
        t = conn.target
        if conn in t.conns:
            t.conns.remove(conn)
        if conn in t.idle:
            t.idle.remove(conn)
        elif self._busy > 0:  # it had a request in flight: that request will never be answered
            if self.run is not None:
                self.run.errors["connection lost"] += 1
            self._busy -= 1
            if self._busy == 0:
                self._idle_event.set()

    def _issue(self, t: _Target, due: float) -> None:
        if t.idle:
            self._busy += 1
            self._idle_event.clear()
            t.idle.pop().send(due)
        else:
            t.backlog.append(due)

    # -- runs -----------------------------------------------------------------------------------

    def watch_cpu(self, pids: list[int]) -> None:
        self._server_pids = pids

    def _server_cpu(self) -> tuple[float, float]:
        """(event loop threads, all threads) of every apiserver, in CPU seconds so far."""
        per = [thread_cpu_seconds(p) for p in self._server_pids]
        return sum(m for m, _ in per), sum(m + o for m, o in per)

    def _account(self, run: Run, cpu0: tuple[float, float], client0: float) -> None:
        loop, total = self._server_cpu()
        run.server_loop_cpu_s, run.server_cpu_s = loop - cpu0[0], total - cpu0[1]
        run.client_cpu_s = time.process_time() - client0

    async def _finish(self, run: Run, deadline: float) -> Run:
        try:
            await asyncio.wait_for(self._idle_event.wait(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            run.drained = False
            for t in self.targets:
                run.errors["not sent before the deadline"] += len(t.backlog)
                t.backlog.clear()
            await asyncio.wait_for(self._idle_event.wait(), 60)
        return run

    async def open_loop(self, label: str, rate: float, duration_s: float, expected: int) -> Run:
        n = max(1, round(rate * duration_s))
        run = Run(label, rate, duration_s, expected)
        cpu0, client0 = self._server_cpu(), time.process_time()
        self.run = run
        t0 = time.monotonic() + 0.005
        run.started = t0
        i = 0
        while i < n:
            due = min(n, int((time.monotonic() - t0) * rate) + 1)
            while i < due:
                self._issue(self.targets[i % len(self.targets)], t0 + i / rate)
                i += 1
            if i < n:
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        run.sent = n
        # Generous: a step that cannot finish in twice its length plus 2 s has failed anyway.
        await self._finish(run, t0 + 2 * duration_s + 2.0)
        self.run = None
        self._account(run, cpu0, client0)
        return run

    async def closed_loop(self, label: str, duration_s: float, expected: int) -> Run:
        """Every connection sends its next request as soon as the last one is answered."""
        run = Run(label, None, duration_s, expected)
        cpu0, client0 = self._server_cpu(), time.process_time()
        self.run = run
        now = time.monotonic()
        run.started, self._closed_until = now, now + duration_s
        for t in self.targets:
            for _ in range(len(t.idle)):
                self._issue(t, now)
                run.sent += 1
        await self._finish(run, now + duration_s + 30.0)
        self.run = None
        self._account(run, cpu0, client0)
        return run
