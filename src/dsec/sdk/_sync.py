"""Derive the blocking (sync) SDK from the async one, mechanically.

The SDK has exactly one implementation, written with ``async``/``await``. Everything here turns
that implementation into a blocking facade without repeating a single method by hand:

* :class:`SyncPortal` owns a private event loop running in a daemon thread (started lazily on
  first use). ``portal.call(coro)`` runs a coroutine on that loop and blocks until it finishes,
  returning its result or raising *the very same exception object* it raised, so
  ``except SandboxNotFound`` works unchanged in sync code.
* :func:`syncify` (or, equivalently, subclassing :class:`SyncWrapper` with ``async_cls=...``)
  builds a sync class from an async class. An instance holds one async instance plus the
  portal, and:

  - every public method becomes a blocking method with the same name, parameters and
    docstring; coroutine results are awaited on the portal;
  - async generator methods, and methods returning async iterators, return a
    :class:`SyncIterator` that pulls one item through the portal per ``next()`` (lazy);
  - ``__aenter__``/``__aexit__`` become ``__enter__``/``__exit__``; ``__aiter__``/``__anext__``
    become ``__iter__``/``__next__``;
  - properties, class constants and instance attributes are forwarded (read in the caller's
    thread); assigning an attribute assigns it on the async instance;
  - return values that are instances of wrapped async classes are wrapped into their sync
    counterparts sharing the same portal, also inside lists, tuples and dict values; other
    async iterators and async context managers are wrapped generically;
  - arguments that are sync wrappers are unwrapped to their async instance before the call;
  - wrapping is identity-preserving: while a sync wrapper is alive, the same async object always
    comes back as the same wrapper (``with DSec() as d`` gives the ``DSec`` you built).

Register every async class that can cross the boundary (``wrap=``): an unregistered object is
returned as is, except that async iterators and async context managers get the generic
:class:`SyncIterator` / :class:`SyncContextManager` (which expose nothing else). A result that
is a coroutine or future is awaited; other awaitable objects are values.

Where the code runs: constructors, methods, classmethods and staticmethods of the async class
always execute *on the portal's loop thread* (so ``asyncio.get_running_loop()``, loop-bound
objects and non-thread-safe asyncio primitives are all fine there). Property getters, plain
attribute reads and simple dunders (``__len__``, ``__eq__``...) run in the caller's thread.
Many threads may share one portal: their calls interleave on its loop.

The facade can be used from any thread, including one that runs its own asyncio loop (the call
then blocks that loop while it waits, as any blocking call would). The only forbidden place is
the portal's own loop thread - e.g. a sync callback invoked by the async code - where a
blocking call would deadlock; that raises :class:`RuntimeError` instead.

Example::

    class Sandbox(SyncWrapper, async_cls=aio.Sandbox):
        "Blocking handle on one sandbox."

    class DSec(SyncWrapper, async_cls=aio.DSecClient, wrap=[Sandbox]):
        "Blocking DSec client."

    # or, without a class statement (the result is then not usable as a static type):
    DSec = syncify(aio.DSecClient, name="DSec", wrap=[Sandbox])

    with DSec(api_key="...") as dsec:
        sandbox = dsec.run_container("python:3.11")  # -> Sandbox (sync)
        for chunk in sandbox.download("/out.tar"):   # lazy, one chunk per portal call
            ...
"""

from __future__ import annotations

import asyncio
import atexit
import collections.abc as cabc
import contextlib
import functools
import inspect
import os
import re
import sys
import threading
import types
import typing
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Final, Generic, Self, TypeVar

