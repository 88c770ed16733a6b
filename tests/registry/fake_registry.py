"""A fake PyPI and npm registry for the tests: one HTTP server (aiohttp) serving a project
``dsec-demo`` in two releases, 1.0 uploaded 2025-01-10 and 2.0 uploaded 2025-09-01, as a PEP 691
simple page with real wheels, and as an npm packument with tarballs. It counts what it serves
(``GET /_stats``), so a test sees how often the proxy came upstream.

In-process (``async with FakeRegistry() as up``) or as a process in a test's network namespace:
``python -m tests.registry.fake_registry ADDRESS PORT NAME [CERT KEY]`` (NAME: the host its
links name; with CERT and KEY it serves HTTPS) prints ``ready`` once it listens.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import io
import json
import ssl
import sys
import tarfile
import uuid
import zipfile
from types import TracebackType

from aiohttp import web

PROJECT = "dsec-demo"
MODULE = "dsec_demo"
RELEASES = {"1.0": "2025-01-10T12:00:00.000000Z", "2.0": "2025-09-01T12:00:00.000000Z"}
NPM_RELEASES = {"1.0.0": "2025-01-10T12:00:00.000Z", "2.0.0": "2025-09-01T12:00:00.000Z"}
PAD = 256 * 1024  # each wheel carries this much incompressible data: a download has a size


def wheel(version: str) -> bytes:
    """A wheel pip installs: the module prints its version; ``blob.bin`` gives it bulk."""
    dist = f"{MODULE}-{version}.dist-info"
    files = {
        f"{MODULE}/__init__.py": f'VERSION = "{version}"\n'.encode(),
        f"{MODULE}/blob.bin": hashlib.shake_256(version.encode()).digest(PAD),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dsec-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, (2025, 1, 1, 0, 0, 0)), data)
    return out.getvalue()


def tarball(version: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        data = json.dumps({"name": PROJECT, "version": version}).encode()
        info = tarfile.TarInfo("package/package.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def wheel_name(version: str) -> str:
    return f"{MODULE}-{version}-py3-none-any.whl"


class FakeRegistry:
    def __init__(
        self,
        address: str = "127.0.0.1",
        port: int = 0,
        name: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.address, self.port = address, port
        self.tls = tls  # serves HTTPS with this context
        self.name = name or address  # what its absolute links name (the proxy's upstream origin)
        self.wheels = {wheel_name(v): wheel(v) for v in RELEASES}
        self.tarballs = {f"{PROJECT}-{v}.tgz": tarball(v) for v in NPM_RELEASES}
        # In every file's URL: a node's proxy cache outlives a test run, and must not already
        # hold this run's files.
        self.salt = uuid.uuid4().hex[:12]
        self.hits: collections.Counter[str] = collections.Counter()
        self.bytes_sent = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.name}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"/simple/{PROJECT}/", self._simple)
        app.router.add_get(f"/pypi/{PROJECT}/json", self._json)
        app.router.add_get(f"/files/{self.salt}/{{name}}", self._file)
        app.router.add_get(f"/npm/{PROJECT}", self._packument)
        app.router.add_get(f"/npm/{PROJECT}/-/{{name}}", self._tarball)
        app.router.add_get("/_stats", self._stats)
        return app

    def _count(self, request: web.Request, size: int) -> None:
        self.hits[request.path] += 1
        self.bytes_sent += size

    def _files(self) -> list[dict[str, object]]:
        return [
            {
                "filename": wheel_name(v),
                "url": f"../../files/{self.salt}/{wheel_name(v)}",  # relative, as the PEP allows
                "hashes": {"sha256": hashlib.sha256(self.wheels[wheel_name(v)]).hexdigest()},
                "requires-python": ">=3",
                "upload-time": at,
                "core-metadata": False,
            }
            for v, at in RELEASES.items()
        ] + [
            {
                "filename": f"{MODULE}-0.9-py3-none-any.whl",
                "url": f"../../files/{self.salt}/undated",
                "hashes": {},
            }
        ]

    async def _simple(self, request: web.Request) -> web.Response:
        assert "application/vnd.pypi.simple.v1+json" in request.headers.get("Accept", "")
        body = json.dumps(
            {
                "meta": {"api-version": "1.1"},
                "name": PROJECT,
                "files": self._files(),
                "versions": [*RELEASES, "0.9"],
            }
        )
        self._count(request, len(body))
        return web.Response(text=body, content_type="application/vnd.pypi.simple.v1+json")

    async def _json(self, request: web.Request) -> web.Response:
        releases = {
            v: [
                {
                    "filename": wheel_name(v),
                    "url": f"{self.url}/files/{self.salt}/{wheel_name(v)}",
                    "upload_time_iso_8601": at,
                }
            ]
            for v, at in RELEASES.items()
        }
        doc = {"info": {"name": PROJECT, "version": "2.0"}, "releases": releases, "urls": releases["2.0"]}
        self._count(request, 0)
        return web.json_response(doc)

    async def _file(self, request: web.Request) -> web.Response:
        data = self.wheels.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound()
        self._count(request, len(data))
        await asyncio.sleep(0)  # let concurrent askers pile up behind the proxy, as they would
        return web.Response(body=data, content_type="application/octet-stream")

    async def _packument(self, request: web.Request) -> web.Response:
        versions = {
            v: {
                "name": PROJECT,
                "version": v,
                "dist": {"tarball": f"{self.url}/npm/{PROJECT}/-/{PROJECT}-{v}.tgz"},
            }
            for v in NPM_RELEASES
        }
        doc = {
            "name": PROJECT,
            "dist-tags": {"latest": "2.0.0", "next": "2.0.0"},
            "versions": versions,
            "time": {
                "created": "2025-01-01T00:00:00.000Z",
                "modified": "2025-09-01T12:00:00.000Z",
                **NPM_RELEASES,
            },
        }
        self._count(request, 0)
        return web.json_response(doc)

    async def _tarball(self, request: web.Request) -> web.Response:
        data = self.tarballs.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound()
        self._count(request, len(data))
        return web.Response(body=data, content_type="application/octet-stream")

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"hits": dict(self.hits), "bytes": self.bytes_sent, "salt": self.salt})

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.address, self.port, ssl_context=self.tls)
        await site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeRegistry:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def _main(address: str, port: int, name: str, cert: str | None, key: str | None) -> None:
    tls = None
    if cert and key:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
    async with FakeRegistry(address, port, name, tls):
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    tail = [*sys.argv[4:6], None, None]
    asyncio.run(_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], tail[0], tail[1]))
