"""The edge's settings, in a module of their own: the edge's parts read them without importing
the edge (so no import cycle runs through :class:`EdgeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dsec.density.swap import SwapConfig
from dsec.edge.fncall.pool import PoolConfig
from dsec.netpolicy.config import EgressConfig


@dataclass
class EdgeConfig:
    data_dir: Path
    node: str = "local"
    max_sandboxes: int = 10_000
    reap_interval_s: float = 1.0
    liveness_interval_s: float = 2.0  # how often the reaper checks that sandboxes still run
    # ...and how many per check (a /proc read each: a node of 8,000 is swept every 32 s).
    liveness_batch: int = 500
    default_shell_timeout_s: float = 600.0
    keep_finished_s: float = 24 * 3600.0
    node_labels: dict[str, str] = field(default_factory=dict)  # what Hardware.node_labels matches
    fncall_pools: list[PoolConfig] = field(default_factory=list)
    swap: SwapConfig = field(default_factory=SwapConfig)  # where paused sandboxes' memory goes
    ksm: bool = True  # run ksmd for what sandboxes mark mergeable (VM RAM, FnCall runners)
    egress: EgressConfig = field(default_factory=EgressConfig)  # what network permissions open
    # Admission (edge/admission.py): caps on the limits of running sandboxes, in node units.
    memory_overcommit: float | None = None
    cpu_overcommit: float | None = None
    memory_reserve_mb: int = 512  # below this MemAvailable, the idlest sandboxes are paused
    # disk_limit_mb of container sandboxes that set none, where the node can enforce one
    # (admission.py); None: theirs is unbounded. `dsec up`/`dsec edge` default to 10 GiB.
    default_disk_limit_mb: int | None = None
    pressure_min_idle_s: float = 30.0  # never paused for room sooner after their last use
    pressure_pauses_per_pass: int = 8
    # How long a caller's pause lets commands under way end before it freezes (edge/pausing.py);
    # those still running then resume with the sandbox. The reaper's pauses do not wait.
    pause_drain_s: float = 10.0

    def workdir(self, sandbox_id: str) -> Path:
        """Where the edge keeps a sandbox's files on the host (its backend's work directory)."""
        return self.data_dir / "sandboxes" / sandbox_id
