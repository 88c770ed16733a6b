"""A real Prometheus scraping the netns cluster: two apiservers and three edges, real
container sandboxes, answers read back through Prometheus's own HTTP API with PromQL.

Prometheus (Debian's ``prometheus``, ``./setup.sh test`` installs it) is started by the test
on a free port with a scratch data directory, scrapes every second with the cluster secret
(edges, and the second apiserver at ``/cluster/v1/metrics``) and the test's admin key (the
first apiserver at ``/metrics``) as bearer tokens, and is ended by its PID.
Each check polls a query until Prometheus has scraped what it asks for.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from dsec import DSecContainerRunArgs, SandboxNotFound, SandboxState
from tests.support import eventually

from .harness import EDGE_PORT, Cluster, free_port
from .procs import Proc

pytestmark = pytest.mark.slow

SCRAPE_S = 1


class Prometheus:
    def __init__(self, proc: Proc, url: str) -> None:
        self.proc = proc
        self.url = url
        self.http = aiohttp.ClientSession()

    async def query(self, promql: str) -> list[dict[str, object]]:
        async with self.http.get(f"{self.url}/api/v1/query", params={"query": promql}) as resp:
            body = await resp.json()
        assert body["status"] == "success", body
        result: list[dict[str, object]] = body["data"]["result"]
        return result

    async def scalar(self, promql: str) -> float | None:
        """The query's single value, None while it has no answer (not scraped yet)."""
        result = await self.query(promql)
        if not result:
            return None
        assert len(result) == 1, result
        value = result[0]["value"]
        assert isinstance(value, list)
        return float(value[1])

    async def until(self, promql: str, want: float) -> None:
        """Until ``promql`` answers ``want`` (the scrapes after the event have happened)."""
        seen: list[float | None] = []

        async def answered() -> bool:
            seen[:] = [await self.scalar(promql)]
            return seen[0] == want

        try:
            await eventually(answered, f"{promql} == {want}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last answer {seen}\n{self.proc.tail()}") from None


def prometheus_config(cluster: Cluster, key_file: Path) -> dict[str, object]:
    edges = [f"{ns.ns_ip}:{EDGE_PORT}" for ns in cluster.spaces.values()]
    interval = f"{SCRAPE_S}s"
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "dsec-edge",
                "authorization": {"credentials_file": str(cluster.secret_file)},
                "static_configs": [{"targets": edges}],
            },
            {
                "job_name": "dsec-apiserver",
                "authorization": {"credentials_file": str(key_file)},
                "static_configs": [{"targets": [f"127.0.0.1:{cluster.api_ports[0]}"]}],
            },
            {
                "job_name": "dsec-apiserver-by-secret",
                "metrics_path": "/cluster/v1/metrics",
                "authorization": {"credentials_file": str(cluster.secret_file)},
                "static_configs": [{"targets": [f"127.0.0.1:{cluster.api_ports[1]}"]}],
            },
        ],
    }


