"""The sync facade is derived mechanically from async toy classes (see dsec.sdk._sync)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import multiprocessing
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import pytest

from dsec.sdk._sync import (
    SyncContextManager,
    SyncIterator,
    SyncPortal,
    SyncWrapper,
    default_portal,
    portal_of,
    syncify,
    unwrap,
)

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Toy async SDK
# --------------------------------------------------------------------------------------------


class ToyError(Exception):
    pass


class ToyNotFound(ToyError):
    def __init__(self, hid: str) -> None:
        super().__init__(f"no handle {hid}")
        self.hid = hid


RAISED: list[BaseException] = []


class AsyncToyHandle:
    """A handle on one toy sandbox."""

    kind = "toy"

    def __init__(self, client: AsyncToyClient, hid: str) -> None:
        self.client = client
        self.id = hid
        self.loop = asyncio.get_running_loop()  # loop-bound state, must be built on the portal loop
        self.produced = 0
        self.finalized = False
        self.closed = False
        self._label_suffix = ""

    def __repr__(self) -> str:
        return f"AsyncToyHandle({self.id!r})"

    @property
    def label(self) -> str:
        """Human readable label."""
        return f"handle:{self.id}{self._label_suffix}"

    @label.setter
    def label(self, value: str) -> None:
        self._label_suffix = value

    async def echo(self, text: str, *, times: int = 1) -> str:
        """Echo ``text`` back ``times`` times."""
        assert asyncio.get_running_loop() is self.loop
        await asyncio.sleep(0)
        return text * times

    async def slow(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    async def fail(self) -> None:
        """Always raises ToyNotFound."""
        exc = ToyNotFound(self.id)
        RAISED.append(exc)
        raise exc

    async def stream(self, n: int) -> AsyncIterator[bytes]:
        """Yield ``n`` chunks."""
        try:
            for i in range(n):
                self.produced += 1
                await asyncio.sleep(0)
                yield f"chunk{i}".encode()
        finally:
            self.finalized = True

    async def stream_then_fail(self) -> AsyncIterator[int]:
        yield 1
        raise ToyError("mid-stream")

    def describe(self) -> str:
        """A plain (non-async) method."""
        return f"{self.id}@{threading.current_thread().name}"

    async def sibling(self, name: str) -> AsyncToyHandle:
        return await self.client.create(name)

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> AsyncToyHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncEvents:
    """An async iterator class (like a streamed exec): ``async for event in events``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def __aiter__(self) -> AsyncEvents:
        return self

    async def __anext__(self) -> str:
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        await asyncio.sleep(0)
        return f"event{self.i}"

    async def wait(self) -> int:
        return self.n


