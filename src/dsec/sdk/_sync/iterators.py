"""Generic blocking wrappers for async iterators and async context managers.

:class:`SyncIterator` and :class:`SyncContextManager` drive the async object through a
:class:`~dsec.sdk._sync.portal.SyncPortal`, one portal call per step. They are what sync callers
get for async iterators and async context managers that are not instances of a wrapped class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Final, Generic, TypeVar

from dsec.sdk._sync.portal import SyncPortal

__all__ = ["SyncContextManager", "SyncIterator"]

T_co = TypeVar("T_co", covariant=True)

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
