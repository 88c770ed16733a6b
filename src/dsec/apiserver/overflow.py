"""Overflow: creates go to another DSec cluster when this one is (nearly) full.

An apiserver configured with overflow targets (``dsec apiserver --overflow FILE``; the model is
:class:`OverflowConfig`) sends a create to one of them when the watcher's view of the local
cluster passes ``threshold`` (the busiest of sandbox slots, admitted memory and admitted CPU,
over the healthy nodes) or when placement finds no node. Each target is another cluster's
apiserver URL and an API key of a project there, with a ``weight`` (targets are tried in a
weighted random order) and ``max_sandboxes`` (this apiserver's count there, as of its last
poll, plus what it placed since). As soon as the local view drops below the threshold, creates
come home again; nothing migrates.

The sandbox's ID names its cluster (``sb-<cluster>--<node>-<epoch>-<tag>``,
:mod:`dsec.protocol.ids`), so any apiserver of the home cluster with the same targets routes
every later request to it without a lookup table, through :class:`OverflowLink`. The home
project's quota counts an overflow sandbox like any other: it is reserved before the other
cluster is asked (under a provisional name, bound to the ID the other cluster answers, on the
ledger's node ``<cluster>`` so that quota reconciliation releases what the other cluster reaped).

A fork of an overflow sandbox is made in its cluster (:meth:`Overflow.fork`: the source's
layers and packed state are there), its quota held at home as a create's; a function call no
node here serves goes to a target (:meth:`Overflow.fncall`).

A target that cannot be reached is skipped until a poll reaches it again, so a lost target
costs local creates nothing; a create goes to the next target (or home) only when it never
reached the failed one (:func:`~dsec.apiserver.overflow_link.never_reached_overflow`).

Example file (JSON, or TOML with ``[[targets]]`` tables)::

    {"threshold": 0.8,
     "targets": [{"name": "west", "url": "https://dsec-west.example:8642",
                  "api_key_file": "/etc/dsec/west.key", "weight": 2, "max_sandboxes": 5000}]}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsec.apiserver.overflow_link import OverflowLink, never_reached_overflow
from dsec.apiserver.tenancy import Tenancy
from dsec.edge.link import EdgeLink
from dsec.iam import Principal
from dsec.placement.placement import Placement
from dsec.protocol.errors import (
    CapacityExhausted,
    InfraFailure,
    InvalidRequest,
    QuotaExceeded,
    SandboxNotFound,
)
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.ids import SandboxId, validate_cluster_name
from dsec.protocol.models import RESERVED_LABEL_PREFIX, ContainerSpec, ForkRequest, SandboxInfo

C = TypeVar("C", bound=BaseModel)

log = logging.getLogger("dsec.apiserver.overflow")
_MAX_KEY = 512


class OverflowTarget(BaseModel):
    """One other cluster: where, with which key, how much of the overflow, at most how many."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the cluster's name in sandbox IDs: 1-20 of a-z, 0-9, single '-'")
    url: str = Field(max_length=2048, description="its apiserver (or load balancer), http(s)://")
    api_key: str | None = Field(default=None, min_length=1, max_length=_MAX_KEY)
    api_key_file: Path | None = Field(default=None, description="a file holding the key (preferred)")
    weight: float = Field(default=1.0, gt=0, le=1000, description="share of the overflow it gets")
    max_sandboxes: int = Field(default=1000, ge=1, le=10_000_000, description="at most this many there")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            return validate_cluster_name(v)
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"url {v!r}: give http:// or https://")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _one_key(self) -> OverflowTarget:
        if (self.api_key is None) == (self.api_key_file is None):
            raise ValueError(f"target {self.name!r}: give exactly one of api_key or api_key_file")
        return self

    def key(self) -> str:
        if self.api_key is not None:
            return self.api_key
        assert self.api_key_file is not None
        key = self.api_key_file.read_text().strip()
        if not 0 < len(key) <= _MAX_KEY:
            raise ValueError(f"{self.api_key_file}: expected one API key of 1-{_MAX_KEY} characters")
        return key


class OverflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    targets: list[OverflowTarget] = Field(min_length=1, max_length=64)
    threshold: float = Field(
        default=0.8, gt=0, le=1, description="local utilisation from which creates go to a target"
    )
    poll_interval_s: float = Field(default=2.0, ge=0.05, le=600, description="how often targets are counted")
    connect_timeout_s: float = Field(default=3.0, gt=0, le=60)

    @model_validator(mode="after")
    def _unique(self) -> OverflowConfig:
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise ValueError(f"overflow target names must differ: {names}")
        return self

    @classmethod
    def load(cls, path: Path) -> OverflowConfig:
        return load_config(cls, path)