__all__ = [
    "PortalSpec",
    "SyncContextManager",
    "SyncIterator",
    "SyncPortal",
    "SyncWrapper",
    "WrapSpec",
    "default_portal",
    "portal_of",
    "syncify",
    "unwrap",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# --------------------------------------------------------------------------------------------
# The portal: a private event loop in a daemon thread
# --------------------------------------------------------------------------------------------


async def _await(aw: Awaitable[T]) -> T:
    return await aw


class SyncPortal:
    """A private asyncio event loop running in a daemon thread, for blocking callers.

    The loop and thread start lazily on the first :meth:`call`. After :meth:`close` the portal
    refuses new work. A portal inherited through ``os.fork()`` transparently starts a fresh
    loop in the child (objects bound to the parent's loop are of course unusable there).
    """

    def __init__(self, *, name: str = "dsec-sync-portal") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._closed = False
        self._wrap_lock = threading.Lock()
        self._wrappers: weakref.WeakValueDictionary[tuple[int, type], SyncWrapper] = (
            weakref.WeakValueDictionary()
        )
        _PORTALS.add(self)

    def _reset_after_fork(self) -> None:
        # In a forked child only the forking thread exists: locks may be held by threads that
        # are gone, and the loop thread is gone. Fresh locks; the loop restarts on next use.
        self._lock = threading.Lock()
        self._wrap_lock = threading.Lock()
        self._wrappers = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._loop is not None else "idle")
        return f"<SyncPortal {self._name!r} {state}>"

    # -- state ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the loop thread died)."""
        return self._closed

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The portal's event loop (starting it if needed)."""
        with self._lock:
            return self._start_locked()

    def in_portal_thread(self) -> bool:
        """True when called from the portal's own loop thread."""
        thread = self._thread
        return thread is not None and self._pid == os.getpid() and thread.ident == threading.get_ident()

    def _start_locked(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        pid = os.getpid()
        if self._loop is not None and self._pid == pid:
            assert self._thread is not None
            if not self._thread.is_alive() and self._thread.ident is not None:
                self._closed = True
                raise RuntimeError(f"{self!r}: its event loop thread has died")
            return self._loop
        # First use, or first use in a forked child: start a fresh loop (the parent's is
        # abandoned, not closed - its thread does not exist in this process).
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._run, args=(loop,), name=self._name, daemon=True)
        if self._pid is not None and self._pid != pid:
            with self._wrap_lock:
                self._wrappers = weakref.WeakValueDictionary()
        self._loop, self._thread, self._pid = loop, thread, pid
        thread.start()
        return loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                _cancel_all_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                with self._lock:
                    self._closed = True

    # -- running things ------------------------------------------------------------------------

    def call(self, aw: Awaitable[T], *, timeout: float | None = None) -> T:
        """Run ``aw`` on the portal loop, block until done, and return its result.

        An exception raised by ``aw`` is re-raised as is (same class, same object). On
        ``timeout`` (seconds) :class:`TimeoutError` is raised and the work is cancelled; if the
        waiting thread is interrupted (``KeyboardInterrupt``) the work is cancelled too.
        Calling this from the portal's own loop thread raises :class:`RuntimeError`, since it
        could only deadlock.
        """
        coro: Coroutine[Any, Any, T] = aw if inspect.iscoroutine(aw) else _await(aw)
        try:
            if self.in_portal_thread():
                raise RuntimeError(
                    "blocking DSec sync API called from its own portal event loop thread (for "
                    "example from a callback run by the async SDK); this would deadlock - use "
                    "the async API there"
                )
            with self._lock:
                loop = self._start_locked()
                future = asyncio.run_coroutine_threadsafe(coro, loop)
        except BaseException:
            coro.close()
            raise
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()  # no-op if the coroutine already finished
            raise

    def run_sync(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Call the plain function ``fn(*args, **kwargs)`` on the portal loop thread.

        It runs inside a task, so ``asyncio.get_running_loop()`` and ``current_task()`` work.
        From the portal thread itself it is simply called directly.
        """
        if self.in_portal_thread():
            return fn(*args, **kwargs)

        async def runner() -> T:
            return fn(*args, **kwargs)

        return self.call(runner())

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop: cancel pending tasks, finalize async generators, join the thread.

        Idempotent. Blocking callers still waiting get ``concurrent.futures.CancelledError``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread, pid = self._loop, self._thread, self._pid
        if loop is None or thread is None or pid != os.getpid():
            return
        if thread.ident == threading.get_ident():
            loop.stop()  # finalization runs once the current callback returns
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    def __enter__(self) -> SyncPortal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


_PORTALS: weakref.WeakSet[SyncPortal] = weakref.WeakSet()
_default_lock = threading.Lock()
_default: SyncPortal | None = None


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    for portal in list(_PORTALS):
        portal._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_portal() -> SyncPortal:
    """The process-wide shared portal (recreated if it was closed); closed at interpreter exit."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = SyncPortal(name="dsec-sync-portal")
        return _default


@atexit.register
def _close_default_portal() -> None:
    with _default_lock:
        portal = _default
    if portal is not None:
        portal.close(timeout=5.0)


# --------------------------------------------------------------------------------------------
# Generic wrappers for async iterators and async context managers
# --------------------------------------------------------------------------------------------

_DONE: Final = object()


def _identity(value: Any) -> Any:
    return value


class SyncIterator(Iterator[T_co]):
    """Blocking iterator over an async iterator (or async iterable), one item per portal call.

    Nothing is pulled ahead: the async side is advanced only when ``next()`` is called. Use it
    as a context manager (or call :meth:`close`) to ``aclose()`` an unfinished async generator
    early; an abandoned one is finalized by the loop when it is garbage collected.
    """

    __slots__ = ("__weakref__", "_convert", "_done", "_iter", "_portal", "_source")

    def __init__(self, source: Any, portal: SyncPortal, convert: Callable[[Any], Any] | None = None) -> None:
        self._source = source
        self._iter: Any = source if hasattr(type(source), "__anext__") else None
        self._portal = portal
        self._convert = convert if convert is not None else _identity
        self._done = False

    def __repr__(self) -> str:
        return f"<SyncIterator over {self._source!r}>"

    def __iter__(self) -> SyncIterator[T_co]:
        return self

    async def _pull(self) -> Any:
        if self._iter is None:
            self._iter = aiter(self._source)
        try:
            return await anext(self._iter)
        except StopAsyncIteration:
            return _DONE

    def __next__(self) -> T_co:
        if self._done:
            raise StopIteration
        item = self._portal.call(self._pull())
        if item is _DONE:
            self._done = True
            raise StopIteration
        result: T_co = self._convert(item)
        return result

    def close(self) -> None:
        """Stop iterating; ``aclose()`` the underlying async generator if it has one."""
        if self._done:
            return
        self._done = True
        target = self._iter if self._iter is not None else self._source
        aclose = getattr(target, "aclose", None)
        if aclose is not None and not self._portal.closed:
            self._portal.call(aclose())

    def __enter__(self) -> SyncIterator[T_co]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SyncContextManager(Generic[T_co]):
    """Blocking context manager over an async one (``__aenter__``/``__aexit__`` via the portal)."""

    __slots__ = ("_acm", "_convert", "_portal")

    def __init__(self, acm: Any, portal: SyncPortal, convert: Callable[[Any], Any] | None = None) -> None:
        self._acm = acm
        self._portal = portal
        self._convert = convert if convert is not None else _identity

    def __repr__(self) -> str:
        return f"<SyncContextManager over {self._acm!r}>"

    def __enter__(self) -> T_co:
        result: T_co = self._convert(self._portal.call(self._acm.__aenter__()))
        return result

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return bool(self._portal.call(self._acm.__aexit__(exc_type, exc, tb)))


# --------------------------------------------------------------------------------------------
# Value conversion between the two worlds
# --------------------------------------------------------------------------------------------

_LEAF_TYPES: Final = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray})