@pytest.fixture
async def prometheus(cluster: Cluster, tmp_path: Path) -> AsyncIterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is missing: ./setup.sh test installs Debian's prometheus"
    home = tmp_path / "prometheus"
    home.mkdir()
    key_file = home / "admin-key"
    key_file.write_text(cluster.key)
    key_file.chmod(0o600)
    config = home / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(cluster, key_file)))  # JSON is YAML
    port = free_port()
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    proc = Proc("prometheus", argv, home / "prometheus.log")
    prom = Prometheus(proc, f"http://127.0.0.1:{port}")
    try:

        async def ready() -> bool:
            assert proc.alive(), proc.report()
            try:
                async with prom.http.get(f"{prom.url}/-/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(ready, "prometheus to be ready")
        yield prom
    finally:
        await prom.http.close()
        code = proc.terminate()
        assert code == 0, f"prometheus did not exit cleanly on SIGTERM: {code}\n{proc.report()}"


async def test_prometheus_reads_the_cluster_through_promql(
    cluster: Cluster, prometheus: Prometheus, base_layer: str
) -> None:
    prom = prometheus
    # Five targets answer: the edges and the second apiserver took the cluster secret, the
    # first apiserver the admin key. Without them, nothing.
    await prom.until('count(up{job="dsec-edge"} == 1)', 3)
    await prom.until('count(up{job=~"dsec-apiserver.*"} == 1)', 2)
    # 3 nodes as 2 apiservers see them
    await prom.until('count(dsec_node_up{job=~"dsec-apiserver.*"} == 1)', 6)
    edge = next(iter(cluster.spaces.values())).ns_ip
    secret = cluster.secret_file.read_text().strip()
    for url, token in [
        (f"http://{edge}:{EDGE_PORT}/metrics", None),
        (f"http://{edge}:{EDGE_PORT}/metrics", cluster.key),  # an API key is not the secret
        (f"{cluster.api_url(0)}/metrics", None),
        (f"{cluster.api_url(0)}/metrics", secret),  # nor the secret an API key
        (f"{cluster.api_url(0)}/cluster/v1/metrics", cluster.key),
    ]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with prom.http.get(url, headers=headers) as resp:
            assert resp.status == 401, url

    async with cluster.client(0) as one, cluster.client(1) as two:
        made = [await one.run_container(DSecContainerRunArgs(container_image=base_layer)) for _ in range(3)]
        hog = await two.run_container(DSecContainerRunArgs(container_image=base_layer, memory_limit_mb=64))
        for sb in made:
            assert (await sb.run_shell("echo hi")).stdout == "hi\n"
            assert (await sb.exec(["true"])).exit_code == 0
        killed = await hog.run_shell("python3 -c 'x = bytearray(256 << 20)'")  # past its 64 MiB
        assert killed.oom_killed, killed
        paused = await made[0].pause()
        assert paused.state is SandboxState.paused
        missing = made[1].id[:-20] + "a" * 20  # the node's ID scheme, a sandbox it never made
        with pytest.raises(SandboxNotFound):
            await two.get(missing)
        await made[2].stop()

    # The apiservers: four placed creates (per apiserver), the not-found error, every route a pattern.
    await prom.until('sum(dsec_placement_decisions_total{outcome="placed"})', 4)
    await prom.until(
        'sum(dsec_api_http_requests_total{route="/v1/sandboxes", method="POST", status="201"})', 4
    )
    await prom.until('sum(dsec_errors_total{job=~"dsec-apiserver.*", code="sandbox_not_found"})', 1)
    await prom.until('sum(dsec_create_phase_seconds_count{job=~"dsec-apiserver.*", phase="placement"})', 4)
    # The edges: what ran where, summed over the three.
    await prom.until('sum(dsec_command_seconds_count{kind="run_shell", outcome="ok"})', 3)
    await prom.until('sum(dsec_command_seconds_count{kind="exec", outcome="ok"})', 3)
    await prom.until("sum(dsec_command_oom_kills_total)", 1)
    await prom.until('sum(dsec_command_seconds_count{outcome="oom"})', 1)
    await prom.until("sum(dsec_pauses_total)", 1)
    await prom.until('sum(dsec_pause_seconds_count{op="pause"})', 1)
    await prom.until('sum(dsec_sandboxes{state="paused"})', 1)
    await prom.until("sum(dsec_paused_sandbox_age_seconds_count)", 1)
    await prom.until('sum(dsec_stops_total{reason="user"})', 1)
    await prom.until('sum(dsec_create_phase_seconds_count{phase="first_output"})', 4)
    await prom.until('sum(dsec_errors_total{job="dsec-edge", code="sandbox_not_found"})', 1)
    # Figures read at scrape time: memory and density are there for every edge.
    await prom.until('count(dsec_node_memory_available_bytes{job="dsec-edge"} > 0)', 3)
    await prom.until('count(dsec_node_density_sandboxes_per_gib{job="dsec-edge"} > 0)', 3)
    await prom.until("count(dsec_event_loop_lag_seconds >= 0)", 5)
    # A histogram quantile over the cluster answers (the dashboard's create latency panel).
    p99 = await prom.scalar(
        'histogram_quantile(0.99, sum by (le) (dsec_create_phase_seconds_bucket{phase="runtime_start"}))'
    )
    assert p99 is not None and p99 > 0
