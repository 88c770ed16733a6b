"""The async SDK: :class:`DSecClient` creates sandboxes, :class:`Sandbox` drives one.

    client = DSecClient(); await client.open()
    sandbox = await client.run_container(DSecContainerRunArgs(container_image="debian:bookworm"))
    result = await sandbox.run_shell("echo hello world")
    await sandbox.stop()

A sandbox operation (:mod:`dsec.protocol.ops`) is a one-line method here: it builds the op
and sends it through :meth:`Sandbox._call`, which answers with the type the op names.

The sync API (:class:`dsec.sdk.DSec`) is generated from these classes; add methods here only.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from dsec.protocol.files import path_query
from dsec.protocol.models import (
    BatchCreateRequest,
    CommandResult,
    CreateRequest,
    ExecEvent,
    ExecRequest,
    FileStat,
    LayerInfo,
    NetworkRules,
    SandboxInfo,
)
from dsec.protocol.ops import Call, Commit, ListDir, Mkdir, Move, Remove, RunShell, SetNetworkRules, Stat
from dsec.sdk._display import SandboxDisplayCalls
from dsec.sdk._fncall import FnCalls
from dsec.sdk._layers import LayerCalls
from dsec.sdk._projects import ProjectCalls
from dsec.sdk._pty import SandboxPtyCalls
from dsec.sdk._rl import JobCalls, SandboxRlCalls
from dsec.sdk._transport import Transport, file_chunks
from dsec.sdk._volumes import VolumeCalls
from dsec.sdk.args import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs
from dsec.sdk.build import BuildEvent, build_layer
from dsec.sdk.config import load_client_config

R = TypeVar("R")


@dataclass(frozen=True)
class ExecChunk:
    stream: Literal["stdout", "stderr"]
    data: bytes


class Sandbox(SandboxRlCalls, SandboxDisplayCalls, SandboxPtyCalls):
    """A handle on one sandbox. Cheap to create; holds no server-side state."""

    info: SandboxInfo  # as last read from the server (``refresh()`` reads it again)
    id: str

    def __init__(self, transport: Transport, info: SandboxInfo) -> None:
        self._t = transport
        self.info = info
        self.id = info.id
        self._base = f"/v1/sandboxes/{info.id}"

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self.info.state.value!r})"

    def _sibling(self, info: SandboxInfo) -> Sandbox:
        return Sandbox(self._t, info)

    async def _call(self, op: Call[R], *, timeout: float | None = None) -> R:
        """``op`` on this sandbox (``POST /v1/sandboxes/{id}/ops/{kind}``); its answer."""
        return await self._t.call(self.id, op, timeout=timeout)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._t.request("GET", self._base))
        return self.info

    async def stop(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self._t.request("DELETE", self._base))
        return self.info

    async def set_network_rules(
        self,
        rules: NetworkRules,
        egress_headers: dict[str, dict[str, str]] | None = None,
        egress_secrets: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """Replace this sandbox's network permissions (names the node's operator configured,
        e.g. ``{"pypi": True}``); they are in force in the kernel when this returns. Given
        ``egress_headers`` (host -> headers, values may name ``egress_secrets`` as
        ``${secrets.<name>}``) replace the sandbox's; None keeps them."""
        op = SetNetworkRules(
            network_rules=rules, egress_headers=egress_headers, egress_secrets=egress_secrets or {}
        )
        self.info = await self._call(op)
        return self.info

    # -- commands ---------------------------------------------------------------------------

    async def run_shell(
        self,
        command: str,
        *,
        session: str = "default",
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommandResult:
        """Run ``command`` in a named shell session that keeps cwd and variables between calls.

        A command that runs past ``timeout`` is killed with its session; the result then has
        ``timed_out=True`` and the next call on that session starts a fresh shell. With an
        ``idempotency_key`` the command runs at most once in this sandbox: a repeat (a
        restarted agent loop replaying its history) gets the recorded result.
        """
        op = RunShell(
            command=command,
            session=session,
            timeout=timeout,
            max_output_bytes=max_output_bytes,
            idempotency_key=idempotency_key,
        )
        return await self._call(op, timeout=None if timeout is None else timeout + 30)

    async def exec_stream(
        self,
        argv: list[str],
        *,
        stdin: bytes | str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[ExecChunk | CommandResult]:
        """Run ``argv`` (no shell) and yield its output as it comes; the last item is the result.

        With an ``idempotency_key`` it runs at most once, to its end even if this caller goes
        away; a repeat streams the recorded output."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        req = ExecRequest(
            argv=argv,
            stdin_b64=None if stdin is None else base64.b64encode(stdin).decode(),
            env=env or {},
            cwd=cwd,
            timeout=timeout,
            max_output_bytes=max_output_bytes,
            idempotency_key=idempotency_key,
        )
        async for line in self._t.lines(
            "POST", self._base + "/exec", json_body=req.model_dump(exclude_none=True)
        ):
            event = ExecEvent.model_validate_json(line)
            if event.t == "exit":
                assert event.result is not None
                yield event.result
            else:
                yield ExecChunk("stdout" if event.t == "out" else "stderr", base64.b64decode(event.d or ""))

    async def exec(
        self,
        argv: list[str],
        *,
        stdin: bytes | str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        max_output_bytes: int | None = None,
        idempotency_key: str | None = None,
    ) -> CommandResult:
        """Run ``argv`` (no shell) to its end and collect its output."""
        out, err = bytearray(), bytearray()
        result: CommandResult | None = None
        async for item in self.exec_stream(
            argv,
            stdin=stdin,
            env=env,
            cwd=cwd,
            timeout=timeout,
            max_output_bytes=max_output_bytes,
            idempotency_key=idempotency_key,
        ):
            if isinstance(item, CommandResult):
                result = item
            else:
                (out if item.stream == "stdout" else err).extend(item.data)
        assert result is not None, "exec stream ended without a result"
        return result.model_copy(
            update={"stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace")}
        )

    async def commit(
        self, ref: str, *, exclude: list[str] | None = None, scrub_defaults: bool = True
    ) -> LayerInfo:
        """Pack what this sandbox changed (its writes, deletions included) into layer ``ref``.

        Caches, histories and temp files are scrubbed first (``scrub_defaults``), plus
        ``exclude`` (paths relative to /, glob per component). The sandbox keeps running.
        """
        op = Commit(ref=ref, exclude=exclude or [], scrub_defaults=scrub_defaults)
        return await self._call(op, timeout=3600)

    # -- files ------------------------------------------------------------------------------

    async def read_stream(self, path: str) -> AsyncIterator[bytes]:
        """Yield a file's content in chunks, without holding it in memory."""
        async for chunk in self._t.stream(
            "GET", self._base + "/files/content", params=path_query("path", path)
        ):
            yield chunk

    async def read_file(self, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.read_stream(path)])

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileStat:
        if isinstance(data, str):
            data = data.encode()
        body = await self._t.request(
            "PUT",
            self._base + "/files/content",
            params={**path_query("path", path), "mode": f"{mode:o}"},
            data=data,
        )
        return FileStat.model_validate(body)

    async def upload(
        self, local_path: str | os.PathLike[str], path: str, *, mode: int | None = None
    ) -> FileStat:
        """Stream a local file into the sandbox (any size; it is never held in memory)."""
        local = Path(local_path)
        mode = ((await asyncio.to_thread(local.stat)).st_mode & 0o7777) if mode is None else mode

        body = await self._t.request(
            "PUT",
            self._base + "/files/content",
            params={**path_query("path", path), "mode": f"{mode:o}"},
            data=file_chunks(local),
        )
        return FileStat.model_validate(body)

    async def download(self, path: str, local_path: str | os.PathLike[str]) -> int:
        """Stream a sandbox file to a local path; returns the bytes written."""
        local = Path(local_path)
        tmp = local.with_name(local.name + ".part")
        written = 0
        fh = await asyncio.to_thread(tmp.open, "wb")
        try:
            async for chunk in self.read_stream(path):
                await asyncio.to_thread(fh.write, chunk)
                written += len(chunk)
            fh.close()
            await asyncio.to_thread(tmp.replace, local)
        finally:
            fh.close()
            await asyncio.to_thread(tmp.unlink, True)
        return written

    async def stat(self, path: str) -> FileStat:
        return await self._call(Stat(path=path))

    async def list_dir(self, path: str) -> list[FileStat]:
        return await self._call(ListDir(path=path))

    async def mkdir(self, path: str, *, parents: bool = True) -> FileStat:
        return await self._call(Mkdir(path=path, parents=parents))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._call(Remove(path=path, recursive=recursive))

    async def move(self, source: str, destination: str) -> FileStat:
        """Rename a file or directory inside the sandbox (replaces a file at ``destination``)."""
        return await self._call(Move(source=source, destination=destination))


class DSecClient(ProjectCalls, FnCalls, JobCalls, LayerCalls, VolumeCalls):
    """Connects to DSec: by default the local node that ``dsec up`` wrote into the config file."""

    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout: float = 300) -> None:
        self._url, self._api_key, self._timeout = url, api_key, timeout
        self._transport: Transport | None = None

    @property
    def _t(self) -> Transport:
        if self._transport is None:
            cfg = load_client_config(self._url, self._api_key)
            self._transport = Transport(cfg.url, cfg.api_key, timeout=self._timeout)
        return self._transport

    async def open(self) -> DSecClient:
        self._t.session()
        return self

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()

    async def __aenter__(self) -> DSecClient:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def run_container(self, args: DSecContainerRunArgs, timeout: float = 120) -> Sandbox:
        """Create a container sandbox and wait until it runs."""
        req = CreateRequest(spec=args.to_spec(), timeout=timeout)
        body = await self._t.request(
            "POST", "/v1/sandboxes", json_body=req.model_dump(mode="json"), timeout=timeout + 10
        )
        return Sandbox(self._t, SandboxInfo.model_validate(body))

    async def run_microvm(self, args: DSecMicroVMRunArgs, timeout: float = 300) -> Sandbox:
        """Create a microVM sandbox (its own kernel, the same layers) and wait until it runs."""
        return await self.run_container(args, timeout)

    async def run_vm(self, args: DSecVMRunArgs, timeout: float = 600) -> Sandbox:
        """Create a full VM (QEMU q35, a disk image of the layers, a display) and wait until it runs."""
        return await self.run_container(args, timeout)

    async def run_containers(
        self, args: DSecContainerRunArgs, count: int, timeout: float = 120
    ) -> builtins.list[Sandbox]:
        """Create ``count`` sandboxes of one kind in one request (all, or none and an error)."""
        req = BatchCreateRequest(spec=args.to_spec(), timeout=timeout, count=count)
        body = await self._t.request(
            "POST", "/v1/sandboxes/batch", json_body=req.model_dump(mode="json"), timeout=timeout + 10
        )
        return [Sandbox(self._t, SandboxInfo.model_validate(x)) for x in body]

    async def get(self, sandbox_id: str) -> Sandbox:
        body = await self._t.request("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self._t, SandboxInfo.model_validate(body))

    async def list(self, labels: dict[str, str] | None = None) -> list[Sandbox]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        body = await self._t.request("GET", "/v1/sandboxes", params=params)
        return [Sandbox(self._t, SandboxInfo.model_validate(x)) for x in body]

    async def build_layer(
        self,
        dockerfile: str | os.PathLike[str],
        context: str | os.PathLike[str],
        ref: str,
        *,
        base: builtins.list[str] | None = None,
        exclude: builtins.list[str] | None = None,
        memory_limit_mb: int = 4096,
        cpu_cores_limit: float = 2,
        step_timeout: float = 3600,
        progress: Callable[[BuildEvent], None] | None = None,
        network_rules: NetworkRules | None = None,
    ) -> LayerInfo:
        """Build layer ``ref`` from a Dockerfile subset (FROM, RUN, COPY, ENV, WORKDIR).

        ``dockerfile`` is its text, or a path to it; COPY reads from the ``context``
        directory. Steps run in a build sandbox on the FROM layers (or ``base``); the layer is
        what they changed, with caches, histories and ``exclude`` paths scrubbed. A failing
        step raises :class:`BuildFailed` with its output. ``network_rules`` are the build
        sandbox's network permissions (as at create; ``RUN --network=none`` steps run without
        them); none by default.
        """
        text = (
            await asyncio.to_thread(Path(dockerfile).read_text)
            if isinstance(dockerfile, os.PathLike)
            else dockerfile
        )
        args = DSecContainerRunArgs(
            layers=["placeholder"],
            memory_limit_mb=memory_limit_mb,
            cpu_cores_limit=cpu_cores_limit,
            network_rules=dict(network_rules or {}),
        )
        return await build_layer(
            self,
            text,
            Path(context),
            ref,
            base=base,
            exclude=exclude,
            args=args,
            progress=progress,
            step_timeout=step_timeout,
        )

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """The cluster's registered nodes with their epoch, health and load (admin keys only)."""
        body: builtins.list[dict[str, Any]] = await self._t.request("GET", "/v1/nodes")
        return body


__all__ = ["DSecClient", "ExecChunk", "Sandbox"]
