"""The portal: a private asyncio event loop in a daemon thread, for blocking callers.

Every call of the sync facade ends up in :meth:`SyncPortal.call`, which runs a coroutine on the
portal's loop and blocks the calling thread until it is done. The portal also keeps the
identity-preserving table of live sync wrappers (see :mod:`dsec.sdk._sync.wrapper`).
:func:`default_portal` is the process-wide one, closed at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from dsec.sdk._sync.wrapper import SyncWrapper

__all__ = ["SyncPortal", "default_portal"]

T = TypeVar("T")

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
