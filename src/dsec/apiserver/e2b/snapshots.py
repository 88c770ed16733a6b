"""E2B's snapshots and fork over DSec's pack (``commit``) and fork.

Routes (what the official SDKs 2.34 and 2.63 call)::

    POST   /sandboxes/{id}/snapshots   {name?, memory?} -> 201 {snapshotID, names}
    GET    /snapshots                  ?sandboxID=&name=&limit=&nextToken= -> [{snapshotID, names}]
    DELETE /templates/{snapshotID}     -> 204 (404: no such snapshot the key may see)
    POST   /sandboxes/{id}/fork        {timeout?, count?} -> 201 [{sandbox} | {error}]

A snapshot is a DSec image (an ordered layer list, :meth:`LayerStore.tag_image`): the source
sandbox's layers plus its changes packed as one more layer, owned by the sandbox's project, so
``Sandbox.create(snapshot_id)`` takes it as a template and a key of another project never sees
it. The packed layer keeps a tag ``e2b-snapshot-pack/<sandbox>:<n>`` while a snapshot names it:
that is where a snapshot's source sandbox is read from. Unnamed snapshots are
``e2b-snapshot/<sandbox>:<n>``; named ones ``<project>/<name>:<tag>`` (E2B's team slug is the
project). DSec packs files only: a sandbox made from a snapshot, and a fork of a container,
cold-boot (no processes, no memory), whatever ``memory`` asks; a fork of a VM copies it whole.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from pydantic import Field

from dsec.apiserver._http import PRINCIPAL, read_body
from dsec.apiserver.e2b.lifecycle import NotSupported, not_found_message
from dsec.apiserver.e2b.models import _In, _Out, error_body
from dsec.apiserver.e2b.snapshot_defaults import SnapshotDefaults, SnapshotDefaultsStore
from dsec.apiserver.layer_access import layer_viewer
from dsec.apiserver.sandboxes import WHOLE_FORK, SandboxRoutes
from dsec.edge.link import EdgeLink
from dsec.iam import Principal
from dsec.images.catalogue import TagRecord
from dsec.images.owners import Viewer
from dsec.images.refs import parse_tag
from dsec.images.store import LayerStore
from dsec.protocol.errors import Conflict, DSecError, InvalidRequest, LayerNotFound, SandboxNotFound
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import (
    RESERVED_LABEL_PREFIX,
    ContainerSpec,
    DeadlineAction,
    SandboxInfo,
    SandboxState,
)

log = logging.getLogger("dsec.apiserver.e2b")
Answer = Callable[[SandboxInfo, int], web.Response]

SNAPSHOT_PREFIX = "e2b-snapshot/"  # unnamed snapshots: e2b-snapshot/<sandbox>:<n>
PACK_PREFIX = "e2b-snapshot-pack/"  # a snapshot's packed changes: e2b-snapshot-pack/<sandbox>:<n>
DEFAULT_TAG = "default"  # E2B's tag of a name given without one
NEXT_TOKEN_HEADER = "X-Next-Token"
MAX_FORKS = 100  # E2B's API caps a fork request at 100 copies
_PAGE = 100  # E2B's default and largest page of snapshots
_ID_SHOWN = 100  # characters of a bad ID quoted back
_CREATE_TIMEOUT_S = 120.0


class SnapshotRequest(_In):
    name: str | None = Field(default=None, min_length=1, max_length=256)
    memory: bool | None = None  # E2B: full (true) or filesystem-only; DSec packs files either way


class ForkBody(_In):
    timeout: int = Field(default=15, ge=0, le=366 * 86400, description="the forks' lifetime, seconds")
    count: int = Field(default=1, ge=1, le=MAX_FORKS)


class SnapshotInfo(_Out):
    snapshot_id: str = Field(alias="snapshotID")
    names: list[str]


def _sandbox_id(raw: str) -> str:
    """A sandbox ID from a path, or not found (as :mod:`.lifecycle` answers one that is no DSec ID)."""
    try:
        return str(SandboxId.parse(raw))
    except InvalidRequest:
        raise SandboxNotFound(not_found_message(raw)) from None


def snapshot_ref(raw: str, project: str | None) -> str:
    """A snapshot's ``name:tag`` from E2B's ``[namespace/]name[:tag]``: no tag is ``default``,
    no namespace is ``project``'s (None: keep it as given). A namespace must be ``project``."""
    name, sep, tag = raw.strip().partition(":")
    if project is not None:
        if "/" not in name:
            name = f"{project}/{name}"
        elif name.rpartition("/")[0] != project:
            raise InvalidRequest(
                f"namespace {name.rpartition('/')[0][:_ID_SHOWN]!r} must be the project {project!r}"
            )
    ref = f"{name}:{tag if sep else DEFAULT_TAG}"
    parse_tag(ref)  # InvalidRequest: not a name DSec can store
    return ref