def load_config(model: type[C], path: Path) -> C:
    """``model`` from a JSON or (``.toml``) TOML file; ``ValueError`` naming what is wrong."""
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        return model.model_validate(raw)
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def utilisation(
    snapshot: Mapping[str, Mapping[str, Any]], busy_on: Callable[[str], int] | None = None
) -> float:
    """The busiest of sandbox slots and admission's shares (memory in use against what the
    node admits up to, and the limits' sums where the operator caps them: the edge's
    ``admitted``) over the healthy nodes; 1.0 when no node is healthy.
    ``busy_on``: a node's sandboxes counting creates placed since the snapshot (placement's)."""
    busy = slots = 0
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, s in snapshot.items():
        if not s.get("healthy") or not s.get("capacity"):
            continue
        busy += busy_on(name) if busy_on else int(s.get("running", 0)) + int(s.get("creating", 0))
        slots += int(s["capacity"])
        admitted = s.get("admitted")
        if isinstance(admitted, Mapping):
            for key, share in admitted.items():
                if isinstance(share, int | float):
                    sums[key] = sums.get(key, 0.0) + float(share)
                    counts[key] = counts.get(key, 0) + 1
    if not slots:
        return 1.0
    # A node's share is already relative to its own size: the cluster's is their mean.
    return max([busy / slots, *(sums[k] / counts[k] for k in sums)])


