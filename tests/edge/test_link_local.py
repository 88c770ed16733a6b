"""The in-process link (what ``dsec up`` uses) passes the link conformance suite."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dsec.edge.edge import Edge
from dsec.edge.link import LocalEdgeLink

from .conftest import EdgeEnv
from .link_conformance import LinkConformance


@pytest.fixture
async def link(edge_env: EdgeEnv) -> AsyncIterator[LocalEdgeLink]:
    local = LocalEdgeLink(edge_env.edge)
    yield local
    await local.close()


@pytest.fixture
async def ct_link(ct_edge: Edge) -> AsyncIterator[LocalEdgeLink]:
    local = LocalEdgeLink(ct_edge)
    yield local
    await local.close()


class TestLocalEdgeLink(LinkConformance):
    # A function call has no credentials and no network to lose: these do not apply.
    test_a_wrong_or_missing_secret_is_unauthorized = None  # type: ignore[assignment]
    test_an_unreachable_edge_is_a_classified_infra_failure = None  # type: ignore[assignment]