class AsyncToyClient:
    """Toy async client."""

    DEFAULT_TIMEOUT = 30.0

    def __init__(self, url: str, *, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.handles: dict[str, AsyncToyHandle] = {}
        self.opened = False
        self.closed = False
        self.exit_args: tuple[Any, ...] | None = None

    @classmethod
    async def connect(cls, url: str) -> AsyncToyClient:
        """Build and open a client."""
        client = cls(url)
        return await client.open()

    @staticmethod
    def parse_id(text: str) -> str:
        return text.strip().lower()

    async def open(self) -> AsyncToyClient:
        self.opened = True
        return self

    async def create(self, name: str) -> AsyncToyHandle:
        """Create a handle named ``name``."""
        async with self.lock:
            handle = AsyncToyHandle(self, name)
            self.handles[name] = handle
            return handle

    async def get(self, hid: str) -> AsyncToyHandle:
        try:
            return self.handles[hid]
        except KeyError:
            exc = ToyNotFound(hid)
            RAISED.append(exc)
            raise exc from None

    async def list(self) -> list[AsyncToyHandle]:
        return list(self.handles.values())

    async def pair(self) -> tuple[AsyncToyHandle, str]:
        return await self.create("left"), "right"

    async def by_name(self) -> dict[str, AsyncToyHandle]:
        return dict(self.handles)

    async def watch(self) -> AsyncIterator[AsyncToyHandle]:
        for handle in list(self.handles.values()):
            yield handle

    async def events(self, n: int) -> AsyncEvents:
        return AsyncEvents(n)

    async def raw_iterator(self, n: int) -> AsyncIterator[int]:
        """A coroutine returning an (unregistered) async iterator."""

        async def gen() -> AsyncIterator[int]:
            for i in range(n):
                yield i

        return gen()

    @contextlib.asynccontextmanager
    async def session(self, name: str) -> AsyncIterator[AsyncToyHandle]:
        handle = await self.create(name)
        try:
            yield handle
        finally:
            await handle.close()

    async def kill(self, handle: AsyncToyHandle) -> str:
        assert isinstance(handle, AsyncToyHandle)
        del self.handles[handle.id]
        return handle.id

    async def apply(self, fn: Callable[[], T]) -> T:
        return fn()

    async def close(self) -> None:
        self.closed = True

    async def __aenter__(self) -> AsyncToyClient:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        self.exit_args = exc_info
        await self.close()


# --------------------------------------------------------------------------------------------
# The derived sync SDK: two spellings of the same mechanism
# --------------------------------------------------------------------------------------------

PORTAL = SyncPortal(name="toy-portal")

Events = syncify(AsyncEvents, name="Events", portal=PORTAL)
ToyHandle = syncify(AsyncToyHandle, name="ToyHandle", wrap=lambda: [ToyClient], portal=PORTAL)


class ToyClient(SyncWrapper, async_cls=AsyncToyClient, wrap=[ToyHandle, Events], portal=PORTAL):
    """Blocking toy client."""


@pytest.fixture
def client() -> Iterator[Any]:
    with ToyClient("toy://x", token="t") as c:
        yield c


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_sync_results_equal_async_results(client: Any) -> None:
    async def async_flow() -> list[Any]:
        ac = AsyncToyClient("toy://x", token="t")
        h = await ac.create("a")
        return [
            await h.echo("hi", times=3),
            [c async for c in h.stream(3)],
            [handle.id for handle in await ac.list()],
            h.label,
        ]

    h = client.create("a")
    sync = [h.echo("hi", times=3), list(h.stream(3)), [handle.id for handle in client.list()], h.label]
    assert sync == asyncio.run(async_flow())
    assert sync[0] == "hihihi"


def test_constructor_and_methods_run_on_the_portal_loop(client: Any) -> None:
    inner = unwrap(client)
    assert isinstance(inner, AsyncToyClient)
    assert inner.loop is PORTAL.loop
    assert inner.url == "toy://x" and inner.token == "t"
    assert inner.opened  # __enter__ -> __aenter__ -> open()
    h = client.create("a")
    assert unwrap(h).loop is PORTAL.loop
    assert h.describe() == "a@toy-portal"  # plain methods run on the loop thread too


def test_exceptions_keep_class_and_identity(client: Any) -> None:
    RAISED.clear()
    with pytest.raises(ToyNotFound) as info:
        client.get("nope")
    assert type(info.value) is ToyNotFound
    assert info.value is RAISED[-1]
    assert info.value.hid == "nope"

    h = client.create("a")
    try:
        h.fail()
    except ToyError as exc:  # caught by base class, as in async code
        assert exc is RAISED[-1]
    else:
        pytest.fail("no exception")

    with pytest.raises(TypeError):  # a bad call also surfaces unchanged
        h.echo()


def test_returned_handles_are_sync_wrappers_sharing_the_portal(client: Any) -> None:
    h = client.create("a")
    assert isinstance(h, ToyHandle) and isinstance(h, SyncWrapper)
    assert not isinstance(h, AsyncToyHandle)
    assert isinstance(unwrap(h), AsyncToyHandle)
    assert portal_of(h) is portal_of(client) is PORTAL
    # handle -> new handle, and handle -> its client (lazy wrap spec resolving a cycle)
    s = h.sibling("b")
    assert isinstance(s, ToyHandle) and s.id == "b"
    assert h.client is client  # same async object -> same live sync wrapper
    assert client.get("a") is h


def test_containers_of_handles_are_wrapped(client: Any) -> None:
    client.create("a")
    client.create("b")
    handles = client.list()
    assert type(handles) is list
    assert [type(x) for x in handles] == [ToyHandle, ToyHandle]
    assert [x.id for x in handles] == ["a", "b"]

    left, right = client.pair()
    assert isinstance(left, ToyHandle) and right == "right"

    by_name = client.by_name()
    assert set(by_name) == {"a", "b", "left"}
    assert all(isinstance(v, ToyHandle) for v in by_name.values())


def test_arguments_are_unwrapped(client: Any) -> None:
    h = client.create("a")
    assert client.kill(h) == "a"
    assert [x.id for x in client.list()] == []


def test_async_generator_streams_lazily(client: Any) -> None:
    h = client.create("a")
    inner = unwrap(h)
    it = h.stream(5)
    assert isinstance(it, SyncIterator)
    assert inner.produced == 0  # nothing runs before the first next()
    assert next(it) == b"chunk0"
    assert inner.produced == 1
    assert next(it) == b"chunk1"
    assert inner.produced == 2
    it.close()  # aclose() runs the generator's finally
    assert inner.finalized
    assert inner.produced == 2
    assert list(it) == []


def test_iterator_context_manager_and_errors(client: Any) -> None:
    h = client.create("a")
    with h.stream(10) as it:
        assert next(it) == b"chunk0"
    assert unwrap(h).finalized

    it2 = h.stream_then_fail()
    assert next(it2) == 1
    with pytest.raises(ToyError, match="mid-stream"):
        next(it2)
    assert list(it2) == []


def test_abandoned_iterator_is_finalized_by_the_loop(client: Any) -> None:
    h = client.create("a")
    it = h.stream(10)
    next(it)
    del it
    gc.collect()
    inner = unwrap(h)
    deadline = time.monotonic() + 5
    while not inner.finalized and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner.finalized


def test_iterator_items_and_iterator_classes_are_wrapped(client: Any) -> None:
    client.create("a")
    client.create("b")
    watched = list(client.watch())
    assert [type(x) for x in watched] == [ToyHandle, ToyHandle]
    assert watched == client.list()

    events = client.events(3)  # a coroutine returning a registered async-iterator class
    assert isinstance(events, Events)
    assert list(events) == ["event1", "event2", "event3"]
    assert events.wait() == 3
    assert next(iter(client.events(1))) == "event1"
    one = client.events(1)
    assert next(one) == "event1"  # __anext__ -> __next__
    with pytest.raises(StopIteration):
        next(one)

    raw = client.raw_iterator(4)  # a coroutine returning an unregistered async iterator
    assert isinstance(raw, SyncIterator)
    assert list(raw) == [0, 1, 2, 3]


def test_context_managers_call_async_enter_and_exit() -> None:
    with ToyClient("toy://y") as c:
        inner = unwrap(c)
        assert isinstance(c, ToyClient)
        assert inner.opened and not inner.closed
        with c.create("a") as h:
            assert isinstance(h, ToyHandle)
        assert unwrap(h).closed
    assert inner.closed
    assert inner.exit_args == (None, None, None)

    with pytest.raises(ToyError), ToyClient("toy://z") as c2:
        raise ToyError("boom")
    exit_args = unwrap(c2).exit_args
    assert exit_args is not None and exit_args[0] is ToyError

    cm = c.session("s")  # plain method returning an async context manager
    assert isinstance(cm, SyncContextManager)
    with cm as h2:
        assert isinstance(h2, ToyHandle)
        assert not unwrap(h2).closed
    assert unwrap(h2).closed


def test_constructor_returns_same_wrapper_on_enter() -> None:
    c = ToyClient("toy://x")
    with c as entered:
        assert entered is c
    assert c.open() is c


def test_properties_attributes_and_constants_pass_through(client: Any) -> None:
    h = client.create("a")
    assert h.label == "handle:a"
    h.label = "!"  # property setter on the async instance
    assert h.label == "handle:a!"
    assert h.id == "a"  # instance attribute via __getattr__
    h.id = "renamed"
    assert unwrap(h).id == "renamed"
    assert h.kind == "toy" and ToyHandle.kind == "toy"
    assert ToyClient.DEFAULT_TIMEOUT == 30.0
    assert "echo" in dir(h) and "produced" in dir(h)
    with pytest.raises(AttributeError):
        _ = h.does_not_exist


def test_classmethods_and_staticmethods(client: Any) -> None:
    c = ToyClient.connect("toy://c")
    assert isinstance(c, ToyClient)
    assert unwrap(c).opened and unwrap(c).loop is PORTAL.loop
    assert ToyClient.parse_id("  ABC ") == "abc"
    assert client.parse_id("X") == "x"


def test_signatures_and_docstrings_are_preserved() -> None:
    def params(fn: Any) -> list[tuple[str, Any, Any, Any]]:
        return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]

    for name in ["echo", "fail", "stream", "describe", "sibling", "close"]:
        sync_fn, async_fn = getattr(ToyHandle, name), getattr(AsyncToyHandle, name)
        assert sync_fn.__name__ == name
        assert sync_fn.__doc__ == async_fn.__doc__
        assert params(sync_fn) == params(async_fn)
        assert not inspect.iscoroutinefunction(sync_fn)
        assert not inspect.isasyncgenfunction(sync_fn)

    assert str(inspect.signature(ToyHandle.echo)) == "(self, text: 'str', *, times: 'int' = 1) -> 'str'"
    assert inspect.signature(ToyClient.create).return_annotation == "ToyHandle"
    assert inspect.signature(ToyClient.list).return_annotation == "list[ToyHandle]"
    assert inspect.signature(ToyClient.open).return_annotation == "ToyClient"
    assert inspect.signature(ToyHandle.stream).return_annotation == "Iterator[bytes]"
    assert inspect.signature(ToyClient.watch).return_annotation == "Iterator[ToyHandle]"
    assert inspect.signature(ToyClient.session).return_annotation == "AbstractContextManager[ToyHandle]"
    assert str(inspect.signature(ToyClient)) == "(url: 'str', *, token: 'str | None' = None) -> 'None'"
    assert inspect.signature(ToyClient) == inspect.signature(AsyncToyClient)
    assert str(inspect.signature(ToyClient.connect)) == "(url: 'str') -> 'ToyClient'"
    assert ToyClient.connect.__doc__ == "Build and open a client."
    assert ToyClient.__doc__ == "Blocking toy client."
    assert ToyHandle.__doc__ == AsyncToyHandle.__doc__
    assert ToyHandle.__name__ == "ToyHandle" and ToyHandle.__module__ == __name__
    assert ToyHandle.echo.__qualname__ == "ToyHandle.echo"
    assert "Human readable label." in (inspect.getdoc(ToyHandle.label) or "")


