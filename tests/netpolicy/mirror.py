"""A package mirror in a network namespace of its own (what a permission opens in the tests):
two HTTP servers on one address, one named by a permission, one not; and an upstream name
server there (:mod:`tests.netpolicy.fake_dns`) for the permissions that name domains."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsec.netpolicy.config import EgressConfig, Endpoint, Rule
from dsec.registry.config import Registry

# Concurrent test runs (each with its own DSEC_TEST_DATA_DIR) need addresses of their own: the
# mirror's /24 is net(1), the /24 pools single tests configure beside the session's node net(n).
NETS = os.environ.get("DSEC_TEST_NETS", "10.23{}.0")


def net(n: int) -> str:
    """The tests' n-th /24 (n < 10), as its first three octets."""
    return NETS.format(n)


ADDRESS = f"{net(1)}.2"
HOST_SIDE = f"{net(1)}.1"
# Two public addresses the mirror answers on too (documentation ranges: the firewall counts
# them public), one per concurrent run (its nets differ), for what `public-web` and a
# sandbox's own address rules open or deny.
_HOST = sum(int(octet) for octet in net(1).split(".")[1:]) % 250 + 1
PUBLIC_A, PUBLIC_B = f"203.0.113.{_HOST}", f"198.51.100.{_HOST}"
PORT, OTHER_PORT = 8080, 8081
HTTPS_PORT, HTTP_PORT = 443, 80  # the ports the edge checks by name (TLS server name, HTTP Host)
NAME, OTHER_NAME = "mirror.test", "other.test"
BODY = "served by the mirror\n"

# The upstream zone: names below dns.test are what the "mirror-dns" permission allows.
DNS_NAME, DNS_ALIAS, DNS_REBIND, DNS_OUTSIDE = (
    "web.dns.test",
    "alias.dns.test",
    "rebind.dns.test",
    "web.other-zone.test",
)
DNS_TTL = 5  # the shortest a forwarded answer lives (the forwarder's floor)
ZONE = {
    DNS_NAME: [("A", ADDRESS, DNS_TTL)],
    DNS_ALIAS: [("CNAME", DNS_NAME, 300)],
    DNS_REBIND: [("A", "127.0.0.1", 300)],
    DNS_OUTSIDE: [("A", ADDRESS, 300)],
    "tunnel.dns.test": [("TXT", "secret", 300)],
}
# A public name: no permission names it; a sandbox opens it by its own rules (own domains,
# where the node opens public addresses), served on PUBLIC_A with the same certificate.
PUBLIC_NAME = "web.public.test"
ZONE[PUBLIC_NAME] = [("A", PUBLIC_A, DNS_TTL)]
# The package registries' upstream (tests/registry/fake_registry.py), as the node's registry
# proxy reaches it: by a name its upstream resolver answers.
REGISTRY_NAME, REGISTRY_PORT = "registry.upstream.test", 8090
ZONE[REGISTRY_NAME] = [("A", ADDRESS, 300)]
REGISTRY_URL = f"http://{REGISTRY_NAME}:{REGISTRY_PORT}"


def netns_name() -> str:
    """The mirror's network namespace (one per test process)."""
    return f"dsec-mirror-{os.getpid()}"


# The session node's link pool (a concurrent run names another).
POOL = os.environ.get("DSEC_TEST_EGRESS_POOL", "10.230.0.0/16")


def tls_files() -> tuple[Path, Path]:
    """The HTTPS server's certificate (for DNS_NAME) and key, made once per test data directory:
    the nodes' egress trusts the certificate when it re-encrypts (``upstream_ca``), so it
    exists before any node starts."""
    names = (DNS_NAME, PUBLIC_NAME)
    # Named by what it certifies: a certificate made for fewer names is not taken for this one.
    tag = hashlib.sha256(" ".join(names).encode()).hexdigest()[:8]
    root = Path(os.environ.get("DSEC_TEST_DATA_DIR", "/var/lib/dsec-test")) / f"mirror-tls-{tag}"
    cert, key = root / "cert.pem", root / "key.pem"
    if cert.exists() and key.exists():
        return cert, key
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    req = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650"]
    san = ",".join(f"DNS:{n}" for n in names)
    subject = ["-subj", f"/CN={DNS_NAME}", "-addext", f"subjectAltName={san}"]
    out = ["-keyout", str(tmp / "key.pem"), "-out", str(tmp / "cert.pem")]
    subprocess.run([*req, *subject, *out], check=True, capture_output=True)
    os.replace(tmp / "key.pem", key)  # the key first: a cert present means its key is
    os.replace(tmp / "cert.pem", cert)
    tmp.rmdir()
    return cert, key


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
            # Every public address (what the catalogue's `internet` is; named otherwise so the
            # E2B front's default stays "no internet offered" on the test nodes).
            "public-web": [Rule(public=True)],
            # By name, resolved by the mirror's name server; its answers point at a private
            # address, which the rule names as one its domains may resolve to.
            "mirror-dns": [
                Rule(
                    domains=["*.dns.test"], resolves_to=[f"{ADDRESS}/32"], ports=[PORT, HTTPS_PORT, HTTP_PORT]
                )  # type: ignore[list-item]
            ],
        },
        upstream=[ADDRESS],  # type: ignore[list-item]
        registries={
            "pypi": Registry(kind="pypi", index=f"{REGISTRY_URL}/simple/", port=13141),
            "npm": Registry(kind="npm", index=f"{REGISTRY_URL}/npm/", port=13142),
        },
        grace_s=0,  # an answer's addresses go with its TTL: the expiry test waits for that alone
        upstream_ca=tls_files()[0],
    )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def mirror(root: Path) -> Iterator[None]:
    """The mirror's namespace, link and servers, all removed afterwards (also on failure)."""
    ns, host_if = netns_name(), f"dmir{os.getpid() % 100000}"
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
        for public in (PUBLIC_A, PUBLIC_B):
            _ip("-n", ns, "addr", "add", f"{public}/32", "dev", "eth0")
            _ip("route", "add", f"{public}/32", "via", ADDRESS, "dev", host_if)
        repo = Path(__file__).resolve().parents[2]
        serve_at = [(ADDRESS, port) for port in (PORT, OTHER_PORT, HTTP_PORT)]
        for address, port in [*serve_at, (PUBLIC_A, PORT), (PUBLIC_A, HTTP_PORT), (PUBLIC_B, PORT)]:
            argv = [sys.executable, "-m", "tests.netpolicy.file_server", address, str(port), str(root)]
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=repo,
            )
            servers.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n", f"mirror server on {port} did not start"
        cert, key = tls_files()
        for address in (ADDRESS, PUBLIC_A):  # web.dns.test's, web.public.test's
            tls = [sys.executable, "-m", "tests.netpolicy.file_server", address, str(HTTPS_PORT)]
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *tls, str(root), str(cert), str(key)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # its request log
                cwd=repo,
            )
            servers.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n", "the mirror's HTTPS server did not start"
        dns_argv = [sys.executable, "-m", "tests.netpolicy.fake_dns", ADDRESS, "53", json.dumps(ZONE)]
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *dns_argv], stdout=subprocess.PIPE, cwd=repo)
        servers.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n", "the mirror's name server did not start"
        yield
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        _ip("netns", "del", ns)
