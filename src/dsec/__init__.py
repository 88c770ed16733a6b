"""DSec: an open sandbox platform for agentic reinforcement learning.

The public surface is small: the SDK clients (``DSecClient`` async, ``DSec`` sync), sandbox
handles, per-backend arguments, and the error tree rooted at ``DSecError`` (documented in
``dsec.protocol.errors``). Everything in a module or package whose name starts with ``_`` or
outside this list may change without notice.
"""

from dsec.protocol.errors import (
    BuildFailed,
    CapacityExhausted,
    CommandTimeout,
    Conflict,
    DSecError,
    FileNotFound,
    Forbidden,
    InfraFailure,
    InvalidRequest,
    LayerNotFound,
    ProcessNotFound,
    QuotaExceeded,
    SandboxNotFound,
    SandboxStopped,
    SecretNotFound,
    SessionLost,
    TooLarge,
    Unauthorized,
    VolumeNotFound,
)
from dsec.protocol.models import CommandResult, FileStat, Hardware, LayerInfo, SandboxInfo, SandboxState
from dsec.sdk import (
    DSec,
    DSecClient,
    DSecContainerRunArgs,
    DSecMicroVMRunArgs,
    DSecVMRunArgs,
    ExecChunk,
    Sandbox,
    SyncSandbox,
)

__all__ = [
    "BuildFailed",
    "CapacityExhausted",
    "CommandResult",
    "CommandTimeout",
    "Conflict",
    "DSec",
    "DSecClient",
    "DSecContainerRunArgs",
    "DSecError",
    "DSecMicroVMRunArgs",
    "DSecVMRunArgs",
    "ExecChunk",
    "FileNotFound",
    "FileStat",
    "Forbidden",
    "Hardware",
    "InfraFailure",
    "InvalidRequest",
    "LayerInfo",
    "LayerNotFound",
    "ProcessNotFound",
    "QuotaExceeded",
    "Sandbox",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxState",
    "SandboxStopped",
    "SecretNotFound",
    "SessionLost",
    "SyncSandbox",
    "TooLarge",
    "Unauthorized",
    "VolumeNotFound",
]
