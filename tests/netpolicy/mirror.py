"""A package mirror in a network namespace of its own (what a permission opens in the tests):
two HTTP servers on one address, one named by a permission, one not."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsec.netpolicy.config import EgressConfig, Endpoint

ADDRESS = "10.231.0.2"
HOST_SIDE = "10.231.0.1"
PORT, OTHER_PORT = 8080, 8081
NAME, OTHER_NAME = "mirror.test", "other.test"
BODY = "served by the mirror\n"


# Concurrent test runs (each with its own DSEC_TEST_DATA_DIR) need pools of their own.
POOL = os.environ.get("DSEC_TEST_EGRESS_POOL", "10.230.0.0/16")


def egress_config(pool: str = POOL) -> EgressConfig:
    """Permissions of the test nodes: ``mirror`` and ``other`` open one port each on the mirror;
    ``pypi``/``npm`` name documentation addresses (nothing answers there)."""
    return EgressConfig(
        pool=pool,  # type: ignore[arg-type]
        permissions={
            "mirror": [Endpoint(address=ADDRESS, ports=[PORT], names=[NAME])],  # type: ignore[arg-type]
            "other": [Endpoint(address=ADDRESS, ports=[OTHER_PORT], names=[OTHER_NAME])],  # type: ignore[arg-type]
            "pypi": [Endpoint(address="192.0.2.10", ports=[3141], names=["pypi.test"])],  # type: ignore[arg-type]
            "npm": [Endpoint(address="192.0.2.11", ports=[4873], names=["npm.test"])],  # type: ignore[arg-type]
        },
    )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def mirror(root: Path) -> Iterator[None]:
    """The mirror's namespace, link and servers, all removed afterwards (also on failure)."""
    ns, host_if = f"dsec-mirror-{os.getpid()}", f"dmir{os.getpid() % 100000}"
    (root / "hello.txt").write_text(BODY)
    servers: list[subprocess.Popen[bytes]] = []
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{HOST_SIDE}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        for cmd in ("link set lo up", f"addr add {ADDRESS}/24 dev eth0", "link set eth0 up"):
            _ip("-n", ns, *cmd.split())
        _ip("-n", ns, "route", "add", "default", "via", HOST_SIDE)
        for port in (PORT, OTHER_PORT):
            argv = ["ip", "netns", "exec", ns, "/usr/bin/python3", "-u", "-m", "http.server"]
            proc = subprocess.Popen(
                [*argv, str(port), "--bind", ADDRESS, "--directory", str(root)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            servers.append(proc)
            assert proc.stdout is not None
            # http.server says "Serving HTTP on ..." once it listens.
            assert b"Serving HTTP" in proc.stdout.readline(), f"mirror server on {port} did not start"
        yield
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        _ip("netns", "del", ns)