async def test_usable_from_inside_a_running_event_loop() -> None:
    asyncio.get_running_loop()  # this test runs inside pytest-asyncio's loop
    with ToyClient("toy://loop") as c:
        h = c.create("a")
        assert h.echo("x", times=2) == "xx"
        assert list(h.stream(2)) == [b"chunk0", b"chunk1"]
    assert unwrap(c).loop is not asyncio.get_running_loop()


def test_usable_from_a_thread_running_its_own_loop() -> None:
    async def main() -> str:
        with ToyClient("toy://t") as c:
            result: str = c.create("a").echo("y")
            return result

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(asyncio.run, main()).result(timeout=10) == "y"


def test_concurrent_threads_share_one_portal(client: Any) -> None:
    h = client.create("a")
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(h.slow, [0.3] * 8))
    assert results == [0.3] * 8
    assert time.monotonic() - start < 2.0  # the waits overlap on the one loop


def test_blocking_call_from_the_portal_thread_raises_instead_of_deadlocking(client: Any) -> None:
    with pytest.raises(RuntimeError, match="deadlock"):
        client.apply(lambda: client.list())


def test_portal_call_timeout_cancels_the_work() -> None:
    with SyncPortal(name="timeout-portal") as portal:
        started = threading.Event()
        cancelled = threading.Event()

        async def sleeper() -> None:
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(TimeoutError):
            portal.call(sleeper(), timeout=0.1)
        assert started.is_set()
        assert cancelled.wait(5)
        assert portal.call(asyncio.sleep(0, result=42)) == 42


