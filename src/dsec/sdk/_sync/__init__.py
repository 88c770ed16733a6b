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

Layout: :mod:`~dsec.sdk._sync.portal` (the loop thread), :mod:`~dsec.sdk._sync.iterators`
(generic iterator / context manager wrappers), :mod:`~dsec.sdk._sync.wrapper` (the
:class:`SyncWrapper` base and value conversion), :mod:`~dsec.sdk._sync.signatures` (sync
signatures for ``help()``) and :mod:`~dsec.sdk._sync.builder` (filling a sync class,
:func:`syncify`). Import from this package, not from those modules.
"""

from dsec.sdk._sync.builder import syncify
from dsec.sdk._sync.iterators import SyncContextManager, SyncIterator
from dsec.sdk._sync.portal import SyncPortal, default_portal
from dsec.sdk._sync.wrapper import PortalSpec, SyncWrapper, WrapSpec, portal_of, unwrap

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
