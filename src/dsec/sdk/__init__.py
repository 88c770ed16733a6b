"""The DSec SDK: ``DSecClient`` (async, the one implementation) and ``DSec`` (its sync facade,
generated from it by :mod:`dsec.sdk._sync`)."""

from dsec.sdk import client as _aio
from dsec.sdk._sync import SyncWrapper
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs
from dsec.sdk.client import DSecClient, ExecChunk, Sandbox


class SyncSandbox(SyncWrapper, async_cls=_aio.Sandbox):
    """Blocking handle on one sandbox: the methods of :class:`Sandbox`, without ``await``."""


class DSec(SyncWrapper, async_cls=_aio.DSecClient, wrap=[SyncSandbox]):
    """Blocking DSec client: the methods of :class:`DSecClient`, without ``await``."""


__all__ = [
    "DSec",
    "DSecClient",
    "DSecContainerRunArgs",
    "DSecMicroVMRunArgs",
    "DSecVMRunArgs",
    "ExecChunk",
    "Sandbox",
    "SyncSandbox",
]
