"""The registry proxy against an upstream served over HTTPS, on the real kernel: the fake
registry in the mirror's namespace with a certificate from a test authority the node is told
to trust (``registry_cache.ca_file``); real pip in a sandbox installs through the proxy, and an
upstream whose certificate names another host is refused with a 502 that says why."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from dsec import DSecClient, DSecContainerRunArgs
from dsec.netpolicy.config import EgressConfig
from dsec.node.embedded import EmbeddedNode
from dsec.registry.config import CacheConfig, Registry
from dsec.sdk.client import Sandbox
from tests.conftest import BASE, node_config
from tests.e2e.test_egress import the_mirror  # noqa: F401 (a fixture)
from tests.e2e.test_registry_proxy import pip_install
from tests.netpolicy import mirror
from tests.registry.fake_registry import PROJECT
from tests.registry.tls import Authority

POOL = f"{mirror.net(7)}.0/24"  # beside the session's node
GATEWAY = str(ipaddress.ip_network(POOL).network_address + 1)
GOOD, WRONG = 8443, 8444  # the fake registry's HTTPS ports: a right certificate, another host's
PYPI, PYPI_WRONG = 13151, 13152
Maker = Callable[[dict[str, bool]], Awaitable[Sandbox]]


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority.make(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def tls_registry(
    the_mirror: None,  # noqa: F811
    authority: Authority,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Two HTTPS fake registries in the mirror's namespace, both reached by the registry's name:
    one with a certificate for that name, one with a certificate for another host."""
    certs = tmp_path_factory.mktemp("certs")
    repo = Path(__file__).resolve().parents[2]
    procs = []
    try:
        for port, name in ((GOOD, mirror.REGISTRY_NAME), (WRONG, "elsewhere.test")):
            cert, key = authority.issue(certs / str(port), name)
            argv = [sys.executable, "-m", "tests.registry.fake_registry", mirror.ADDRESS, str(port)]
            proc = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    mirror.netns_name(),
                    *argv,
                    mirror.REGISTRY_NAME,
                    str(cert),
                    str(key),
                ],
                stdout=subprocess.PIPE,
                cwd=repo,
            )
            procs.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n", "the HTTPS fake registry did not start"
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
async def tls_node(
    tls_registry: None, authority: Authority, base_layer: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EmbeddedNode]:
    tmp = tmp_path_factory.mktemp("tls-node")
    plain = mirror.egress_config(pool=POOL)
    https = f"https://{mirror.REGISTRY_NAME}"
    egress = plain.model_copy(
        update={
            "permissions": {**plain.permissions, "pypi-wrong": plain.permissions["pypi"]},
            "registries": {
                "pypi": Registry(kind="pypi", index=f"{https}:{GOOD}/simple/", port=PYPI),
                "pypi-wrong": Registry(kind="pypi", index=f"{https}:{WRONG}/simple/", port=PYPI_WRONG),
            },
            "registry_cache": CacheConfig(ca_file=authority.cert),
        }
    )
    cfg = node_config(tmp, data_dir=tmp / "node")
    cfg.edge["egress"] = EgressConfig.model_validate(egress.model_dump())
    node = EmbeddedNode(cfg)
    await node.start()
    try:
        yield node
    finally:
        await node.close(stop_sandboxes=True)


@pytest.fixture(scope="module")
async def tls_client(tls_node: EmbeddedNode) -> AsyncIterator[DSecClient]:
    async with DSecClient(tls_node.url, tls_node.api_key) as c:
        yield c


@pytest.fixture
async def make(tls_client: DSecClient) -> AsyncIterator[Maker]:
    made: list[Sandbox] = []

    async def one(rules: dict[str, bool]) -> Sandbox:
        made.append(
            await tls_client.run_container(DSecContainerRunArgs(container_image=BASE, network_rules=rules))
        )
        return made[-1]

    yield one
    for sb in made:
        await sb.stop()


async def test_pip_installs_through_the_proxy_from_an_https_upstream(make: Maker) -> None:
    sb = await make({"pypi": True})
    assert f"index-url = http://{GATEWAY}:{PYPI}/simple/" in (await sb.read_file("/etc/pip.conf")).decode()
    assert await pip_install(sb) == "2.0"


FETCH = (
    "import urllib.request as u, urllib.error as e\n"
    "try:\n"
    "    h = {{'Accept': 'application/vnd.pypi.simple.v1+json'}}\n"
    "    u.urlopen(u.Request('{url}', headers=h), timeout=60)\n"
    "    print('200')\n"
    "except e.HTTPError as x:\n"
    "    print(x.code, x.read().decode())\n"
)


async def test_an_upstream_certificate_for_another_host_is_a_502_that_says_so(make: Maker) -> None:
    sb = await make({"pypi-wrong": True})
    url = f"http://{GATEWAY}:{PYPI_WRONG}/simple/{PROJECT}/"
    await sb.write_file("/tmp/fetch.py", FETCH.format(url=url).encode())
    res = await sb.run_shell("python3 /tmp/fetch.py", timeout=120)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("502 ") and "TLS certificate the proxy does not trust" in res.stdout
    assert "mismatch" in res.stdout, res.stdout
