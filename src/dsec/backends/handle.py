"""What a backend keeps about a running sandbox: the typed handle the edge journals.

Each backend has its own model (``ContainerHandle``, ``MicroVmHandle``, ``VmHandle``,
``FakeHandle``) on this base. On disk a handle is the JSON object it always was: the keys a
backend set, and no others (:meth:`Handle.dump`), so a journal written by an earlier release
reads back (:meth:`Handle.of`) and re-adopts its sandboxes, and one written now is what that
release wrote. Keys a model does not declare (a later release's) are kept, not dropped, so a
record survives being rewritten by an older edge.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict


class Handle(BaseModel):
    """The handle of a sandbox whose backend is not known here (or of none: an orphan's)."""

    model_config = ConfigDict(extra="allow")

    pid: int = 0  # the process whose life is the sandbox's (its init, sentry or QEMU); 0: none
    start_time: int | None = None  # that PID's start time: a reused PID is not the sandbox

    @classmethod
    def of(cls, handle: Handle | dict[str, Any]) -> Self:
        """``handle`` as this backend's model: itself when it is one already (a backend may
        change it in place, and the edge journals that object), else read from its JSON (a
        journaled handle, or an empty one for a sandbox the edge has no record of)."""
        if isinstance(handle, cls):
            return handle
        raw = handle.dump() if isinstance(handle, Handle) else handle
        return cls.model_validate(raw)

    def dump(self) -> dict[str, Any]:
        """The JSON the journal stores: the keys that were set, as earlier releases wrote them."""
        return self.model_dump(mode="json", exclude_unset=True)

    def drop(self, *names: str) -> None:
        """Remove ``names`` as a dict's ``pop`` did: back to their defaults and out of :meth:`dump`."""
        defaults = type(self).model_fields
        for name in names:
            setattr(self, name, defaults[name].default)
            self.__pydantic_fields_set__.discard(name)

    def image_in_use(self) -> str | None:
        """The digest of an imported disk image the sandbox boots from, which layer garbage
        collection must keep while it lives (full VMs); None for the others."""
        return None

    def disk_limit(self) -> int | None:
        """The disk limit the backend enforces on the sandbox's writes, in MiB; None: none."""
        return None


class ForkSource(BaseModel):
    """What :meth:`~dsec.backends.base.Forkable.fork_source` saved for its copies to start from
    (each forkable backend's own model); lives only while the fork does, never journaled."""
