"""Signature translation for the generated sync methods (for ``help()`` and IDEs).

A sync method keeps the name, docstring and parameters of its async original; its annotations
are rewritten to what the sync caller sees (``AsyncIterator[X]`` becomes ``Iterator[X]``,
``Awaitable[X]`` becomes ``X``, wrapped async classes become their sync counterparts).
Display only: nothing here changes what a call does.
"""

from __future__ import annotations

import collections.abc as cabc
import contextlib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

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
