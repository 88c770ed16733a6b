"""The name check at the edge: HAProxy, started and configured by the edge, between a sandbox
and every address it learned from a name.

An address admitted from an answer (:mod:`.names`) is often a CDN's, shared by thousands of
sites: letting the sandbox reach it on port 443 would open every one of them. So connections
to learned addresses on 443 and 80 are redirected by nftables (``redirect``, prerouting) to
HAProxy on the gateway, which reads the TLS ClientHello's server name (without terminating
TLS: it splices the bytes on, the sandbox's certificate checks are end to end) or the HTTP
``Host`` of every request, and lets the connection through to its original destination only
if that name is one the sandbox's grants allow (the map ``names.map``: ``|name|source`` keys,
``.suffix|source`` for a wildcard, matched at the end of ``|SNI|source``). An IP-literal
connect (no server name) or a name of another site is refused. Other ports of a rule are not
checked by name (nothing to read there) and go straight through, learned addresses only.

HAProxy rather than our own splice loop: it is well kept, splices in the kernel, and its maps
change at run time through its admin socket, so a grant is one ``add map`` line. One HAProxy
serves every sandbox of the edge; it outlives an edge restart (the next edge finds it by its
pid file and re-sends the map), and goes when the edge closes with no link left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from dsec.native import spawner
from dsec.protocol.errors import InfraFailure, InfraReason

log = logging.getLogger(__name__)

TLS_PORT = 16443  # on the gateway address, reached only through the redirect (ct status dnat)
HTTP_PORT = 16080
CHECKED = {443: TLS_PORT, 80: HTTP_PORT}  # a rule's port -> the frontend that checks it

_CONFIG = """\
global
  stats socket {sock} mode 600 level admin
  # One listener per port: a second HAProxy on the same address fails to start instead of
  # silently taking half of the connections (with its own, empty, map).
  noreuseport

defaults
  timeout connect 10s
  timeout client 1h
  timeout server 1h
  timeout tunnel 1h
  timeout http-request 15s

frontend tls
  mode tcp
  bind {gateway}:{tls} transparent
  tcp-request inspect-delay 10s
  tcp-request content reject unless {{ req.ssl_hello_type 1 }}
  tcp-request content set-var-fmt(txn.key) "|%[req.ssl_sni,lower]|%[src]"
  tcp-request content reject unless {{ var(txn.key),map_end({map}) -m found }}
  default_backend to_original_tcp

frontend web
  mode http
  bind {gateway}:{http} transparent
  http-request set-var-fmt(txn.key) "|%[req.hdr(host),field(1,:),lower]|%[src]"
  http-request deny deny_status 403 unless {{ var(txn.key),map_end({map}) -m found }}
  default_backend to_original_http

backend to_original_tcp
  mode tcp
  server original 0.0.0.0:0

backend to_original_http
  mode http
  server original 0.0.0.0:0
"""


def keys(domains: Iterable[str], source: str) -> set[str]:
    """The map keys that let ``source`` (a link's address) reach ``domains``."""
    return {(d[1:] if d.startswith("*.") else f"|{d}") + f"|{source}" for d in domains}


class SniProxy:
    """One HAProxy for the edge's sandboxes, its files under ``state_dir``."""

    def __init__(self, state_dir: Path, gateway: str) -> None:
        self.dir = state_dir / "sniproxy"
        self.gateway = gateway
        self.config = self.dir / "haproxy.cfg"
        self.map = self.dir / "names.map"
        self.sock = self.dir / "admin.sock"
        self.pidfile = self.dir / "haproxy.pid"
        self._keys: set[str] = set()

    async def start(self, wanted: set[str]) -> None:
        """Run HAProxy (or adopt the one an earlier edge left) with exactly ``wanted`` keys."""
        self.dir.mkdir(parents=True, exist_ok=True)
        text = _CONFIG.format(
            sock=self.sock, gateway=self.gateway, tls=TLS_PORT, http=HTTP_PORT, map=self.map
        )
        self._keys = set(wanted)
        self._write_map()
        pids = await asyncio.to_thread(self._running)
        if len(pids) == 1 and self.config.exists() and self.config.read_text() == text:
            await self._command("clear map " + str(self.map))
            for key in sorted(self._keys):
                await self._command(f"add map {self.map} {key} 1")
            return
        for pid in pids:
            await self._stop(pid)
        self.config.write_text(text)
        try:
            proc = await spawner.create_subprocess_exec(
                "haproxy", "-D", "-f", str(self.config), "-p", str(self.pidfile),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except FileNotFoundError as exc:
            raise InfraFailure(
                "haproxy (Debian's haproxy) is not installed", reason=InfraReason.network
            ) from exc
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise InfraFailure(
                f"haproxy did not start: {err.decode(errors='replace')[-600:]}", reason=InfraReason.network
            )

    async def update(self, old: set[str], new: set[str]) -> None:
        """A link's names changed: the running map and its file follow."""
        if old == new:
            return
        self._keys = (self._keys - old) | new
        self._write_map()
        for key in sorted(old - new):
            await self._command(f"del map {self.map} {key}")
        for key in sorted(new - old):
            await self._command(f"add map {self.map} {key} 1")

    async def close(self) -> None:
        for pid in await asyncio.to_thread(self._running):
            await self._stop(pid)
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()

    # -- internals --------------------------------------------------------------------------

    def _write_map(self) -> None:
        tmp = self.map.with_suffix(".tmp")
        tmp.write_text("".join(f"{k} 1\n" for k in sorted(self._keys)))
        os.replace(tmp, self.map)

    def _running(self) -> list[int]:
        """Every HAProxy started on this edge's configuration that still runs (found by its
        command line, so one whose pid file was lost is found too)."""
        mine = str(self.config).encode()
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"haproxy") and mine in argv and not _gone(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    @staticmethod
    async def _stop(pid: int) -> None:
        """End it and wait until it is gone (its ports are then free for the next one)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            if await asyncio.to_thread(_gone, pid):
                return
            await asyncio.sleep(0.025)  # a process that is not our child: nothing to wait on
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def _command(self, line: str) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.sock))
        except OSError as exc:
            raise InfraFailure(f"haproxy's admin socket: {exc}", reason=InfraReason.network) from exc
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            answer = (await reader.read(4096)).decode(errors="replace").strip()
        finally:
            writer.close()
        if answer and not answer.startswith(("Done", "Entry")):
            log.warning("haproxy %r: %s", line, answer)


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as gone: its sockets are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