class SnapshotRoutes:
    def __init__(self, sandboxes: SandboxRoutes, store: LayerStore, answer: Answer) -> None:
        self.sandboxes = sandboxes
        self.store = store
        # The lifecycle's answer for a made sandbox (tokens, domain): a fork's is the same.
        self.answer = answer
        self.defaults = SnapshotDefaultsStore(Path(store.root) / "e2b-snapshots")

    def register(self, r: web.UrlDispatcher) -> None:
        # Before front's 501 catch-alls: DELETE /templates/... is a snapshot's delete; an ID
        # may hold "/" (the 2.34 SDK does not encode it), hence the greedy pattern.
        r.add_post("/sandboxes/{id}/snapshots", self.create)
        r.add_post("/sandboxes/{id}/fork", self.fork)
        r.add_get("/snapshots", self.list)
        r.add_delete("/templates/{id:.+}", self.delete)

    async def _live(self, request: web.Request) -> tuple[EdgeLink, SandboxInfo]:
        _sandbox_id(request.match_info["id"])  # not found before any lookup
        link, sid = await self.sandboxes.owned(request)
        info = await link.get(sid)
        if info.state not in (SandboxState.running, SandboxState.paused):
            raise SandboxNotFound(not_found_message(sid))
        return link, info

    # -- the store's view of snapshots ------------------------------------------------------

    def _snapshots(self, viewer: Viewer) -> list[tuple[TagRecord, set[str]]]:
        """Every snapshot the viewer may see, with its source sandbox: the one its unnamed ID
        names, else every sandbox whose pack gave its last layer (equal packs, e.g. of no
        changes, are one layer)."""
        records = self.store.tags()
        packs = self._packs(records)
        found = []
        for r in records:
            if r.is_layer or r.digests[-1] not in packs or not viewer(r.owner):
                continue
            if r.name.startswith(SNAPSHOT_PREFIX):
                found.append((r, {r.name.removeprefix(SNAPSHOT_PREFIX)}))
            else:
                found.append((r, {parse_tag(p)[0].removeprefix(PACK_PREFIX) for p in packs[r.digests[-1]]}))
        return found

    def _snapshot(self, ref: str, viewer: Viewer) -> TagRecord | None:
        name, version = parse_tag(ref)
        rec = self.store.catalogue.get(name, version)
        if rec is None or rec.is_layer or not viewer(rec.owner):
            return None
        return rec if rec.digests[-1] in self._packs(self.store.tags()) else None

    @staticmethod
    def _packs(records: list[TagRecord]) -> dict[str, list[str]]:
        """Packed layers' digests, each with its ``e2b-snapshot-pack/<sandbox>:<n>`` tags."""
        packs: dict[str, list[str]] = {}
        for r in records:
            if r.is_layer and r.name.startswith(PACK_PREFIX):
                packs.setdefault(r.digests[0], []).append(r.ref)
        return packs

    def _drop_pack(self, digest: str) -> None:
        """Untag a snapshot's packed layer once no snapshot names it (gc takes the blob when no
        sandbox holds it either)."""
        records = self.store.tags()
        if any(not r.is_layer and digest in r.digests for r in records):
            return
        for ref in self._packs(records).get(digest, []):
            with contextlib.suppress(LayerNotFound):
                self.store.untag(ref)

    # -- create -------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        req = await read_body(request, SnapshotRequest)
        link, info = await self._live(request)
        viewer = layer_viewer(request[PRINCIPAL])
        named = None if req.name is None else snapshot_ref(req.name, info.project)
        if named is not None:
            await asyncio.to_thread(self.store.check_name, named, viewer)  # before packing
        paused = info.state is SandboxState.paused
        if paused:
            # E2B snapshots only running sandboxes (404 else); DSec packs a paused one, which the
            # pack needs running: resumed for it, paused again after.
            await link.resume(info.id)
        try:
            spec, layer = await link.fork_spec(info.id, PACK_PREFIX + info.id)
        finally:
            if paused:
                await asyncio.shield(link.pause(info.id))
        pack = next(n for n in layer.names if n.startswith(PACK_PREFIX + info.id + ":"))
        ref = named or f"{SNAPSHOT_PREFIX}{info.id}:{parse_tag(pack)[1]}"
        try:
            await asyncio.to_thread(self._name, ref, list(spec.layers or []), info.project)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self._drop_pack, layer.digest))
            raise
        kept = SnapshotDefaults(pack=layer.digest, user=spec.init_user, workdir=spec.workdir, env=spec.env)
        await self.defaults.put(ref, kept)  # what envd's memory would have brought back
        names = [] if named is None else [ref.rpartition(":")[0]]
        return web.json_response(SnapshotInfo(snapshot_id=ref, names=names).wire(), status=201)

    async def defaults_for(self, refs: list[str]) -> SnapshotDefaults | None:
        """The user, workdir and env a sandbox from snapshot ``refs`` starts with (None: not one
        snapshot, or one made before these were kept)."""
        if len(refs) != 1:
            return None
        try:
            name, version = parse_tag(refs[0])
        except InvalidRequest:
            return None
        kept = await self.defaults.get(f"{name}:{version}")  # in memory: most creates stop here
        if kept is None:
            return None
        rec = self.store.catalogue.get(name, version)
        if rec is None or rec.is_layer or kept.pack != rec.digests[-1]:
            return None  # another content under the name now
        return kept

    def _name(self, ref: str, layers: list[str], owner: str) -> None:
        """Tag the snapshot's layers ``ref``. A name already a snapshot gets the new content
        (E2B assigns a new build to it); a name that is some other layer is not taken over."""
        name, version = parse_tag(ref)
        current = self.store.catalogue.get(name, version)
        if current is None:
            self.store.tag_image(ref, layers, owner=owner)
            return
        if current.is_layer or current.digests[-1] not in self._packs(self.store.tags()):
            raise Conflict(f"{ref} names a layer that is not a snapshot: choose another name")
        self.store.retag(ref, layers, owner=owner)
        self._drop_pack(current.digests[-1])

    # -- list and delete ----------------------------------------------------------------------

    async def list(self, request: web.Request) -> web.Response:
        principal = request[PRINCIPAL]
        limit = _limit(request.query.get("limit"))
        sandbox = request.query.get("sandboxID")
        if sandbox is not None:
            try:
                sandbox = str(SandboxId.parse(sandbox[:_ID_SHOWN]))
            except InvalidRequest:
                raise InvalidRequest("Invalid sandbox ID") from None
        wanted = request.query.get("name")
        found = await asyncio.to_thread(self._snapshots, layer_viewer(principal))
        if sandbox is not None:
            found = [(r, s) for r, s in found if sandbox in s]
        if wanted is not None:
            found = [(r, s) for r, s in found if _name_matches(r, wanted, principal.project)]
        found.sort(key=lambda rs: (rs[0].created_at, rs[0].ref), reverse=True)
        token = request.query.get("nextToken")
        if token:
            cursor = _after_cursor(token)
            found = [(r, s) for r, s in found if (r.created_at, r.ref) < cursor]
        page = found[:limit]
        body = [_info(r).wire() for r, _ in page]
        resp = web.json_response(body)
        if len(found) > limit:
            last = page[-1][0]
            resp.headers[NEXT_TOKEN_HEADER] = base64.urlsafe_b64encode(
                f"{last.created_at!r} {last.ref}".encode()
            ).decode()
        return resp

    async def delete(self, request: web.Request) -> web.Response:
        raw = request.match_info["id"]
        try:
            ref = snapshot_ref(raw, None)
        except InvalidRequest:
            raise InvalidRequest(f"Invalid template ID: {raw[:_ID_SHOWN]!r}") from None
        viewer = layer_viewer(request[PRINCIPAL])
        rec = await asyncio.to_thread(self._snapshot, ref, viewer)
        if rec is None:
            if await asyncio.to_thread(_visible, self.store, ref, viewer):
                raise NotSupported("templates are DSec layers: remove them with `dsec layer rm`")
            raise LayerNotFound(f"snapshot {raw[:_ID_SHOWN]!r} doesn't exist or you don't have access to it")
        await asyncio.to_thread(self.store.untag, ref, viewer=viewer)
        await asyncio.to_thread(self._drop_pack, rec.digests[-1])
        await self.defaults.drop(rec.ref)
        return web.Response(status=204)

    # -- fork ---------------------------------------------------------------------------------

    async def fork(self, request: web.Request) -> web.Response:
        """E2B's fork: ``count`` new sandboxes with the source's state, each made (or failed)
        on its own; the source keeps running. DSec's fork packs the source's files once and
        starts every copy from its layers plus that pack. A VM (microVM or full VM) is forked
        whole, as DSec's own fork does: memory and processes too, on its node, all or none."""
        req = await read_body(request, ForkBody)
        link, source = await self._live(request)
        if source.state is SandboxState.paused:
            raise Conflict(f"Sandbox '{source.id}' is paused and cannot be forked; resume it first")
        principal = request[PRINCIPAL]
        action: DeadlineAction = "pause" if source.on_deadline == "pause" else "stop"
        if source.backend in WHOLE_FORK:
            try:
                made = await self.sandboxes.fork_whole(principal, link, source, req.count, None)
            except DSecError as exc:
                return web.json_response(
                    [{"error": error_body(exc.status, exc.message)}] * req.count, status=201
                )
            finished = (self._finish(info, req.timeout, action) for info in made)
            return web.json_response(list(await asyncio.gather(*finished)), status=201)
        spec, layer = await link.fork_spec(source.id, f"dsec-fork/{source.id}")
        try:
            own = {k: v for k, v in spec.labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)}
            clean = spec.model_copy(update={"labels": own})
            admitted = self.sandboxes.tenancy.admit(principal, source.project, clean)
            results = await asyncio.gather(
                *(self._one_fork(principal, admitted, req.timeout, action) for _ in range(req.count))
            )
        finally:
            # The copies name the pack by digest and hold it mounted (as DSec's own fork does).
            for ref in (n for n in layer.names if n.startswith(f"dsec-fork/{source.id}:")):
                with contextlib.suppress(DSecError):
                    await asyncio.to_thread(self.store.untag, ref)
        return web.json_response(results, status=201)

    async def _stop(self, info: SandboxInfo) -> None:
        await self.sandboxes.link_for(info.id).stop(info.id)
        await self.sandboxes.tenancy.release(info.id)

    async def _one_fork(
        self, principal: Principal, spec: ContainerSpec, timeout: int, action: DeadlineAction
    ) -> dict[str, Any]:
        try:
            [info] = await self.sandboxes.create_many(principal, spec, 1, _CREATE_TIMEOUT_S)
        except DSecError as exc:
            return {"error": error_body(exc.status, exc.message)}
        except Exception as exc:
            log.exception("fork: a copy failed")
            return {"error": error_body(500, f"Error forking sandbox: {type(exc).__name__}")}
        return await self._finish(info, timeout, action)

    async def _finish(self, info: SandboxInfo, timeout: int, action: DeadlineAction) -> dict[str, Any]:
        """A made copy with its deadline (the copy goes if that fails), as E2B answers it."""
        try:
            if timeout > 0:
                try:
                    info = await self.sandboxes.link_for(info.id).set_deadline(info.id, timeout, action)
                except BaseException:
                    await asyncio.shield(self._stop(info))
                    raise
        except DSecError as exc:
            return {"error": error_body(exc.status, exc.message)}
        except Exception as exc:
            log.exception("fork: a copy failed")
            return {"error": error_body(500, f"Error forking sandbox: {type(exc).__name__}")}
        return {"sandbox": json.loads(cast(bytes, self.answer(info, 201).body))}