def unwrap(value: Any) -> Any:
    """The async object behind a sync wrapper (recursing into lists, tuples and dict values).

    Anything else is returned unchanged. Arguments of every sync call go through this.
    """
    t = type(value)
    if t in _LEAF_TYPES:
        return value
    if isinstance(value, SyncWrapper):
        return object.__getattribute__(value, "_dsec_async")
    if isinstance(value, SyncIterator):
        return value._source
    if t is list:
        return [unwrap(v) for v in value]
    if t is tuple:
        return tuple(unwrap(v) for v in value)
    if isinstance(value, tuple) and hasattr(t, "_make"):  # namedtuple
        return t._make(unwrap(v) for v in value)
    if t is dict:
        return {k: unwrap(v) for k, v in value.items()}
    return value


def portal_of(wrapper: SyncWrapper) -> SyncPortal:
    """The portal a sync wrapper runs its calls on."""
    portal: SyncPortal = object.__getattribute__(wrapper, "_dsec_portal")
    return portal


def _bind(wrapper: SyncWrapper, obj: Any, portal: SyncPortal) -> None:
    object.__setattr__(wrapper, "_dsec_async", obj)
    object.__setattr__(wrapper, "_dsec_portal", portal)
    with portal._wrap_lock:
        portal._wrappers[(id(obj), type(wrapper))] = wrapper


def _wrap_instance(sync_cls: type[SyncWrapper], obj: Any, portal: SyncPortal) -> SyncWrapper:
    """Wrap ``obj``, reusing the live wrapper of the same object, so identity is preserved."""
    key = (id(obj), sync_cls)
    with portal._wrap_lock:
        existing = portal._wrappers.get(key)
        if existing is not None and object.__getattribute__(existing, "_dsec_async") is obj:
            return existing
        wrapper = sync_cls.__new__(sync_cls)
        object.__setattr__(wrapper, "_dsec_async", obj)
        object.__setattr__(wrapper, "_dsec_portal", portal)
        portal._wrappers[key] = wrapper
        return wrapper


def _convert(sync_cls: type[SyncWrapper], value: Any, portal: SyncPortal) -> Any:
    """Turn a value produced by async code into what sync callers should see."""
    t = type(value)
    if t in _LEAF_TYPES:
        return value
    target = sync_cls._dsec_target_for(t)
    if target is not None:
        return _wrap_instance(target, value, portal)
    if isinstance(value, SyncWrapper | SyncIterator | SyncContextManager):
        return value
    if t is list:
        return [_convert(sync_cls, v, portal) for v in value]
    if t is tuple:
        return tuple(_convert(sync_cls, v, portal) for v in value)
    if isinstance(value, tuple) and hasattr(t, "_make"):  # namedtuple
        return t._make(_convert(sync_cls, v, portal) for v in value)
    if t is dict:
        return {k: _convert(sync_cls, v, portal) for k, v in value.items()}
    if hasattr(t, "__anext__") or hasattr(t, "__aiter__"):
        return SyncIterator(value, portal, functools.partial(_convert, sync_cls, portal=portal))
    if hasattr(t, "__aenter__") and hasattr(t, "__aexit__"):
        return SyncContextManager(value, portal, functools.partial(_convert, sync_cls, portal=portal))
    return value


