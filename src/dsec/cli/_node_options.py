"""Options every command that runs a node shares (``dsec up`` and ``dsec edge``; the log options
``dsec apiserver`` too)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dsec.apiserver.layer_access import LayerLimits
from dsec.cli._common import _fail
from dsec.density.swap import SwapConfig
from dsec.netpolicy.config import EgressConfig
from dsec.observe.logs import LEVELS, configure
from dsec.protocol.errors import DSecError, InvalidRequest

SwapOption = Annotated[
    str,
    typer.Option(
        help="where paused sandboxes' memory goes: none, host (the host's swap), file[:MiB[:PATH]]"
        " (a swap file in the data dir) or zram[:MiB]"
    ),
]


KsmOption = Annotated[
    bool,
    typer.Option(
        help="start the kernel's ksmd if it is stopped, so identical pages of what sandboxes mark"
        " mergeable (VM RAM, FnCall runners) are kept once; stopped again when the node closes empty"
    ),
]


MicroVMOption = Annotated[
    bool, typer.Option(help="also run microVM sandboxes (QEMU; builds the guest kit on first start)")
]
VMOption = Annotated[
    bool, typer.Option(help="also run full VMs with a display (fetches Debian's full kernel once)")
]
AccelOption = Annotated[
    str | None, typer.Option(help="microVM accelerator: kvm or tcg (default: detected once, cached)")
]
AgentChannelOption = Annotated[
    str,
    typer.Option(help="VMs' guest agent channel: auto (vsock where /dev/vhost-vsock works), vsock or serial"),
]

EgressOption = Annotated[
    Path | None,
    typer.Option(
        help="JSON or TOML file of network permissions sandboxes may ask for (permission -> rules:"
        " domains, addresses or CIDR ranges, ports), over DSec's catalogue (pypi, npm, debian, github,"
        " huggingface, crates, go, internet); 'catalogue = false' in it drops the catalogue"
    ),
]


AdmissionOption = Annotated[
    str,
    typer.Option(
        help="admission by use: reserve=MiB (pause the idlest idle sandboxes, then refuse, below this"
        " much available memory), memory=RATIO and cpu=RATIO (cap the running sandboxes' limits at"
        " RATIO x the node), comma-separated; e.g. reserve=1024,memory=8"
    ),
]


DefaultDiskOption = Annotated[
    int,
    typer.Option(
        min=0,
        max=1 << 20,
        help="disk_limit_mb (MiB) of container sandboxes that ask for none, so that no sandbox grows"
        " the node's disk without bound; 0: none (needs btrfs and loop devices to be enforced, else"
        " sandboxes write unbounded)",
    ),
]
LayerLimitsOption = Annotated[
    str,
    typer.Option(
        help="caps on one layer import (413 past any): upload=MiB (the body, default 16384),"
        " expand=MiB (what it unpacks to, default 65536), ratio=N and floor=MiB (the expansion cap"
        " is also max(floor, N x the upload): defaults 100 and 64), comma-separated; e.g. upload=2048"
    ),
]
LogLevelOption = Annotated[
    str, typer.Option(envvar="DSEC_LOG_LEVEL", help=f"lowest level logged: {', '.join(LEVELS)}")
]
LogFormatOption = Annotated[
    str,
    typer.Option(
        envvar="DSEC_LOG_FORMAT",
        help="json (one object a line, each with the request's ID: for a log shipper) or text",
    ),
]
DEFAULT_DISK_LIMIT_MB = 10 * 1024  # a roomy workspace; past it writes fail inside with EDQUOT


def _logs(level: str, fmt: str) -> None:
    """Log as asked (stderr), or stop with the reason before anything starts."""
    if fmt not in ("json", "text"):
        raise _fail(InvalidRequest(f"--log-format {fmt!r}: json or text"))
    try:
        configure(level, "json" if fmt == "json" else "text")
    except DSecError as exc:
        raise _fail(exc) from None


def _admission(text: str) -> dict[str, Any]:
    keys = {"reserve": "memory_reserve_mb", "memory": "memory_overcommit", "cpu": "cpu_overcommit"}
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if key not in keys or number < 0:
            why = f"--admission: {item!r} is not reserve=MiB, memory=RATIO or cpu=RATIO"
            raise _fail(InvalidRequest(why))
        out[keys[key]] = int(number) if key == "reserve" else number
    return out


def _layer_limits(text: str) -> LayerLimits:
    try:
        return LayerLimits.parse(text)
    except DSecError as exc:
        raise _fail(InvalidRequest(f"--layer-limits: {exc.message}")) from None


def _swap(text: str) -> SwapConfig:
    try:
        return SwapConfig.parse(text)
    except DSecError as exc:
        raise _fail(exc) from None


def _egress(path: Path | None) -> EgressConfig:
    try:
        # A node starts from DSec's catalogue of permissions (the file may add, replace or
        # say catalogue = false).
        return EgressConfig.load(path, catalogue=True)
    except DSecError as exc:
        raise _fail(exc) from None
