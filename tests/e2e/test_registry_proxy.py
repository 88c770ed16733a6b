"""Package registries through the node's proxy, on the real kernel: real pip in a real sandbox
installs from the fake registry (in the mirror's network namespace, reached by name through
the node's upstream resolver) via the proxy on the gateway; a cutoff makes pip pick the older
release; an npm packument comes filtered; links without the permission reach no proxy port;
a bad cutoff is a 400."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from dsec import InvalidRequest
from dsec.node.embedded import EmbeddedNode
from dsec.sdk.client import Sandbox
from tests.conftest import Sandboxes
from tests.e2e.test_egress import probe, the_mirror  # noqa: F401 (a fixture)
from tests.netpolicy import mirror
from tests.registry.fake_registry import PROJECT

GATEWAY = str(ipaddress.ip_network(mirror.POOL).network_address + 1)
PYPI, NPM = 13141, 13142  # the test node's registry ports (tests/netpolicy/mirror.py)
PIP_WHEELS = sorted(Path("/usr/share/python-wheels").glob("pip-*.whl"))  # Debian's python3-pip-whl


@pytest.fixture(scope="module")
def registry(the_mirror: None) -> Iterator[str]:  # noqa: F811
    """The fake registry in the mirror's namespace; yields its stats URL (the host reaches it)."""
    repo = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "tests.registry.fake_registry", mirror.ADDRESS, str(mirror.REGISTRY_PORT)]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", mirror.netns_name(), *argv, mirror.REGISTRY_NAME],
        stdout=subprocess.PIPE,
        cwd=repo,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n", "the fake registry did not start"
        yield f"http://{mirror.ADDRESS}:{mirror.REGISTRY_PORT}/_stats"
    finally:
        proc.kill()
        proc.wait()


async def pip_install(sb: Sandbox) -> str:
    """Install dsec-demo with real pip (Debian's pip wheel, run from the wheel: the base layer
    has python3 but no pip) as /etc/pip.conf says; the installed module's version."""
    if not PIP_WHEELS:
        pytest.fail("Debian's python3-pip-whl is missing (setup.sh installs it)")
    await sb.write_file("/tmp/pip.whl", PIP_WHEELS[-1].read_bytes())
    res = await sb.run_shell(
        "python3 /tmp/pip.whl/pip install -q --no-cache-dir --disable-pip-version-check"
        f" --break-system-packages --target /tmp/site {PROJECT}"
        " && PYTHONPATH=/tmp/site python3 -c 'import dsec_demo; print(dsec_demo.VERSION)'",
        timeout=300,
    )
    assert res.exit_code == 0, res.stdout + res.stderr
    return res.stdout.strip()


async def test_pip_installs_through_the_proxy_and_a_cutoff_picks_the_older_release(
    registry: str, make_sandbox: Sandboxes
) -> None:
    latest = await make_sandbox(network_rules={"pypi": True})
    dated = await make_sandbox(network_rules={"pypi": {"before": "2025-06-01"}})
    conf = (await latest.read_file("/etc/pip.conf")).decode()
    assert f"index-url = http://{GATEWAY}:{PYPI}/simple/" in conf
    assert (await latest.run_shell("stat -c %a /etc/pip.conf")).stdout.strip() == "444"
    assert await pip_install(latest) == "2.0"
    assert await pip_install(dated) == "1.0"
    # Revoked: the file goes, and the proxy's port closes.
    await latest.set_network_rules({"pypi": False})
    assert (await latest.run_shell("test -e /etc/pip.conf")).exit_code != 0
    assert (await probe(latest, connect=[[GATEWAY, PYPI]]))["open"] == []


NPM_VIEW = r"""
import json, sys, urllib.request
doc = json.load(urllib.request.urlopen(sys.argv[1] + "/dsec-demo", timeout=30))
latest = doc["versions"][doc["dist-tags"]["latest"]]
tarball = urllib.request.urlopen(latest["dist"]["tarball"], timeout=30).read()
print(json.dumps({"versions": sorted(doc["versions"]), "tags": doc["dist-tags"], "tarball": len(tarball)}))
"""


async def test_an_npm_packument_comes_through_the_proxy_filtered(
    registry: str, make_sandbox: Sandboxes
) -> None:
    sb = await make_sandbox(network_rules={"npm": {"before": "2025-06-01"}})
    npmrc = (await sb.read_file("/etc/npmrc")).decode()
    assert npmrc == f"registry=http://{GATEWAY}:{NPM}/\n"
    await sb.write_file("/tmp/npm_view.py", NPM_VIEW.encode())
    res = await sb.run_shell(f"python3 /tmp/npm_view.py http://{GATEWAY}:{NPM}", timeout=120)
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["versions"] == ["1.0.0"] and out["tags"] == {"latest": "1.0.0"} and out["tarball"] > 0
    # npm only: the PyPI port of the proxy stays closed to this link (the kernel, per port).
    assert (await probe(sb, connect=[[GATEWAY, NPM], [GATEWAY, PYPI]]))["open"] == [[GATEWAY, NPM]]


async def test_many_sandboxes_fetch_one_copy_upstream(registry: str, make_sandbox: Sandboxes) -> None:
    boxes = [await make_sandbox(network_rules={"pypi": True}) for _ in range(3)]
    fetch = (
        "import json, urllib.request as u; h={'Accept': 'application/vnd.pypi.simple.v1+json'};"
        f" d=json.load(u.urlopen(u.Request('http://{GATEWAY}:{PYPI}/simple/{PROJECT}/', headers=h)));"
        " f=[x for x in d['files'] if x['filename'].startswith('dsec_demo-1.0')][0];"
        " print(len(u.urlopen(f['url']).read()))"
    )
    sizes = set()
    for sb in boxes:
        res = await sb.run_shell(f'python3 -c "{fetch}"', timeout=120)
        assert res.exit_code == 0, res.stderr
        sizes.add(res.stdout.strip())
    async with aiohttp.ClientSession() as s, s.get(registry) as r:
        stats = await r.json()
    assert (
        len(sizes) == 1 and stats["hits"].get(f"/files/{stats['salt']}/dsec_demo-1.0-py3-none-any.whl") == 1
    )


async def test_no_permission_no_proxy_and_bad_cutoffs_are_refused(
    registry: str, make_sandbox: Sandboxes, node: EmbeddedNode
) -> None:
    sb = await make_sandbox(network_rules={"mirror": True})
    assert (await probe(sb, connect=[[GATEWAY, PYPI], [GATEWAY, NPM]]))["open"] == []
    assert (await sb.run_shell("test -e /etc/pip.conf || test -e /etc/npmrc")).exit_code != 0
    headers = {"Authorization": f"Bearer {node.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as s:
        for bad in (
            {"pypi": {"before": "2025-13-01"}},
            {"pypi": {"before": "yesterday"}},
            {"pypi": {"until": "x"}},
        ):
            async with s.put(f"{node.url}/v1/sandboxes/{sb.id}/network", json={"network_rules": bad}) as r:
                assert r.status == 400, (bad, r.status, await r.text())
    with pytest.raises(InvalidRequest, match="takes no 'before' cutoff"):
        await sb.set_network_rules({"mirror": {"before": "2025-06-01"}})  # type: ignore[dict-item]
