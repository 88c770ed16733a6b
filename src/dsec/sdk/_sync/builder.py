"""The sync class builder: fills a :class:`SyncWrapper` subclass from an async class.

``_populate`` walks the async class and installs a blocking counterpart of every public method,
classmethod, staticmethod, property and supported dunder; :func:`syncify` builds such a class
without a ``class`` statement. It runs once per sync class, at class creation.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any, Final

from dsec.sdk._sync.iterators import _DONE, SyncIterator
from dsec.sdk._sync.signatures import _dress
from dsec.sdk._sync.wrapper import (
    PortalSpec,
    SyncWrapper,
    WrapSpec,
    _AttributeProxy,
    _bind,
    _convert,
    _invoke,
    _resolve_wrap,
    portal_of,
    unwrap,
)

__all__ = ["syncify"]

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