def _limit(raw: str | None) -> int:
    if raw is None:
        return _PAGE
    try:
        limit = int(raw[:12])
    except ValueError as exc:
        raise InvalidRequest("limit must be an integer") from exc
    if limit < 1:
        raise InvalidRequest("limit must be at least 1")
    return min(limit, _PAGE)  # E2B's API clamps a larger one


def _after_cursor(token: str) -> tuple[float, str]:
    try:
        stamp, _, ref = base64.urlsafe_b64decode(token[:1024].encode()).decode().partition(" ")
        return float(stamp), ref
    except ValueError as exc:
        raise InvalidRequest("Invalid next token") from exc


def _info(rec: TagRecord) -> SnapshotInfo:
    names = [] if rec.name.startswith(SNAPSHOT_PREFIX) else [rec.name]
    return SnapshotInfo(snapshot_id=rec.ref, names=names)


def _name_matches(rec: TagRecord, wanted: str, project: str) -> bool:
    """E2B's ``name`` filter: a snapshot's name or ID, a tag only if one is given."""
    name, sep, tag = wanted.strip().partition(":")
    if sep and tag != rec.version:
        return False
    return name in (rec.name, rec.name.removeprefix(project + "/"))


def _visible(store: LayerStore, ref: str, viewer: Viewer) -> bool:
    try:
        store.resolve_image(ref, viewer=viewer)
    except LayerNotFound:
        return False
    return True
