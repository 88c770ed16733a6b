"""The official E2B SDKs against the session's DSec node, one venv per SDK version.

``e2b`` is parametrized over :data:`E2B_VERSIONS`: a test that takes it runs once per SDK.
``await e2b.run(code)`` runs ``code`` in that SDK's venv, in its own process, with
``E2B_API_URL``/``E2B_SANDBOX_URL`` set to the node's URL and ``E2B_API_KEY`` to an ``e2b_``
key of project ``root/e2b``; the snippet prints one JSON value as its last line, which
``run`` returns. The venvs are made by ``./setup.sh test`` (or here, once, when missing).

An envd test looks like::

    async def test_write_and_read(e2b: E2B) -> None:
        out = await e2b.run('''
            sbx = Sandbox.create(timeout=60)
            sbx.files.write("/tmp/a.txt", "hi")
            print(json.dumps(sbx.files.read("/tmp/a.txt")))
            sbx.kill()
        ''')
        assert out == "hi"

(``json``, ``os``, ``sys``, ``time`` and ``e2b``'s ``Sandbox`` are imported for the snippet.)
Every sandbox of the E2B test projects is stopped after each test, also when it fails.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dsec.iam.base import Quota
from dsec.node.embedded import EmbeddedNode
from dsec.protocol.errors import Conflict

REPO = Path(__file__).resolve().parents[2]
E2B_VERSIONS = ("2.63.0", "2.34.0")
PROJECT = "root/e2b"
OTHER_PROJECT = "root/e2b-other"
_PRELUDE = "import json, os, sys, time\nfrom e2b import Sandbox\n"
# e2b 2.63's async client (pyqwest, a Rust runtime) aborts now and then at interpreter exit
# after everything succeeded: 3 runs in 20 of create+kill against a 30-line fake server that
# answers in 50 ms, none at 0 ms. A snippet leaves without that teardown once its answer is out.
_EPILOGUE = "\nsys.stdout.flush()\nos._exit(0)\n"


def venv_of(version: str) -> Path:
    """``.venv-e2b-2.63`` for 2.63.0: the directory setup.sh makes (and keeps) for it."""
    return REPO / f".venv-e2b-{version.rsplit('.', 1)[0]}"


def ensure_venv(version: str) -> Path:
    venv = venv_of(version)
    stamp = venv / f".installed-{version}"
    if not stamp.exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"e2b=={version}"], check=True)
        stamp.touch()
    return venv / "bin" / "python"


class SnippetFailed(AssertionError):
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        super().__init__(f"snippet exited {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
        self.stdout, self.stderr = stdout, stderr


@dataclass
class E2B:
    """One E2B SDK version pointed at the node, with a key of :data:`PROJECT`."""

    version: str
    python: Path
    url: str
    key: str
    other_key: str  # a key of OTHER_PROJECT: sees none of PROJECT's sandboxes

    def env(self, key: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(E2B_API_URL=self.url, E2B_SANDBOX_URL=self.url, E2B_API_KEY=key or self.key)
        env.update(E2B_VOLUME_API_URL=self.url)  # the volume content API is the apiserver's too
        return env

    async def run(self, code: str, *, key: str | None = None, timeout: float = 60) -> Any:
        """Run ``code`` with this SDK; the JSON value its last stdout line holds."""
        proc = await asyncio.create_subprocess_exec(
            str(self.python),
            "-c",
            _PRELUDE + textwrap.dedent(code) + _EPILOGUE,
            env=self.env(key),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        stdout, stderr = out.decode(), err.decode()
        if proc.returncode != 0:
            raise SnippetFailed(proc.returncode or 0, stdout, stderr)
        lines = stdout.strip().splitlines()
        if not lines:
            raise SnippetFailed(0, stdout, stderr)
        return json.loads(lines[-1])


async def _project(node: EmbeddedNode, path: str, quota: Quota) -> None:
    parent, name = path.rsplit("/", 1)
    try:
        await node.iam.create_project(parent, name, quota)
    except Conflict:
        await node.iam.set_quota(path, quota)  # the data directory outlives test sessions


STALE_TEMPLATE_S = 7200.0  # older than any run (CI stops one at 90 min): a suite beside keeps its own


async def _templates(http: aiohttp.ClientSession, url: str, key: str) -> dict[str, float]:
    """The templates ``key`` sees (the E2B API's list): ID -> creation time."""
    async with http.get(f"{url}/templates", headers={"X-API-Key": key}) as resp:
        assert resp.status == 200, await resp.text()
        listed = await resp.json()
    return {t["templateID"]: datetime.datetime.fromisoformat(t["createdAt"]).timestamp() for t in listed}


async def _delete_templates(http: aiohttp.ClientSession, url: str, key: str, ids: set[str]) -> None:
    for template_id in ids:
        async with http.delete(f"{url}/templates/{template_id}", headers={"X-API-Key": key}) as resp:
            assert resp.status in (204, 404), await resp.text()


@pytest.fixture(scope="session")
async def e2b_keys(node: EmbeddedNode) -> tuple[str, str]:
    """An ``e2b_`` key of PROJECT and one of OTHER_PROJECT. The test projects' templates live in
    the layer store, shared by sessions and by suites running beside (and a project holds at
    most 256): those older than any run are deleted here, so runs do not pile them up."""
    await _project(node, PROJECT, Quota(sandboxes=16))
    await _project(node, OTHER_PROJECT, Quota(sandboxes=4))
    keys = (
        await node.iam.issue_key(PROJECT, format="e2b", name="tests/e2b"),
        await node.iam.issue_key(OTHER_PROJECT, format="e2b", name="tests/e2b"),
    )
    async with aiohttp.ClientSession() as http:
        for key in keys:
            seen = await _templates(http, node.url, key)
            stale = {t for t, created in seen.items() if created < time.time() - STALE_TEMPLATE_S}
            await _delete_templates(http, node.url, key, stale)
    return keys


@pytest.fixture(scope="session", params=E2B_VERSIONS, ids=lambda v: f"e2b-{v}")
async def e2b(request: pytest.FixtureRequest, node: EmbeddedNode, e2b_keys: tuple[str, str]) -> E2B:
    python = await asyncio.to_thread(ensure_venv, request.param)
    return E2B(request.param, python, node.url, *e2b_keys)


@pytest.fixture
async def e2b_latest(node: EmbeddedNode, e2b_keys: tuple[str, str]) -> E2B:
    """The newest SDK alone, for routes and answers that do not differ by SDK version."""
    python = await asyncio.to_thread(ensure_venv, E2B_VERSIONS[0])
    return E2B(E2B_VERSIONS[0], python, node.url, *e2b_keys)


@pytest.fixture(autouse=True)
async def _stop_e2b_sandboxes(node: EmbeddedNode) -> AsyncIterator[None]:
    yield
    for info in await node.link.list_sandboxes():
        if info.project in (PROJECT, OTHER_PROJECT):
            await node.link.stop(info.id)
            await node.api.tenancy.release(info.id)