class Overflow:
    """The targets of one apiserver, their counts, and the decision to use them."""

    def __init__(self, config: OverflowConfig, placement: Placement) -> None:
        self.config = config
        self.placement = placement
        self.targets = {t.name: t for t in config.targets}
        self.overflow_links = {
            t.name: OverflowLink(t.name, t.url, t.key(), connect_timeout=config.connect_timeout_s)
            for t in config.targets
        }
        # The same links as the routes' mapping of links holds them (list, bulk, reconcile).
        self.links: dict[str, EdgeLink] = dict(self.overflow_links)
        self.counts: dict[str, int] = {}  # sandboxes there, as of the last poll
        # Creates sent and not answered yet, and those answered since the last poll's list was
        # asked for (it may not hold them): with ``counts``, what the target holds at most.
        self.sending: Counter[str] = Counter()
        self.made: Counter[str] = Counter()
        self.down: set[str] = set()  # not reached at the last poll or create: skipped
        self._task: asyncio.Task[None] | None = None

    def link(self, cluster: str) -> OverflowLink:
        link = self.overflow_links.get(cluster)
        if link is None:
            raise SandboxNotFound(f"cluster {cluster!r} is not an overflow target of this cluster")
        return link

    def utilisation(self) -> float:
        return utilisation(self.placement.watcher.snapshot, self.placement.busy)

    def over_threshold(self) -> bool:
        return self.utilisation() >= self.config.threshold

    def order(self, *, room: bool = True) -> list[str]:
        """Targets reached at the last poll (with room for a sandbox: ``room``), in a weighted
        random order."""
        names = [
            n
            for n, t in self.targets.items()
            if n not in self.down and (not room or self.held(n) < t.max_sandboxes)
        ]
        ordered: list[str] = []
        while names:
            pick = random.choices(names, weights=[self.targets[n].weight for n in names])[0]
            ordered.append(pick)
            names.remove(pick)
        return ordered

    async def create(
        self, tenancy: Tenancy, principal: Principal, spec: ContainerSpec, timeout: float
    ) -> SandboxInfo | None:
        """A sandbox made by a target, its quota held at home; None when no target took it and
        none may have (each refused, was full or was never reached)."""
        order = self.order()
        if not order:
            return None
        pending = f"overflow-{SandboxId.new_tag()}"  # not an ID: a pending row until bound
        await tenancy.reserve(principal, pending, spec)  # QuotaExceeded: the home quota counts it
        deadline = time.monotonic() + timeout
        try:
            for name in order:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"create timed out after {timeout} s")
                self.sending[name] += 1
                try:
                    info = await self.overflow_links[name].create(spec, timeout=min(left, 3600.0))
                except (CapacityExhausted, QuotaExceeded) as exc:
                    log.info("overflow target %s refused a create: %s", name, exc)
                    continue
                except Exception as exc:
                    if not never_reached_overflow(exc):
                        self.made[name] += 1  # it may run there: counted until a poll says
                        raise  # and a second one elsewhere could make two
                    log.warning("overflow target %s is unreachable: %s", name, exc)
                    self.down.add(name)
                    continue
                finally:
                    self.sending[name] -= 1
                self.made[name] += 1
                await tenancy.iam.bind(pending, info.id, node=name)
                return info
        except BaseException:
            await asyncio.shield(tenancy.release(pending))
            raise
        await tenancy.release(pending)
        return None

    async def fork(
        self,
        tenancy: Tenancy,
        principal: Principal,
        link: OverflowLink,
        source: SandboxInfo,
        req: ForkRequest,
    ) -> list[SandboxInfo]:
        """Copies of ``source`` (an overflow sandbox) made in its own cluster, where its layers
        and the packed state are; their quota held at home as an overflow create's is."""
        name = link.name
        limit = self.targets[name].max_sandboxes
        if self.held(name) + req.count > limit:
            raise CapacityExhausted(
                f"a fork of {req.count} would pass overflow cluster {name!r}'s limit of {limit} sandboxes"
            )
        # Billed as the source's resources, as a whole fork at home is (jobs.py).
        resources = ContainerSpec(
            layers=source.layers,
            memory_limit_mb=source.memory_limit_mb,
            cpu_cores_limit=source.cpu_cores_limit,
        )
        bill = tenancy.admit(principal, source.project, resources)
        own = source.labels if req.labels is None else req.labels
        labels = {k: v for k, v in own.items() if not k.startswith(RESERVED_LABEL_PREFIX)}
        pending = [f"overflow-{SandboxId.new_tag()}" for _ in range(req.count)]
        reserved: list[str] = []
        sent = False
        self.sending[name] += req.count
        try:
            for row in pending:
                await tenancy.reserve(principal, row, bill)  # QuotaExceeded: the home quota counts them
                reserved.append(row)
            sent = True
            made = await link.fork(source.id, req, labels, source.project)
        except BaseException as exc:
            if sent and not never_reached_overflow(exc):
                self.made[name] += req.count  # they may run there: counted until a poll says
            await asyncio.shield(tenancy.release_many(reserved))
            raise
        finally:
            self.sending[name] -= req.count
        self.made[name] += len(made)
        for row, info in zip(pending, made, strict=True):
            await tenancy.iam.bind(row, info.id, node=name)
        return made

    async def fncall(self, task: FnTask, pool: str | None) -> tuple[str, FnResult] | None:
        """A function call run by a target (no node here serves it): the target's name and the
        result; None when each refused it or was never reached. Pool sandboxes are the other
        cluster's nodes' own, so nothing is counted or reserved here."""
        for name in self.order(room=False):
            try:
                return name, await self.overflow_links[name].fncall(task, pool)
            except CapacityExhausted as exc:
                log.info("overflow target %s refused a function call: %s", name, exc)
            except InfraFailure as exc:
                if not never_reached_overflow(exc):
                    raise  # it may have run there: once is what a caller expects
                self.down.add(name)
        return None

    # -- counting ------------------------------------------------------------------------------

    def held(self, name: str) -> int:
        """This apiserver's sandboxes on target ``name`` at most, as far as it knows."""
        return self.counts.get(name, 0) + self.sending[name] + self.made[name]

    async def poll(self) -> None:
        async def count(name: str) -> None:
            made_before = self.made[name]  # answered before the list is asked for: in it
            try:
                ids = await asyncio.wait_for(
                    self.overflow_links[name].sandbox_ids(), self.config.poll_interval_s * 5
                )
            except Exception as exc:
                if name not in self.down:
                    log.warning("overflow target %s is unreachable: %s", name, exc)
                self.down.add(name)
                return
            if name in self.down:
                log.info("overflow target %s answers again", name)
            self.down.discard(name)
            self.counts[name] = len(ids)
            self.made[name] -= made_before

        await asyncio.gather(*(count(n) for n in self.overflow_links))

    async def start(self) -> None:
        await self.poll()
        self._task = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_interval_s)
            try:
                await self.poll()
            except Exception:
                log.exception("counting the overflow targets failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for link in self.overflow_links.values():
            await link.close()
