"""Sandbox IDs that route themselves.

An ID is ``sb-<node>-<epoch>-<tag>``: the node that owns the sandbox, that node's registration
epoch, and 20 random base32 characters (100 bits) so IDs cannot be guessed. Any apiserver
decodes the owner from the ID alone; no lookup table exists anywhere.

A sandbox a home cluster sent to another DSec cluster (overflow, :mod:`dsec.apiserver.overflow`)
has the other cluster's own ID with ``<cluster>--`` put before its node:
``sb-<cluster>--<node>-<epoch>-<tag>``. The old grammar already reads that as an ID of node
``<cluster>--<node>``, so every validator of either version accepts it; node and cluster names
may not contain ``--``, so the first ``--`` is where the cluster's name ends (a cluster that
overflows further nests: ``sb-a--b--node-1-...``). The node part may be longer than a node
name (40) only by such prefixes, up to 128.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass

from dsec.protocol.errors import InvalidRequest

_NODE_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")
_ID_RE = re.compile(r"^sb-(?P<node>[a-z0-9-]{1,128})-(?P<epoch>[0-9]{1,10})-(?P<tag>[a-z2-7]{20})$")
_NODE_MAX = 40
CLUSTER_SEP = "--"  # between an overflow cluster's name and the node part of its own ID
_CLUSTER_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,18}[a-z0-9])?$")


def validate_node_name(node: str) -> str:
    if not _NODE_RE.fullmatch(node) or CLUSTER_SEP in node:
        raise InvalidRequest(f"invalid node name {node!r}: use 1-40 of a-z, 0-9 and single '-'")
    return node


def _names_clusters(node: str) -> bool:
    """Whether a node part longer than a node name is ``<cluster>--...--<node>``."""
    *clusters, last = node.split(CLUSTER_SEP)
    return bool(clusters) and all(_CLUSTER_RE.fullmatch(c) for c in clusters) and len(last) <= _NODE_MAX


def validate_cluster_name(cluster: str) -> str:
    if not _CLUSTER_RE.fullmatch(cluster) or CLUSTER_SEP in cluster:
        raise InvalidRequest(f"invalid cluster name {cluster!r}: use 1-20 of a-z, 0-9 and single '-'")
    return cluster


@dataclass(frozen=True)
class SandboxId:
    node: str
    epoch: int
    tag: str

    @classmethod
    def new(cls, node: str, epoch: int) -> SandboxId:
        return cls(validate_node_name(node), epoch, cls.new_tag())

    @staticmethod
    def new_tag() -> str:
        # 13 random bytes in base32 (a-z, 2-7) give 20 characters of 5 bits: 100 bits. One
        # urandom call, not 20 secrets.choice calls: 2 us instead of 27 on every create.
        return base64.b32encode(os.urandom(13)).decode()[:20].lower()

    @classmethod
    def parse(cls, text: str) -> SandboxId:
        m = _ID_RE.fullmatch(text)
        if not m or (len(m["node"]) > _NODE_MAX and not _names_clusters(m["node"])):
            raise InvalidRequest(f"malformed sandbox id {text!r}: expected sb-<node>-<epoch>-<tag>")
        return cls(m["node"], int(m["epoch"]), m["tag"])

    def __str__(self) -> str:
        return f"sb-{self.node}-{self.epoch}-{self.tag}"

    @property
    def cluster(self) -> str | None:
        """The overflow cluster the sandbox runs in (None: a node of this cluster)."""
        head, sep, rest = self.node.partition(CLUSTER_SEP)
        return head if sep and head and rest else None

    def in_cluster(self, cluster: str) -> SandboxId:
        """This ID (as cluster ``cluster`` made it) as the home cluster names it."""
        return SandboxId(f"{validate_cluster_name(cluster)}{CLUSTER_SEP}{self.node}", self.epoch, self.tag)

    def within_cluster(self) -> SandboxId:
        """The ID as the overflow cluster that runs the sandbox knows it."""
        if self.cluster is None:
            raise InvalidRequest(f"sandbox id {self} names no overflow cluster")
        return SandboxId(self.node.partition(CLUSTER_SEP)[2], self.epoch, self.tag)
