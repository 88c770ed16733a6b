"""What the seccomp allowlist costs: system calls and spawns under it, against the deny list it
replaced and against no filter, in one run.

    .venv/bin/python bench/seccomp.py [--rounds 7] [--spawns 100]

A static C program (``sysbench``, built here) times, per call: ``getpid`` (a call the kernel's
seccomp cache answers without running the filter when it is allowed outright), ``ioctl(FIONREAD)``
on a pipe and ``fork`` + ``wait`` (calls with argument rules, which run the whole BPF program),
and ``fork`` + ``execve`` of itself. It runs:
  - on the host, with no filter, with the previous profile (the deny list up to 085d9cd: default
    allow, the same EPERM list, the clone rules, x86/x32 as well) and with the current one, each
    loaded by sysbench itself, the three interleaved ``--rounds`` times (medians reported);
  - in two container sandboxes of a busybox layer, one created under each profile, through
    ``dsec-enter`` with the matching program, where spawning ``true`` is timed too.
The machine is shared and noisy: compare the ratios of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _stats import pct
from dsec.backends.base import CreateContext, User, sandbox_env
from dsec.backends.container import oci, seccomp
from dsec.backends.container.backend import ContainerBackend
from dsec.native import enter
from dsec.protocol.ids import SandboxId
from dsec.protocol.models import ContainerSpec

ROOT = User(name="root", uid=0, gid=0, home="/")

SYSBENCH_C = r"""
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}
int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "exit")) return 0;
    if (argc > 1 && strcmp(argv[1], "-")) {  /* a seccomp program to load first */
        static struct sock_filter prog[4096];
        FILE *f = fopen(argv[1], "rb");
        size_t n = f ? fread(prog, sizeof prog[0], 4096, f) : 0;
        struct sock_fprog p = { (unsigned short)n, prog };
        if (!n || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) ||
            syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &p)) {
            perror("load the program"); return 1;
        }
    }
    int fds[2], v, status;
    long n = 1000000, k = 300;
    double t;
    if (pipe(fds)) return 1;
    t = now(); for (long i = 0; i < n; i++) syscall(SYS_getpid);
    printf("getpid %.1f\n", (now() - t) / n * 1e9);
    t = now(); for (long i = 0; i < n; i++) ioctl(fds[0], FIONREAD, &v);
    printf("ioctl %.1f\n", (now() - t) / n * 1e9);
    t = now();
    for (long i = 0; i < k; i++) { pid_t p = fork(); if (!p) _exit(0); waitpid(p, &status, 0); }
    printf("fork %.1f\n", (now() - t) / k * 1e9);
    t = now();
    for (long i = 0; i < k; i++) {
        pid_t p = fork();
        if (!p) { execl("/proc/self/exe", "sysbench", "exit", (char *)NULL); _exit(127); }
        waitpid(p, &status, 0);
    }
    printf("exec %.1f\n", (now() - t) / k * 1e9);
    return 0;
}
"""


def previous_profile() -> dict[str, Any]:
    """The deny list sandboxes ran under until 085d9cd (default allow)."""
    old_denied = [
        s for s in seccomp.DENIED_SYSCALLS if s not in ("quotactl_fd", "sethostname", "setdomainname")
    ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": old_denied, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            *(
                {
                    "names": ["clone"],
                    "action": "SCMP_ACT_ERRNO",
                    "errnoRet": 1,
                    "args": [{"index": 0, "value": f, "valueTwo": f, "op": "SCMP_CMP_MASKED_EQ"}],
                }
                for f in seccomp.CLONE_NAMESPACE_FLAGS
            ),
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": seccomp.ENOSYS},
        ],
    }


PROFILES = {"previous": previous_profile, "allowlist": seccomp.seccomp_profile}


def run_sysbench(argv: list[str]) -> dict[str, float]:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in (line.split() for line in out.splitlines())}


def summarize(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def show(title: str, results: dict[str, dict[str, float]]) -> None:
    print(title)
    base = results.get("none") or results["previous"]
    for name, r in results.items():
        cells = "  ".join(f"{k} {v:9.1f} ns ({v / base[k]:.2f}x)" for k, v in r.items())
        print(f"    {name:10s} {cells}")


def prepare(scratch: Path) -> tuple[Path, dict[str, Path]]:
    """sysbench, and one dsec-enter with its compiled program per profile (build_helper's layout)."""
    src = scratch / "sysbench.c"
    src.write_text(SYSBENCH_C)
    sysbench = scratch / "sysbench"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(sysbench), str(src)], check=True)
    helper = enter.build_helper(scratch / "data" / "bin")
    helpers: dict[str, Path] = {}
    for name, profile in PROFILES.items():
        rules = seccomp.compiled_rules(profile())
        dump = [str(helper), "--dump-seccomp", "--seccomp-rules", rules]
        prog = subprocess.run(dump, capture_output=True, check=True).stdout
        helpers[name] = scratch / "helpers" / name / helper.name
        helpers[name].parent.mkdir(parents=True)
        shutil.copy2(helper, helpers[name])
        enter.seccomp_program(helpers[name]).write_bytes(prog)
        print(f"{name}: {len(prog) // 8} BPF instructions")
    return sysbench, helpers


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7, help="interleaved runs of sysbench per filter")
    ap.add_argument("--spawns", type=int, default=100, help="spawns of `true` per sandbox")
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dsec-bench-seccomp-"))
    try:
        backend = ContainerBackend(scratch / "data")
        await backend.prepare_node()
        sysbench, helpers = await asyncio.to_thread(prepare, scratch)
        print(f"cores {os.cpu_count()}  rounds {a.rounds}")

        host: dict[str, list[dict[str, float]]] = {"none": [], "previous": [], "allowlist": []}
        for _ in range(a.rounds):
            for name in host:
                bpf = "-" if name == "none" else str(enter.seccomp_program(helpers[name]))
                host[name].append(await asyncio.to_thread(run_sysbench, [str(sysbench), bpf]))
        show(
            "  on the host, the filter loaded by sysbench (median per call)",
            {k: summarize(v) for k, v in host.items()},
        )

        layer = scratch / "layer"
        (layer / "bin").mkdir(parents=True)
        shutil.copy2(shutil.which("busybox") or "/bin/busybox", layer / "bin" / "busybox")
        for applet in ("sh", "true"):
            (layer / "bin" / applet).symlink_to("busybox")
        shutil.copy2(sysbench, layer / "bin" / "sysbench")
        made: list[tuple[CreateContext, dict[str, Any]]] = []
        original = oci.seccomp_profile
        try:
            boxes: dict[str, tuple[CreateContext, dict[str, Any]]] = {}
            for name, profile in PROFILES.items():
                oci.seccomp_profile = profile  # what build_config puts in this sandbox's config
                sid = str(SandboxId.new("bench", 1))
                ctx = CreateContext(
                    sandbox_id=sid,
                    spec=ContainerSpec(layers=["bench:1"], memory_limit_mb=256),
                    layer_dirs=[layer],
                    user=ROOT,
                    workdir=scratch / "sandboxes" / sid,
                )
                handle = await backend.create(ctx)
                made.append((ctx, handle))
                boxes[name] = (ctx, handle)
            oci.seccomp_profile = original

            async def spawn(name: str, argv: list[str]) -> tuple[float, bytes]:
                ctx, handle = boxes[name]
                env = sandbox_env(ctx.spec, ROOT)
                t = time.perf_counter()
                proc = await enter.spawn_entered(
                    ctx.sandbox_id, handle, argv, env=env, cwd="/", user=ROOT, helper=helpers[name]
                )
                out, _ = await proc.communicate()
                assert proc.returncode == 0, (name, argv, proc.returncode)
                return time.perf_counter() - t, out

            inside: dict[str, list[dict[str, float]]] = {"previous": [], "allowlist": []}
            spawns: dict[str, list[float]] = {"previous": [], "allowlist": []}
            for _ in range(a.rounds):
                for name in inside:
                    _, out = await spawn(name, ["sysbench", "-"])
                    lines = out.decode().splitlines()
                    inside[name].append({k: float(v) for k, v in (line.split() for line in lines)})
            for i in range(a.spawns):
                for name in spawns if i % 2 else reversed(spawns):
                    spawns[name].append((await spawn(name, ["true"]))[0])
            show(
                "  in a sandbox, through dsec-enter (median per call)",
                {k: summarize(v) for k, v in inside.items()},
            )
            print("  spawn of `true` through dsec-enter")
            for name, xs in spawns.items():
                p50, p99 = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3
                ratio = pct(xs, 50) / pct(spawns["previous"], 50)
                print(f"    {name:10s} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({ratio:.2f}x)")
        finally:
            oci.seccomp_profile = original
            for ctx, handle in made:
                await backend.destroy(ctx.sandbox_id, handle, ctx.workdir)
            await backend.release_node()  # its parent cgroups (named after its data directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