def test_portal_lifecycle() -> None:
    portal = SyncPortal(name="lifecycle-portal")
    assert not portal.closed
    assert not any(t.name == "lifecycle-portal" for t in threading.enumerate())  # lazy
    assert portal.run_sync(lambda: threading.current_thread().name) == "lifecycle-portal"
    thread = next(t for t in threading.enumerate() if t.name == "lifecycle-portal")
    assert thread.daemon

    Client = syncify(AsyncToyClient, name="Client", wrap=[ToyHandle], portal=portal)
    c = Client("toy://p")
    assert portal_of(c) is portal
    portal.close()
    portal.close()  # idempotent
    assert portal.closed
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        c.list()


def test_default_portal_and_with_portal() -> None:
    Client = syncify(AsyncToyClient, name="Client", wrap=[ToyHandle])
    c = Client("toy://d")
    assert portal_of(c) is default_portal()
    assert unwrap(c).loop is default_portal().loop

    with SyncPortal(name="explicit") as portal:
        c2 = Client.with_portal(portal, "toy://e", token="k")
        assert portal_of(c2) is portal and unwrap(c2).token == "k"
        assert unwrap(c2).loop is portal.loop
        h = c2.create("a")
        assert portal_of(h) is portal
        assert Client.from_async(unwrap(c2), portal=portal) is c2
        with pytest.raises(TypeError):
            Client.from_async(object())