async def _call_in_loop(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` on the loop thread; await the result if it is a coroutine or future."""
    result = fn(*args, **kwargs)
    if inspect.iscoroutine(result) or asyncio.isfuture(result):
        result = await result
    return result


def _invoke(
    sync_cls: type[SyncWrapper],
    portal: SyncPortal,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    result = portal.call(_call_in_loop(fn, unwrap(args), unwrap(kwargs)))
    return _convert(sync_cls, result, portal)


# --------------------------------------------------------------------------------------------
# Signature translation (for help() and IDEs): same parameters, sync return annotation
# --------------------------------------------------------------------------------------------

_ASYNC_ITER_ORIGINS: Final = (cabc.AsyncIterator, cabc.AsyncIterable, cabc.AsyncGenerator)
_ASYNC_CM_ORIGINS: Final = (contextlib.AbstractAsyncContextManager,)
_AWAITABLE_ORIGINS: Final = (cabc.Awaitable, cabc.Coroutine)
_STR_ITER_RE: Final = re.compile(
    r"(?<![\w.])(?:typing\.|collections\.abc\.|abc\.|t\.)?Async(?:Iterator|Iterable|Generator)\["
)
_STR_CM_RE: Final = re.compile(
    r"(?<![\w.])(?:typing\.|contextlib\.)?(?:AbstractAsyncContextManager|AsyncContextManager)\["
)
_STR_AWAITABLE_RE: Final = re.compile(r"(?<![\w.])(?:typing\.|collections\.abc\.|abc\.|t\.)?Awaitable\[")


def _first_bracket_arg(text: str, start: int) -> tuple[str, int]:
    """Return (first top-level argument, index after the closing bracket) for ``X[...]``."""
    depth, first_end, i = 0, -1, start
    while i < len(text):
        ch = text[i]
        if ch == "[":
            depth += 1
        elif ch == "]":
            if depth == 0:
                if first_end < 0:
                    first_end = i
                return text[start:first_end].strip(), i + 1
            depth -= 1
        elif ch == "," and depth == 0 and first_end < 0:
            first_end = i
        i += 1
    raise ValueError("unbalanced brackets")


def _rewrite_generic(text: str, pattern: re.Pattern[str], new: str | None) -> str:
    """Replace ``AsyncX[A, ...]`` by ``new[A]`` (or bare ``A`` when ``new`` is None)."""
    out, pos = [], 0
    for _ in range(100):
        match = pattern.search(text, pos)
        if match is None:
            break
        arg, end = _first_bracket_arg(text, match.end())
        out.append(text[pos : match.start()])
        out.append(f"{new}[{arg}]" if new is not None else arg)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _translate_str(text: str, names: Mapping[str, str]) -> str:
    try:
        text = _rewrite_generic(text, _STR_ITER_RE, "Iterator")
        text = _rewrite_generic(text, _STR_CM_RE, "AbstractContextManager")
        text = _rewrite_generic(text, _STR_AWAITABLE_RE, None)
    except ValueError:
        return text
    for old, new in names.items():
        text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
    return text


def _translate_annotation(ann: Any, classes: Mapping[type, type], names: Mapping[str, str]) -> Any:
    if ann is inspect.Parameter.empty:
        return ann
    if isinstance(ann, str):
        return _translate_str(ann, names)
    if isinstance(ann, type):
        return classes.get(ann, ann)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is None or not args:
        return ann
    try:
        if origin in _ASYNC_ITER_ORIGINS:
            return Iterator[_translate_annotation(args[0], classes, names)]  # type: ignore[misc]
        if origin in _AWAITABLE_ORIGINS:
            return _translate_annotation(args[-1], classes, names)
        if origin in _ASYNC_CM_ORIGINS:
            return contextlib.AbstractContextManager[  # type: ignore[misc]
                _translate_annotation(args[0], classes, names)
            ]
        new_args = tuple(_translate_annotation(a, classes, names) for a in args)
        if new_args == args:
            return ann
        if origin is typing.Union or origin is types.UnionType:
            return typing.Union[new_args]  # noqa: UP007
        return origin[new_args]
    except Exception:
        return ann


def _sync_signature(
    func: Callable[..., Any],
    classes: Mapping[type, type],
    names: Mapping[str, str],
    *,
    is_init: bool,
    drop_first: bool,
) -> inspect.Signature | None:
    # A function made by @asynccontextmanager reports its generator's signature
    # (-> AsyncIterator[X]); what callers get is a context manager yielding X.
    cm_factory = not inspect.isasyncgenfunction(func) and inspect.isasyncgenfunction(inspect.unwrap(func))
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = [
        p.replace(annotation=_translate_annotation(p.annotation, classes, names))
        for p in sig.parameters.values()
    ]
    if drop_first and params:
        params = params[1:]
    ret = sig.return_annotation if is_init else _translate_annotation(sig.return_annotation, classes, names)
    if cm_factory:
        if isinstance(ret, str) and ret.startswith("Iterator[") and ret.endswith("]"):
            ret = f"AbstractContextManager[{ret[len('Iterator[') : -1]}]"
        elif typing.get_origin(ret) is cabc.Iterator:
            ret = contextlib.AbstractContextManager[typing.get_args(ret)[0]]  # type: ignore[misc]
    return sig.replace(parameters=params, return_annotation=ret)


def _dress(
    wrapper: Callable[..., Any],
    template: Callable[..., Any],
    *,
    owner: type,
    name: str,
    classes: Mapping[type, type],
    names: Mapping[str, str],
    is_init: bool = False,
    drop_first: bool = False,
) -> None:
    """Give ``wrapper`` the name, docstring and (sync-translated) signature of ``template``.

    Deliberately no ``__wrapped__``: tools that unwrap would otherwise find the coroutine
    function and believe the sync method is async.
    """
    wrapper.__doc__ = template.__doc__
    wrapper.__name__ = name
    wrapper.__qualname__ = f"{owner.__qualname__}.{name}"
    wrapper.__module__ = owner.__module__
    sig = _sync_signature(template, classes, names, is_init=is_init, drop_first=drop_first)
    if sig is not None:
        wrapper.__signature__ = sig  # type: ignore[attr-defined]
        annotations = {n: p.annotation for n, p in sig.parameters.items() if p.annotation is not p.empty}
        if sig.return_annotation is not sig.empty:
            annotations["return"] = sig.return_annotation
        wrapper.__annotations__ = annotations


# --------------------------------------------------------------------------------------------
# The sync class builder
# --------------------------------------------------------------------------------------------

_PLAIN_DUNDERS: Final = (
    "__len__",
    "__bool__",
    "__contains__",
    "__getitem__",
    "__str__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
)
_RESERVED: Final = frozenset({"from_async", "with_portal"})


class _AttributeProxy:
    """Class-level stand-in for an async class attribute/property: reads it from the instance
    (caller's thread, result converted), writes go to the async instance."""

    def __init__(self, name: str, doc: str | None) -> None:
        self.name = name
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: SyncWrapper | None, owner: type[SyncWrapper]) -> Any:
        if instance is None:  # class-level access: the proxy for descriptors, else the value
            raw = inspect.getattr_static(owner._dsec_async_cls, self.name)
            return self if hasattr(type(raw), "__get__") and not isinstance(raw, type) else raw
        obj = object.__getattribute__(instance, "_dsec_async")
        return _convert(owner, getattr(obj, self.name), portal_of(instance))

    def __set__(self, instance: SyncWrapper, value: Any) -> None:
        setattr(object.__getattribute__(instance, "_dsec_async"), self.name, unwrap(value))

    def __delete__(self, instance: SyncWrapper) -> None:
        delattr(object.__getattribute__(instance, "_dsec_async"), self.name)


if typing.TYPE_CHECKING:

    class _SyncWrapperMeta(type):
        # Type checkers only: class-level names of a generated class (classmethods, constants)
        # are unknown statically, so let them be Any instead of errors.
        def __getattr__(cls, name: str) -> Any: ...

else:
    _SyncWrapperMeta = type


class SyncWrapper(metaclass=_SyncWrapperMeta):
    """Base of every generated sync class; an instance wraps one async instance and a portal.

    Subclass it with class keywords to derive a sync class in a regular ``class`` statement
    (which also makes it usable as a type annotation); names defined in the class body are kept
    as hand-written overrides::

        class Sandbox(SyncWrapper, async_cls=aio.Sandbox, wrap=..., portal=...):
            "Blocking sandbox handle."

    ``portal`` (a :class:`SyncPortal`, a zero-argument callable returning one, or None for
    :func:`default_portal`) is used by the constructor and classmethods; objects returned by a
    wrapper always share that wrapper's portal.
    """

    __slots__ = ("__weakref__", "_dsec_async", "_dsec_portal")

    _dsec_async_cls: ClassVar[type | None] = None
    _dsec_wrap_spec: ClassVar[Any] = None
    _dsec_portal_spec: ClassVar[Any] = None
    _dsec_wrap_map: ClassVar[dict[type, type[SyncWrapper]] | None] = None
    _dsec_type_cache: ClassVar[dict[type, type[SyncWrapper] | None]] = {}

    if typing.TYPE_CHECKING:
        # Installed at runtime only when the async class has the matching async protocol
        # (__aenter__/__aexit__, __aiter__, __anext__); declared so that `with DSec() as d:` and
        # `for x in wrapper` type-check. Any other attribute is Any through __getattr__.
        def __enter__(self) -> Any: ...
        def __exit__(self, *exc_info: object) -> Any: ...
        def __iter__(self) -> Iterator[Any]: ...
        def __next__(self) -> Any: ...

    def __init_subclass__(
        cls,
        *,
        async_cls: type | None = None,
        wrap: WrapSpec = None,
        portal: PortalSpec = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if async_cls is not None:
            _populate(cls, async_cls, wrap, portal)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is not bound to an async class (use syncify())")

    # -- construction helpers -------------------------------------------------------------------

    @classmethod
    def from_async(cls, obj: Any, *, portal: SyncPortal | None = None) -> Self:
        """Wrap an existing async instance (which must belong to ``portal``'s loop)."""
        async_cls = cls._dsec_async_cls
        if async_cls is None or not isinstance(obj, async_cls):
            raise TypeError(f"{cls.__name__}.from_async() expects a {getattr(async_cls, '__name__', '?')}")
        result = _wrap_instance(cls, obj, portal if portal is not None else cls._dsec_class_portal())
        assert isinstance(result, cls)
        return result

    @classmethod
    def with_portal(cls, portal: SyncPortal, /, *args: Any, **kwargs: Any) -> Self:
        """Construct like ``cls(*args, **kwargs)``, but on an explicit portal."""
        async_cls = cls._dsec_async_cls
        if async_cls is None:
            raise TypeError(f"{cls.__name__} is not bound to an async class")
        obj = portal.run_sync(async_cls, *unwrap(args), **unwrap(kwargs))
        self = cls.__new__(cls)
        _bind(self, obj, portal)
        return self

    @classmethod
    def _dsec_class_portal(cls) -> SyncPortal:
        spec = cls._dsec_portal_spec
        if spec is None:
            return default_portal()
        if isinstance(spec, SyncPortal):
            return spec
        portal = spec()
        if not isinstance(portal, SyncPortal):
            raise TypeError(f"portal factory of {cls.__name__} returned {portal!r}")
        return portal

    @classmethod
    def _dsec_resolved_wrap_map(cls) -> dict[type, type[SyncWrapper]]:
        mapping = cls._dsec_wrap_map
        if mapping is None:
            mapping = _resolve_wrap(cls._dsec_wrap_spec)
            if cls._dsec_async_cls is not None:
                mapping.setdefault(cls._dsec_async_cls, cls)
            cls._dsec_wrap_map = mapping
        return mapping

    @classmethod
    def _dsec_target_for(cls, t: type) -> type[SyncWrapper] | None:
        cache = cls._dsec_type_cache
        try:
            return cache[t]
        except KeyError:
            pass
        mapping = cls._dsec_resolved_wrap_map()
        target = next((mapping[k] for k in t.__mro__ if k in mapping), None)
        cache[t] = target
        return target

    # -- instance plumbing ------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the sync class does not define: instance attributes of the
        # async object, or methods of an async subclass. Methods come back as blocking callables.
        if name.startswith("_dsec_") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        try:
            obj = object.__getattribute__(self, "_dsec_async")
        except AttributeError:
            raise AttributeError(name) from None
        value = getattr(obj, name)
        cls = type(self)
        portal = portal_of(self)
        if inspect.ismethod(value) or inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
            method = value

            @functools.wraps(method)
            def blocking(*args: Any, **kwargs: Any) -> Any:
                return _invoke(cls, portal, method, args, kwargs)

            return blocking
        return _convert(cls, value, portal)

    def __setattr__(self, name: str, value: Any) -> None:
        # Public names are set on the async instance (unless the sync class has a hand-written
        # data descriptor for it); private names on the wrapper itself.
        static = inspect.getattr_static(type(self), name, None)
        own_descriptor = hasattr(type(static), "__set__") and not isinstance(static, _AttributeProxy)
        if name.startswith("_") or own_descriptor:
            object.__setattr__(self, name, value)
        else:
            setattr(object.__getattribute__(self, "_dsec_async"), name, unwrap(value))

    def __dir__(self) -> list[str]:
        names = set(object.__dir__(self))
        with contextlib.suppress(AttributeError):
            names.update(
                n for n in dir(object.__getattribute__(self, "_dsec_async")) if not n.startswith("__")
            )
        return sorted(names)

    def __repr__(self) -> str:
        try:
            inner = repr(object.__getattribute__(self, "_dsec_async"))
        except AttributeError:
            inner = "unbound"
        return f"<{type(self).__name__} (sync) {inner}>"


WrapSpec = (
    Mapping[type, type[SyncWrapper]]
    | Iterable[type[SyncWrapper]]
    | Callable[[], Mapping[type, type[SyncWrapper]] | Iterable[type[SyncWrapper]]]
    | type[SyncWrapper]
    | None
)
"""Which other async classes to wrap in results: ``{AsyncCls: SyncCls}``, an iterable of sync
classes (each knows its async class), a single sync class, or a zero-argument callable returning
one of these (resolved lazily on first use, for classes that refer to each other)."""

PortalSpec = SyncPortal | Callable[[], SyncPortal] | None
"""Which portal a sync class constructs on: a portal, a factory, or None for the default one."""


def _resolve_wrap(spec: WrapSpec) -> dict[type, type[SyncWrapper]]:
    if spec is None:
        return {}
    if isinstance(spec, type):
        spec = [spec]
    elif not isinstance(spec, Mapping) and callable(spec):
        spec = spec()
    mapping: dict[type, type[SyncWrapper]] = {}
    if isinstance(spec, Mapping):
        items: Iterable[tuple[Any, Any]] = spec.items()
    else:
        items = [(getattr(s, "_dsec_async_cls", None), s) for s in spec]
    for async_cls, sync_cls in items:
        if not (isinstance(sync_cls, type) and issubclass(sync_cls, SyncWrapper)) or not isinstance(
            async_cls, type
        ):
            raise TypeError(f"wrap= entries must map async classes to SyncWrapper classes, got {sync_cls!r}")
        mapping[async_cls] = sync_cls
    return mapping


def _make_method(name: str) -> Callable[..., Any]:
    def method(self: SyncWrapper, /, *args: Any, **kwargs: Any) -> Any:
        obj = object.__getattribute__(self, "_dsec_async")
        return _invoke(type(self), portal_of(self), getattr(obj, name), args, kwargs)

    return method


def _make_classlevel(owner: type[SyncWrapper], name: str) -> Callable[..., Any]:
    def method(*args: Any, **kwargs: Any) -> Any:
        fn = getattr(owner._dsec_async_cls, name)
        return _invoke(owner, owner._dsec_class_portal(), fn, args, kwargs)

    return method


def _make_plain_dunder(name: str) -> Callable[..., Any]:
    def dunder(self: SyncWrapper, /, *args: Any) -> Any:
        obj = object.__getattribute__(self, "_dsec_async")
        return _convert(type(self), getattr(obj, name)(*unwrap(args)), portal_of(self))

    return dunder


def _populate(cls: type[SyncWrapper], async_cls: type, wrap: WrapSpec, portal: Any) -> None:
    if not isinstance(async_cls, type):
        raise TypeError(f"async_cls must be a class, got {async_cls!r}")
    cls._dsec_async_cls = async_cls
    cls._dsec_wrap_spec = wrap
    cls._dsec_portal_spec = portal
    cls._dsec_wrap_map = None
    cls._dsec_type_cache = {}

    # Classes known now (for translating annotations); a lazy spec naming classes that do not
    # exist yet is left for later and only affects how signatures are displayed.
    try:
        known: dict[type, type] = dict(_resolve_wrap(wrap))
    except NameError:
        known = {}
    known.setdefault(async_cls, cls)
    names = {a.__name__: s.__name__ for a, s in known.items() if a.__name__ != s.__name__}
    overrides = set(cls.__dict__)

    def dress(wrapper: Callable[..., Any], template: Callable[..., Any], name: str, **kw: Any) -> None:
        _dress(wrapper, template, owner=cls, name=name, classes=known, names=names, **kw)

    seen: set[str] = set()
    for klass in async_cls.__mro__:
        if klass is object:
            continue
        for name, raw in vars(klass).items():
            if name in seen or name.startswith("_"):
                continue
            seen.add(name)
            if name in overrides:
                continue
            if name in _RESERVED:
                raise TypeError(
                    f"{async_cls.__name__}.{name} clashes with SyncWrapper.{name}; "
                    f"define {name} by hand in the sync class body"
                )
            wrapper: Callable[..., Any]
            if isinstance(raw, staticmethod | classmethod):
                func = raw.__func__
                wrapper = _make_classlevel(cls, name)
                dress(wrapper, func, name, drop_first=isinstance(raw, classmethod))
                setattr(cls, name, staticmethod(wrapper))
            elif inspect.isfunction(raw):
                wrapper = _make_method(name)
                dress(wrapper, raw, name)
                setattr(cls, name, wrapper)
            elif isinstance(raw, type) or hasattr(type(raw), "__get__") or not callable(raw):
                # property, cached_property, other descriptors, nested classes, class-level data
                is_descriptor = hasattr(type(raw), "__get__") and not isinstance(raw, type)
                setattr(cls, name, _AttributeProxy(name, raw.__doc__ if is_descriptor else None))
            else:  # some other callable object stored on the class
                wrapper = _make_method(name)
                setattr(cls, name, wrapper)

    if "__init__" not in overrides:

        def __init__(self: SyncWrapper, *args: Any, **kwargs: Any) -> None:
            owner = type(self)
            target = owner._dsec_async_cls
            assert target is not None
            portal = owner._dsec_class_portal()
            _bind(self, portal.run_sync(target, *unwrap(args), **unwrap(kwargs)), portal)

        init_impl = _lookup(async_cls, "__init__")
        dress(
            __init__,
            init_impl if init_impl is not object.__init__ else _no_args_init,
            "__init__",
            is_init=True,
        )
        _install(cls, "__init__", __init__)

    if hasattr(async_cls, "__aenter__") and "__enter__" not in overrides:

        def __enter__(self: SyncWrapper) -> Any:
            obj = object.__getattribute__(self, "_dsec_async")
            return _invoke(type(self), portal_of(self), obj.__aenter__, (), {})

        dress(__enter__, async_cls.__aenter__, "__enter__")
        _install(cls, "__enter__", __enter__)

    if hasattr(async_cls, "__aexit__") and "__exit__" not in overrides:

        def __exit__(self: SyncWrapper, exc_type: Any, exc: Any, tb: Any) -> Any:
            obj = object.__getattribute__(self, "_dsec_async")
            return _invoke(type(self), portal_of(self), obj.__aexit__, (exc_type, exc, tb), {})

        dress(__exit__, async_cls.__aexit__, "__exit__")
        _install(cls, "__exit__", __exit__)

    if hasattr(async_cls, "__aiter__") and "__iter__" not in overrides:

        def __iter__(self: SyncWrapper) -> SyncIterator[Any]:
            owner, portal = type(self), portal_of(self)
            obj = object.__getattribute__(self, "_dsec_async")
            return SyncIterator(obj, portal, functools.partial(_convert, owner, portal=portal))

        dress(__iter__, async_cls.__aiter__, "__iter__")
        _install(cls, "__iter__", __iter__)

    if hasattr(async_cls, "__anext__") and "__next__" not in overrides:

        def __next__(self: SyncWrapper) -> Any:
            owner, portal = type(self), portal_of(self)
            obj = object.__getattribute__(self, "_dsec_async")
            item = portal.call(SyncIterator(obj, portal)._pull())
            if item is _DONE:
                raise StopIteration
            return _convert(owner, item, portal)

        dress(__next__, async_cls.__anext__, "__next__")
        _install(cls, "__next__", __next__)

    for dunder in _PLAIN_DUNDERS:
        impl = getattr(async_cls, dunder, None)
        if impl is None or impl is getattr(object, dunder, None) or dunder in overrides:
            continue
        forward = _make_plain_dunder(dunder)
        dress(forward, impl, dunder)
        setattr(cls, dunder, forward)

    if _lookup(async_cls, "__eq__") is not object.__eq__ and "__eq__" not in overrides:

        def __eq__(self: SyncWrapper, other: object) -> bool:
            result: bool = object.__getattribute__(self, "_dsec_async") == unwrap(other)
            return result

        _install(cls, "__eq__", __eq__)
        if "__hash__" not in overrides:
            if _lookup(async_cls, "__hash__") is None:
                _install(cls, "__hash__", None)
            else:

                def __hash__(self: SyncWrapper) -> int:
                    return hash(object.__getattribute__(self, "_dsec_async"))

                _install(cls, "__hash__", __hash__)

    if not cls.__dict__.get("__doc__"):
        cls.__doc__ = async_cls.__doc__


def _no_args_init(self: Any) -> None:
    pass


def _lookup(cls: type, name: str) -> Any:
    return getattr(cls, name, None)


def _install(cls: type, name: str, value: object) -> None:
    setattr(cls, name, value)


def syncify(
    async_cls: type,
    *,
    name: str,
    wrap: WrapSpec = None,
    portal: PortalSpec = None,
    module: str | None = None,
    doc: str | None = None,
) -> type[SyncWrapper]:
    """Build the blocking counterpart of ``async_cls``, named ``name``.

    ``wrap`` says which other async classes, when returned (also inside lists, tuples and dict
    values, and as items of async iterators), are wrapped into which sync classes; instances
    of ``async_cls`` itself are always wrapped into the new class. ``portal`` chooses the portal
    used by the constructor and classmethods (default: :func:`default_portal`). ``module``
    defaults to the caller's module; ``doc`` to ``async_cls.__doc__``.

    This is the same as ``class <name>(SyncWrapper, async_cls=..., wrap=..., portal=...)``;
    prefer the class statement when the result must be usable as a type annotation.
    """
    if module is None:
        module = sys._getframe(1).f_globals.get("__name__", __name__)

    def body(ns: dict[str, Any]) -> None:
        ns["__module__"] = module
        ns["__qualname__"] = name
        ns["__slots__"] = ()
        if doc is not None:
            ns["__doc__"] = doc

    kwds = {"async_cls": async_cls, "wrap": wrap, "portal": portal}
    cls = types.new_class(name, (SyncWrapper,), kwds, body)
    assert issubclass(cls, SyncWrapper)
    return cls
