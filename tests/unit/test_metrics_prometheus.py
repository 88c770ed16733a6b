"""Prometheus ``/metrics`` over the fake backend: who may scrape, what the figures say after
creates, commands, pauses, stops and errors, and that labels stay bounded.

An embedded node (``dsec up``) runs its apiserver and edge in one process: each has a registry
of its own (the same metric name in both must not clash), the edge's served by the apiserver
at ``/metrics/edges/{node}``.
"""

from __future__ import annotations

from collections import Counter

import aiohttp
import dns.message
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsec import DSecClient, DSecContainerRunArgs, SandboxNotFound
from dsec.netpolicy.dns import NameServer, answer
from dsec.node.embedded import EmbeddedNode
from dsec.observe.edge_metrics import EdgeMetrics
from dsec.observe.metrics import OTHER, MetricsOptions, ProcessMetrics, top

from .conftest import TINY

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(node: EmbeddedNode, path: str, key: str | None) -> tuple[int, str, str]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http, http.get(node.url + path, headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def test_only_an_admin_key_scrapes_an_apiserver(node: EmbeddedNode) -> None:
    status, _, _ = await scrape(node, "/metrics", None)
    assert status == 401
    await node.iam.create_project("root", "team")
    project_key = await node.iam.issue_key("root/team")
    status, _, _ = await scrape(node, "/metrics", project_key)
    assert status == 403
    status, kind, text = await scrape(node, "/metrics", node.api_key)
    assert status == 200 and kind.startswith("text/plain")
    assert value(parse(text), "dsec_node_up", node=node.config.node) == 1
    status, _, _ = await scrape(node, f"/metrics/edges/{node.config.node}", project_key)
    assert status == 403
    status, _, _ = await scrape(node, "/metrics/edges/elsewhere", node.api_key)
    assert status == 400


async def test_figures_follow_what_the_sandboxes_did(node: EmbeddedNode, client: DSecClient) -> None:
    edge_path = f"/metrics/edges/{node.config.node}"
    made = [await client.run_container(DSecContainerRunArgs(container_image=TINY)) for _ in range(3)]
    assert (await made[0].run_shell("echo hi")).stdout == "hi\n"
    assert (await made[0].run_shell("exit 3")).exit_code == 3
    await made[1].pause()
    await made[2].stop()
    with pytest.raises(SandboxNotFound):
        await client.get("sb-e9-1-" + "a" * 20)

    _, _, text = await scrape(node, edge_path, node.api_key)
    edge = parse(text)
    assert value(edge, "dsec_sandboxes", state="running", backend="container", project="root") == 1
    assert value(edge, "dsec_sandboxes", state="paused") == 1
    assert value(edge, "dsec_creates_total", outcome="ok") == 3
    assert value(edge, "dsec_stops_total", reason="user") == 1
    assert value(edge, "dsec_command_seconds_count", kind="run_shell", outcome="ok") == 1
    assert value(edge, "dsec_command_seconds_count", kind="run_shell", outcome="nonzero") == 1
    assert value(edge, "dsec_create_phase_seconds_count", phase="first_output") == 1  # made[0] only
    for phase in ("admission", "layer_mount", "runtime_start"):
        assert value(edge, "dsec_create_phase_seconds_count", phase=phase) == 3
    assert value(edge, "dsec_pause_seconds_count", op="pause") == 1
    assert value(edge, "dsec_pauses_total") == 1
    assert value(edge, "dsec_paused_sandbox_age_seconds_count") == 1
    assert value(edge, "dsec_journal_write_seconds_count") >= 6
    assert value(edge, "dsec_layer_mount_users") == 2  # the running and the paused one
    assert value(edge, "dsec_node_memory_available_bytes") > 0

    _, _, text = await scrape(node, "/metrics", node.api_key)
    api = parse(text)
    assert value(api, "dsec_placement_decisions_total", outcome="placed") == 3
    assert value(api, "dsec_create_phase_seconds_count", phase="placement") == 3
    assert value(api, "dsec_errors_total", code="sandbox_not_found") == 1
    assert value(api, "dsec_api_http_requests_total", route="/v1/sandboxes", method="POST", status="201") == 3
    # Route patterns, never raw paths: one series for every sandbox's shell.
    routes = {dict(ls)["route"] for (n, ls) in api if n == "dsec_api_http_requests_total"}
    assert not any(made[0].id in r for r in routes)
    assert value(api, "dsec_event_loop_lag_seconds") >= 0
    assert value(api, "process_cpu_seconds_total") > 0


def test_labels_past_a_cap_fold_into_other() -> None:
    tally = Counter({f"p{i}": i + 1 for i in range(10)})
    kept = top(tally, 3)
    assert set(kept) == {"p9", "p8", "p7", OTHER}
    assert sum(kept.values()) == sum(tally.values())
    assert top(tally, 20) == dict(tally)


def test_jobs_are_labels_only_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_METRICS_JOBS", raising=False)
    assert MetricsOptions.from_env().jobs == 0
    monkeypatch.setenv("DSEC_METRICS_JOBS", "50")
    assert MetricsOptions.from_env().jobs == 50
    monkeypatch.setenv("DSEC_METRICS_JOBS", "10000000")
    assert MetricsOptions.from_env().jobs == 1000
    monkeypatch.setenv("DSEC_METRICS_JOBS", "many")
    assert MetricsOptions.from_env().jobs == 0


def test_each_edge_owns_its_registry() -> None:
    """Two edges in one process (tests, `dsec up` beside the apiserver): no name clashes."""
    one, two = EdgeMetrics(MetricsOptions()), EdgeMetrics(MetricsOptions())
    one.refusals.labels("never_fits").inc()
    assert one.registry.get_sample_value("dsec_create_refusals_total", {"reason": "never_fits"}) == 1
    assert two.registry.get_sample_value("dsec_create_refusals_total", {"reason": "never_fits"}) is None


def test_the_name_server_tallies_grants_and_denials() -> None:
    """What dsec_egress_dns_answers_total reads: a permitted name answered, any other refused."""
    server = NameServer("127.0.0.1", lambda _: None, lambda _: None)

    def lookup(name: str) -> list[str] | None:
        return ["10.0.0.1"] if "pypi" in name else None

    for name in ("pypi.org", "evil.example", "files.pypi.org"):
        response = answer(dns.message.make_query(name, "A").to_wire(), lookup)
        assert response is not None
        server._count(response)
    assert server.answers == {"granted": 2, "denied": 1}


WEBDAV_METHODS = ("PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "REPORT")


async def test_a_method_of_the_clients_choosing_is_no_label_of_its_own() -> None:
    metrics = ProcessMetrics("probe")
    app = web.Application(middlewares=[metrics.middleware])

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_route("*", "/any", ok)
    async with TestClient(TestServer(app)) as http:
        for method in WEBDAV_METHODS:  # methods HTTP's parser knows, beyond the usual
            async with http.request(method, "/any") as resp:
                assert resp.status == 200
        async with http.get("/any") as resp:
            assert resp.status == 200
    samples = parse(generate_latest(metrics.registry).decode())
    name = "dsec_probe_http_requests_total"
    assert value(samples, name, route="/any", method="other", status="200") == len(WEBDAV_METHODS)
    assert value(samples, name, route="/any", method="GET", status="200") == 1
    assert len(metrics._children) == 2  # nor an entry of its own in the middleware's cache
