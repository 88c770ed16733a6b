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

A host a sandbox has egress headers for (:mod:`.intercept`) is the one exception to "spliced
untouched": its TLS goes to the ``intercept`` frontend, which terminates and re-encrypts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import hashlib
import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from dsec.native import spawner
from dsec.netpolicy import intercept
from dsec.protocol.errors import InfraFailure, InfraReason

log = logging.getLogger(__name__)

TLS_PORT = 16443  # on the gateway address, reached only through the redirect (ct status dnat)
HTTP_PORT = 16080
CHECKED = {443: TLS_PORT, 80: HTTP_PORT}  # a rule's port -> the frontend that checks it

# What the name check decided, from HAProxy's own counters (``show stat``): (proxy, row, field)
# -> (kind, verdict). A frontend's denied requests (dreq) are what its deny rule refused: the
# TLS one's ``tcp-request content reject``, one per connection; the HTTP one's ``http-request
# deny``, one per request (a kept-alive connection may be refused several times). Its
# backend's sessions (stot) are what it let through: connections for TLS, requests for HTTP.
# Neither rule moves dcon or dses (connection and session rules, which the config has none
# of): measured on HAProxy 2.6.
STATS = {
    ("tls", "FRONTEND", "dreq"): ("tls", "refused"),
    ("to_original_tcp", "BACKEND", "stot"): ("tls", "granted"),
    ("web", "FRONTEND", "dreq"): ("http", "refused"),
    ("to_original_http", "BACKEND", "stot"): ("http", "granted"),
}
STATS_TIMEOUT_S = 1.0  # a scrape waits no longer for HAProxy's answer
_STATS_MAX = 1 << 20  # its answer is a few KiB (four rows): more is not HAProxy's

