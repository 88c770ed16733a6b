"""The sandboxes' name server: it answers only for names their permissions allow.

One UDP socket on the gateway address serves every link. Which sandbox asks is read from the
interface the query arrived on (``IP_PKTINFO``), not from its source address, so a sandbox
that spoofs a neighbour's address learns nothing more (the firewall also drops spoofed
sources). Nothing is forwarded upstream: an allowed name resolves to the address the operator
configured, any other name does not exist. Queries over TCP are not served (answers are a
few addresses, far below the 512-byte UDP limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

IP_PKTINFO = 8  # <linux/in.h>; Python's socket module lacks it
IP_FREEBIND = 15  # bind the gateway address before any link carries it
_PKTINFO = struct.Struct("=i4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr

QTYPE_A = 1
RCODE_FORMERR, RCODE_NXDOMAIN, RCODE_NOTIMP, RCODE_REFUSED = 1, 3, 4, 5
TTL_S = 30

Lookup = Callable[[str], list[str] | None]  # name -> addresses, None: no such name here


def _question(msg: bytes) -> tuple[str, int, int, int] | None:
    """(name, qtype, qclass, end offset) of the single question, or None if malformed."""
    labels, pos = [], 12
    while True:
        if pos >= len(msg):
            return None
        n = msg[pos]
        pos += 1
        if n == 0:
            break
        if n & 0xC0 or pos + n > len(msg):  # no compression in a question; no overruns
            return None
        labels.append(msg[pos : pos + n].decode("ascii", errors="replace").lower())
        pos += n
    if pos + 4 > len(msg) or sum(len(x) + 1 for x in labels) > 255:
        return None
    qtype, qclass = struct.unpack_from("!HH", msg, pos)
    return ".".join(labels), qtype, qclass, pos + 4


def answer(query: bytes, lookup: Lookup) -> bytes | None:
    """The response to one DNS query (None: not a query worth answering)."""
    if len(query) < 12:
        return None
    qid, flags, qdcount = struct.unpack_from("!HHH", query)
    if flags & 0x8000:
        return None  # a response, not a query: never answer (no reflection loops)
    opcode, rd = (flags >> 11) & 0xF, flags & 0x0100

    def reply(rcode: int, question: bytes = b"", answers: list[str] | None = None) -> bytes:
        out_flags = 0x8000 | (opcode << 11) | 0x0400 | rd | rcode
        body = b"".join(
            struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, TTL_S, 4) + ipaddress.IPv4Address(a).packed
            for a in answers or []
        )
        counts = (1 if question else 0, len(answers or []), 0, 0)
        return struct.pack("!HHHHHH", qid, out_flags, *counts) + question + body

    if opcode != 0:
        return reply(RCODE_NOTIMP)
    q = _question(query) if qdcount == 1 else None
    if q is None:
        return reply(RCODE_FORMERR)
    name, qtype, qclass, end = q
    question = query[12:end]
    if qclass != 1:
        return reply(RCODE_REFUSED, question)
    addresses = lookup(name)
    if addresses is None:
        return reply(RCODE_NXDOMAIN, question)
    return reply(0, question, addresses if qtype == QTYPE_A else [])  # AAAA etc.: no data


class NameServer:
    """Serves ``lookup(ifindex)`` (the names of the sandbox behind that interface) on
    ``address``:``port`` from the running event loop."""

    def __init__(self, address: str, lookup: Callable[[int], Lookup | None], *, port: int = 53) -> None:
        self.address, self.port = address, port
        self._lookup = lookup
        self._sock: socket.socket | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            sock.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)
            sock.bind((self.address, self.port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        assert self._sock is not None
        for _ in range(64):  # a burst at a time, then let the loop breathe
            try:
                data, ancillary, _, peer = self._sock.recvmsg(512, socket.CMSG_SPACE(_PKTINFO.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("name server: %s", exc)
                return
            ifindex = next(
                (
                    _PKTINFO.unpack(d[: _PKTINFO.size])[0]
                    for level, kind, d in ancillary
                    if level == socket.SOL_IP and kind == IP_PKTINFO and len(d) >= _PKTINFO.size
                ),
                None,
            )
            names = self._lookup(ifindex) if ifindex is not None else None
            if names is None:
                continue  # not from a link of ours: say nothing
            response = answer(data, names)
            if response is not None:
                try:
                    self._sock.sendto(response, peer)
                except OSError as exc:
                    log.debug("name server reply to %s: %s", peer, exc)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
