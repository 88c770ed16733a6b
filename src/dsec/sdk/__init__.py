"""The DSec SDK: ``DSecClient`` (async, the one implementation) and ``DSec`` (its sync facade,
generated from it by :mod:`dsec.sdk._sync` and written out by ``python -m dsec.sdk._sync.codegen``
into ``_generated_sync.py``, so type checkers see its real signatures)."""

from dsec.sdk._generated_sync import DSec, SyncPty, SyncSandbox
from dsec.sdk._pty import Pty
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs
from dsec.sdk.client import DSecClient, ExecChunk, Sandbox

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
