"""The base class of generated sync classes, and how values cross between sync and async.

:class:`SyncWrapper` holds one async instance plus its portal; :func:`unwrap` and ``_convert``
translate arguments and results at the boundary (sync wrappers in, async objects out, and back,
preserving wrapper identity); ``_invoke`` runs one async call on the portal and converts its
result. Filling a subclass with forwarding methods is done by :mod:`dsec.sdk._sync.builder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, Self

from dsec.sdk._sync.iterators import SyncContextManager, SyncIterator
from dsec.sdk._sync.portal import SyncPortal, default_portal

__all__ = ["PortalSpec", "SyncWrapper", "WrapSpec", "portal_of", "unwrap"]

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
# The base class of every generated sync class
# --------------------------------------------------------------------------------------------


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


class SyncWrapper:
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
            # builder imports this module, so it is imported here, on first use, not at the top.
            from dsec.sdk._sync.builder import _populate

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

    # -- what generated methods call (dsec.sdk._sync.codegen writes them) --------------------------

    def _dsec_construct(self, *args: Any, **kwargs: Any) -> None:
        owner = type(self)
        target = owner._dsec_async_cls
        if target is None:
            raise TypeError(f"{owner.__name__} is not bound to an async class")
        portal = owner._dsec_class_portal()
        _bind(self, portal.run_sync(target, *unwrap(args), **unwrap(kwargs)), portal)

    def _dsec_call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run the async method ``name`` on the portal; the result converted for sync callers."""
        obj = object.__getattribute__(self, "_dsec_async")
        return _invoke(type(self), portal_of(self), getattr(obj, name), args, kwargs)

    def _dsec_get(self, name: str) -> Any:
        obj = object.__getattribute__(self, "_dsec_async")
        return _convert(type(self), getattr(obj, name), portal_of(self))

    def _dsec_set(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_dsec_async"), name, unwrap(value))

    # -- instance plumbing ------------------------------------------------------------------------

    if not typing.TYPE_CHECKING:  # hidden from type checkers: the generated classes are typed

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
            if (
                inspect.ismethod(value)
                or inspect.iscoroutinefunction(value)
                or inspect.isasyncgenfunction(value)
            ):
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
