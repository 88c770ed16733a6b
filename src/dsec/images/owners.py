"""Who may see a layer: ownership by project, visibility by subtree, public layers.

The store knows nothing of API keys: a caller passes a :data:`Viewer`, "may I see what
project P owns?" (the apiserver's is :func:`dsec.iam.can_access` for the request's key: P is
the key's project or below it). ``viewer=None`` is a trusted caller inside the node (the edge
mounting what the apiserver admitted, gc, the base-layer build) and sees everything.

* A tag is visible if its owner is visible to the caller, or it is public. Through a visible
  tag the caller may use every layer it names.
* A blob (by digest or digest prefix) is visible if one of its owners is, or it is public.
  Knowing a digest grants nothing: an invisible digest is "not found", exactly like a
  missing one, so a probe learns nothing about other projects' content.
* The tag namespace is shared (``debian:bookworm`` means one thing to everyone), so a name
  belongs to the owner of its existing versions: another project cannot add a version to
  it, take an existing tag (even with the same content), move or delete it. That a name is
  taken is the one thing a refusal reveals.
* Legacy tags and blobs (stored before owners were recorded) count as the root project's;
  the base layers built by ``dsec base`` are marked public when found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from dsec.images.catalogue import LEGACY_OWNER, Catalogue, TagRecord
from dsec.images.refs import parse_tag
from dsec.protocol.errors import Conflict

if TYPE_CHECKING:
    from dsec.protocol.errors import LayerNotFound
    from dsec.protocol.models import LayerInfo

# "May the caller see what this project owns?"; None: a trusted caller that sees everything.
Viewer = Callable[[str], bool]

__all__ = ["LEGACY_OWNER", "Viewer"]


class _Ownership:
    """LayerStore's ownership checks (the catalogue holds the records)."""

    catalogue: Catalogue

    if TYPE_CHECKING:

        def _not_found(self, ref: str, extra: str = "") -> LayerNotFound: ...
        def _record(self, ref: str) -> TagRecord | None: ...
        def _layer(self, digest: str, ref: str, viewer: Viewer | None = None) -> LayerInfo: ...
        def resolve(self, ref: str, *, viewer: Viewer | None = None) -> LayerInfo: ...

    def sees_tag(self, rec: TagRecord, viewer: Viewer | None) -> bool:
        return viewer is None or rec.public or viewer(rec.owner)

    def sees_blob(self, digest: str, viewer: Viewer | None) -> bool:
        if viewer is None or self.catalogue.is_public(digest):
            return True
        return any(viewer(owner) for owner in self.catalogue.owners(digest) or [LEGACY_OWNER])

    def claim(self, digests: Iterable[str], owner: str) -> None:
        """Record that ``owner`` stored this content (it had the bytes, so it may use them)."""
        for d in dict.fromkeys(digests):
            self.catalogue.add_owner(d, owner)

    def check_name(self, ref: str, viewer: Viewer | None) -> tuple[str, str]:
        """``ref`` parsed, if the caller may create or move it (Conflict: another project's)."""
        name, version = parse_tag(ref)
        if viewer is None:
            return name, version
        for v in self.catalogue.versions(name):
            rec = self.catalogue.get(name, v)
            if rec is not None and not viewer(rec.owner):
                raise Conflict(
                    f"the layer name {name!r} belongs to another project: choose another name"
                    + (" (this version exists)" if v == version else "")
                )
        return name, version

    def check_taken(self, rec: TagRecord, viewer: Viewer | None) -> None:
        """A create found ``rec`` already there with the same content: the caller gets it
        only if it is the caller's (a race past :meth:`check_name`)."""
        if viewer is not None and not viewer(rec.owner):
            raise Conflict(f"{rec.ref} belongs to another project: choose another name")

    def _visible_versions(self, name: str, viewer: Viewer | None) -> list[str]:
        versions = self.catalogue.versions(name)
        if viewer is None:
            return versions
        recs = [self.catalogue.get(name, v) for v in versions]
        return [r.version for r in recs if r is not None and self.sees_tag(r, viewer)]

    def mark_public(self, ref: str) -> list[LayerInfo]:
        """Make a tag (and the layers it names) or a layer by digest visible to every project."""
        rec = self._record(ref)
        if rec is not None:
            self.catalogue.mark_public(rec.name, rec.version)
            digests = list(rec.digests)
        else:
            digests = [self.resolve(ref).digest]
        for d in digests:
            self.catalogue.set_public(d)
        return [self._layer(d, ref) for d in digests]