def test_hand_written_overrides_are_kept() -> None:
    class Handle(SyncWrapper, async_cls=AsyncToyHandle, portal=PORTAL):
        def describe(self) -> str:
            return "custom"

    with ToyClient("toy://o") as c:
        h = Handle.from_async(unwrap(c.create("a")))
        assert h.describe() == "custom"
        assert h.echo("z") == "z"


def test_name_clash_with_wrapper_helpers_is_reported() -> None:
    class Clashing:
        async def from_async(self) -> None:
            pass

    with pytest.raises(TypeError, match="clashes"):
        syncify(Clashing, name="SyncClashing")


def test_repr() -> None:
    with ToyClient("toy://r") as c:
        h = c.create("a")
        assert repr(h) == "<ToyHandle (sync) AsyncToyHandle('a')>"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_portal_restarts_in_a_forked_child() -> None:
    with ToyClient("toy://parent") as c:
        assert c.create("a").echo("p") == "p"  # the portal thread is running in the parent

        def child(queue: Any) -> None:
            with ToyClient("toy://child") as cc:
                queue.put(cc.create("b").echo("c", times=2))

        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        try:
            assert queue.get(timeout=20) == "cc"
        finally:
            proc.join(20)
        assert proc.exitcode == 0
        assert c.create("c").echo("still") == "still"


@pytest.fixture(scope="module", autouse=True)
def _close_portal() -> Iterator[None]:
    yield
    PORTAL.close()
