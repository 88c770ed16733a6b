"""Two nodes on one host take disjoint link address pools (netpolicy/pools.py): a pool a node
chose is claimed until it closes with no link, kept across its restarts, and never one a route
of the host already covers."""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

from dsec.netpolicy import pools

Net = ipaddress.IPv4Network


def test_two_nodes_alike_named_on_two_data_directories_take_disjoint_pools(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    chosen = [
        pools.choose("local", tmp_path / d / "edge", had_links=False, claims=claims, routes=[])
        for d in ("a", "b", "c", "d")
    ]
    assert len(set(chosen)) == 4 and all(p in pools.CANDIDATES for p in chosen)
    assert not any(a.overlaps(b) for i, a in enumerate(chosen) for b in chosen[i + 1 :])


def test_a_restarted_node_keeps_its_pool_and_a_closed_one_frees_it(tmp_path: Path) -> None:
    claims, a, b = tmp_path / "claims", tmp_path / "a", tmp_path / "b"
    first = pools.choose("n", a, had_links=False, claims=claims, routes=[])
    assert pools.choose("n", a, had_links=False, claims=claims, routes=[]) == first
    # The same name on another data directory starting from the same candidate goes elsewhere.
    other = pools.choose("n", b, had_links=False, claims=claims, routes=[first])
    assert other != first
    pools.release(first, a, claims=claims)
    assert not (a / pools.POOL_FILE).exists()
    assert pools.claim_configured(first, b, claims=claims) is None  # free again


def test_a_pool_a_host_route_covers_is_skipped(tmp_path: Path) -> None:
    taken = [Net("10.0.0.0/9"), Net("10.192.0.0/10")]  # covers every candidate but 10.128...
    chosen = pools.choose("n", tmp_path, had_links=False, claims=tmp_path / "c", routes=taken[:1])
    assert not chosen.overlaps(taken[0])
    everything = pools.choose("m", tmp_path / "x", had_links=False, claims=tmp_path / "c", routes=taken)
    assert everything in pools.CANDIDATES  # nothing free: still a pool, with a warning


def test_a_node_with_links_from_before_pools_keeps_the_old_default(tmp_path: Path) -> None:
    assert (
        pools.choose("n", tmp_path, had_links=True, claims=tmp_path / "c", routes=[]) == pools.LEGACY_DEFAULT
    )


def test_a_claim_whose_node_is_gone_is_stale(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    gone = tmp_path / "gone"
    first = pools.choose("n", gone, had_links=False, claims=claims, routes=[])
    shutil.rmtree(gone)  # its data directory was removed without a clean close
    assert pools.claim_configured(first, tmp_path / "new", claims=claims) is None
    live = tmp_path / "live"
    theirs = pools.choose("n", live, had_links=False, claims=claims, routes=[])
    assert pools.claim_configured(theirs, tmp_path / "third", claims=claims) == live.resolve()


def test_the_host_routing_table_is_read(tmp_path: Path) -> None:
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "eth0\t0000C80A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
    )
    assert pools.routed_networks(table) == [Net("10.200.0.0/16")]
