"""The DSec SDK: ``DSecClient`` (async, the one implementation) and ``DSec`` (its sync facade,
generated from it by :mod:`dsec.sdk._sync`)."""

from dsec.sdk import client as _aio
from dsec.sdk._pty import Pty
from dsec.sdk._sync import SyncWrapper
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs
from dsec.sdk.client import DSecClient, ExecChunk, Sandbox


class SyncPty(SyncWrapper, async_cls=Pty):
    """Blocking handle on a program on a terminal: the methods of :class:`Pty`, without ``await``."""


class SyncSandbox(SyncWrapper, async_cls=_aio.Sandbox, wrap=[SyncPty]):
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
    "Pty",
    "Sandbox",
    "SyncPty",
    "SyncSandbox",
]