_CONFIG = """\
global
  stats socket {sock} mode 600 level admin
  lua-load {lua}
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
  tcp-request content set-var-fmt(txn.first) "%[var(txn.key)]#0"
  use_backend to_intercept if {{ var(txn.first),map({headers}) -m found }}
  default_backend to_original_tcp

frontend web
  mode http
  bind {gateway}:{http} transparent
  http-request set-var-fmt(txn.key) "|%[req.hdr(host),field(1,:),lower]|%[src]"
  http-request deny deny_status 403 unless {{ var(txn.key),map_end({map}) -m found }}
  http-request lua.dsec_headers plain
  default_backend to_original_http

# A host with egress headers: TLS ends here (a certificate for its name, signed by the node's
# CA) and starts again towards the original destination, which must prove the same name.
backend to_intercept
  mode tcp
  server intercept unix@{intercept_sock} send-proxy-v2

frontend intercept
  mode http
  bind unix@{intercept_sock} mode 600 accept-proxy {intercept_tls}
  http-request set-var-fmt(txn.key) "|%[ssl_fc_sni,lower]|%[src]"
  http-request lua.dsec_headers tls
  default_backend to_original_https

backend to_original_https
  mode http
  server original 0.0.0.0:0 ssl verify required ca-file {upstream_ca} sni ssl_fc_sni alpn http/1.1

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


# HAProxy binds ``<path>.<pid>.tmp`` and renames it: a socket path past about 97 bytes does not
# start (a data directory deep under a test's temporary directory did exactly that).
MAX_SOCKET_PATH = 80
SHORT_SOCKET_DIR = Path("/run/dsec")


def admin_socket_path(state: Path, name: str = "admin") -> Path:
    """The socket ``name`` of the proxy whose files are in ``state``: there, unless the path is
    too long for a Unix socket, then under /run/dsec named by a hash of ``state`` (one per node)."""
    path = state / f"{name}.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.fsencode(state.resolve())).hexdigest()[:20]
    return SHORT_SOCKET_DIR / f"haproxy-{digest}{'' if name == 'admin' else '-' + name}.sock"


class SniProxy:
    """One HAProxy for the edge's sandboxes, its files under ``state_dir``."""

    def __init__(
        self, state_dir: Path, gateway: str, upstream_ca: Path | None = None, node: str = "dsec"
    ) -> None:
        self.dir = state_dir / "sniproxy"
        self.gateway = gateway
        self.config = self.dir / "haproxy.cfg"
        self.map = self.dir / "names.map"
        self.headers_map = self.dir / "headers.map"
        self.lua = self.dir / "headers.lua"
        self.sock = admin_socket_path(self.dir)
        self.intercept_sock = admin_socket_path(self.dir, "intercept")
        self.pidfile = self.dir / "haproxy.pid"
        self.ca = intercept.NodeCa(self.dir, node)
        self.upstream_ca = upstream_ca or Path(intercept.SYSTEM_BUNDLE)
        self._keys: set[str] = set()
        self._headers: dict[str, str] = {}
        self._hosts: set[str] = set()  # hosts whose certificate the running HAProxy holds

    async def start(self, wanted: set[str], headers: dict[str, str] | None = None) -> None:
        """Run HAProxy (or adopt the one an earlier edge left) with exactly ``wanted`` keys and
        ``headers`` entries (:func:`.intercept.entries`)."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sock.parent.mkdir(parents=True, exist_ok=True)
        if not self.upstream_ca.is_file():  # HAProxy would not start, saying less
            raise InfraFailure(
                f"upstream_ca {self.upstream_ca} is not a file (the authorities egress headers'"
                " hosts are checked against; Debian's ca-certificates)",
                reason=InfraReason.network,
            )
        await asyncio.to_thread(self.ca.ensure)
        self.ca.hosts_dir.mkdir(mode=0o700, exist_ok=True)
        self.lua.write_text(intercept.LUA.format(map=self.headers_map))
        text = _CONFIG.format(
            sock=self.sock, gateway=self.gateway, tls=TLS_PORT, http=HTTP_PORT, map=self.map,
            lua=self.lua, headers=self.headers_map, intercept_sock=self.intercept_sock,
            upstream_ca=self.upstream_ca,
            intercept_tls=f"ssl crt {self.ca.default_file} crt {self.ca.hosts_dir} alpn http/1.1",
        )  # fmt: skip
        self._keys = set(wanted)
        self._headers = dict(headers or {})
        self._write_names()
        self._write_headers()
        pids = await asyncio.to_thread(self._running)
        self._hosts = {p.name.removesuffix(".pem") for p in self.ca.hosts_dir.glob("*.pem")}
        if len(pids) == 1 and self.config.exists() and self.config.read_text() == text:
            for path, entries in (
                (self.map, dict.fromkeys(self._keys, "1")),
                (self.headers_map, self._headers),
            ):
                await self._command(f"clear map {path}")
                for key, value in sorted(entries.items()):
                    await self._command(f"add map {path} {key} {value}")
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
        self._write_names()
        for key in sorted(old - new):
            await self._command(f"del map {self.map} {key}")
        for key in sorted(new - old):
            await self._command(f"add map {self.map} {key} 1")

    async def set_headers(self, old: dict[str, str], new: dict[str, str]) -> None:
        """A sandbox's header entries changed (:func:`.intercept.entries`): the map follows,
        after the proxy holds a certificate for each of their hosts."""
        if old == new:
            return
        for host in sorted({intercept.host_of(k) for k in new} - self._hosts):
            await self._add_certificate(host)
        self._headers = {k: v for k, v in self._headers.items() if k not in old} | new
        self._write_headers()
        for key in sorted(old):
            if key not in new:
                await self._command(f"del map {self.headers_map} {key}")
        for key, value in sorted(new.items()):
            if old.get(key) != value:
                verb = "set" if key in old else "add"
                await self._command(f"{verb} map {self.headers_map} {key} {value}")

    async def counts(self, timeout: float = STATS_TIMEOUT_S) -> dict[tuple[str, str], int]:
        """What the name check decided since HAProxy started, (kind, verdict) -> count (see
        :data:`STATS`); empty when it does not answer within ``timeout`` (not running, or being
        restarted): a figure missing, not an error."""
        try:
            text = await asyncio.wait_for(self._query("show stat -1 3 -1"), timeout)
        except (OSError, TimeoutError):
            return {}
        return parse_stats(text)

    async def close(self) -> None:
        for pid in await asyncio.to_thread(self._running):
            await self._stop(pid)
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()
        for sock in (self.sock, self.intercept_sock):
            if sock.parent != self.dir:  # the short name outside the node's files
                with contextlib.suppress(FileNotFoundError):
                    sock.unlink()

    # -- internals --------------------------------------------------------------------------

    def _write_names(self) -> None:
        _write_map_file(self.map, (f"{k} 1\n" for k in sorted(self._keys)))

    def _write_headers(self) -> None:
        _write_map_file(self.headers_map, (f"{k} {v}\n" for k, v in sorted(self._headers.items())))

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
            answer = (await self._query(line)).strip()
        except OSError as exc:
            raise InfraFailure(f"haproxy's admin socket: {exc}", reason=InfraReason.network) from exc
        if answer and not answer.startswith(("Done", "Entry")):
            # The verb, map and key only: a header entry's value may be a secret.
            log.warning("haproxy %r: %s", " ".join(line.split()[:4]), answer[:300])

    async def _add_certificate(self, host: str) -> None:
        """The running HAProxy holds a certificate for ``host`` (made if need be), or an
        InfraFailure says why; a file it did not take is removed (the next start loads what
        the directory holds)."""
        pem = (await asyncio.to_thread(self.ca.host_pem, host)).decode()
        path = self.ca.host_file(host)
        steps = (
            (f"new ssl cert {path}", "New empty certificate store"),
            (f"set ssl cert {path} <<\n{pem}", "Transaction created"),
            (f"commit ssl cert {path}", "Success!"),
            (f"add ssl crt-list {self.ca.hosts_dir} {path}", "Success!"),
        )
        try:
            for line, answer in steps:
                said = await self._query(line)
                if answer not in said:
                    raise InfraFailure(
                        f"haproxy took no certificate for {host}: {said.strip()[:300]}",
                        reason=InfraReason.network,
                    )
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise InfraFailure(f"haproxy's admin socket: {exc}", reason=InfraReason.network) from exc
        except InfraFailure:
            path.unlink(missing_ok=True)
            raise
        self._hosts.add(host)

    async def _query(self, line: str) -> str:
        """``line``'s whole answer: HAProxy closes the socket after it (not interactive mode)."""
        reader, writer = await asyncio.open_unix_connection(str(self.sock))
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            data = b""
            while len(data) < _STATS_MAX and (chunk := await reader.read(65536)):
                data += chunk
            return data.decode(errors="replace")
        finally:
            writer.close()


def parse_stats(text: str) -> dict[tuple[str, str], int]:
    """``show stat``'s CSV (a ``# pxname,svname,...`` header, a row per proxy and server) ->
    the :data:`STATS` it holds; rows or fields missing or not numbers are left out."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    out = {}
    with contextlib.suppress(csv.Error):
        for row in csv.DictReader([lines[0][2:], *lines[1:]]):
            for (proxy, svname, name), key in STATS.items():
                if row.get("pxname") == proxy and row.get("svname") == svname:
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        out[key] = int(row[name])
    return out


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as gone: its sockets are closed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _write_map_file(path: Path, lines: Iterable[str]) -> None:
    """A map file HAProxy loads at start, replaced whole; 0600: the headers map holds secrets."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(lines))
    os.replace(tmp, path)
