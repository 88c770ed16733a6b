"""The sandboxes' name server: it answers only for names their permissions allow.

One UDP socket and one TCP listener on the gateway address serve every link. Which sandbox
asks is read from the interface a datagram arrived on (``IP_PKTINFO``), not from its source
address, so a sandbox that spoofs a neighbour's address learns nothing more; a TCP peer is
known by its address, which the firewall guarantees is its link's own. What to answer is the
link's responder's business (:meth:`dsec.netpolicy.policy.EgressPolicy`): a name of a fixed
endpoint resolves to the address the operator configured (:func:`answer`), a name of a domain
rule is resolved upstream (:func:`forwarded`), any other name does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

log = logging.getLogger(__name__)

IP_PKTINFO = 8  # <linux/in.h>; Python's socket module lacks it
IP_FREEBIND = 15  # bind the gateway address before any link carries it
_PKTINFO = struct.Struct("=i4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr

QTYPE_A = 1
RCODE_FORMERR, RCODE_NXDOMAIN, RCODE_NOTIMP, RCODE_REFUSED = 1, 3, 4, 5
_DENIED = (RCODE_NXDOMAIN, RCODE_REFUSED)  # what a name outside a sandbox's permissions gets
TTL_S = 30

Lookup = Callable[[str], list[str] | None]  # name -> addresses, None: no such name here
Responder = Callable[[bytes], Awaitable[bytes | None]]  # one link's answers to its queries
MAX_TCP_MESSAGE = 4096  # a question is a few dozen bytes; nothing longer is a query of ours
_MAX_INFLIGHT = 256  # queries being answered at once, across links (upstream waits included)


def question(query: bytes) -> tuple[str, int] | None:
    """(name, qtype) of a well-formed standard query for class IN, else None."""
    if len(query) < 12:
        return None
    _, flags, qdcount = struct.unpack_from("!HHH", query)
    if flags & 0x8000 or (flags >> 11) & 0xF or qdcount != 1:
        return None
    q = _question(query)
    if q is None or q[2] != 1:
        return None
    return q[0], q[1]


def forwarded(
    query: bytes, rcode: int, chain: list[tuple[str, str]], addresses: list[str], ttl: int
) -> bytes:
    """The answer to ``query`` (already known to be a well-formed A question): the CNAME chain
    and the addresses at its end, nothing else of what upstream said."""
    try:
        msg = dns.message.from_wire(query)
        reply = dns.message.make_response(msg, recursion_available=True)
    except dns.exception.DNSException:
        return answer(query, lambda _name: None) or b""
    reply.set_rcode(dns.rcode.Rcode(rcode))
    owner = msg.question[0].name
    for name, target in chain:
        rr = dns.rrset.from_text(
            dns.name.from_text(name), ttl, dns.rdataclass.IN, dns.rdatatype.CNAME, target + "."
        )
        reply.answer.append(rr)
        owner = dns.name.from_text(target)
    if addresses:
        reply.answer.append(
            dns.rrset.from_text_list(owner, ttl, dns.rdataclass.IN, dns.rdatatype.A, addresses)
        )
    return reply.to_wire()


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
    """Serves each link's queries on ``address``:``port`` (UDP and TCP) from the running event
    loop: ``by_ifindex`` and ``by_address`` give the responder of the link a query came from,
    None for anything that is not a link of ours (never answered)."""

    def __init__(
        self,
        address: str,
        by_ifindex: Callable[[int], Responder | None],
        by_address: Callable[[str], Responder | None],
        *,
        port: int = 53,
    ) -> None:
        self.address, self.port = address, port
        self._by_ifindex, self._by_address = by_ifindex, by_address
        self._sock: socket.socket | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Answers by verdict (granted: an answer; denied: NXDOMAIN or REFUSED, what a name
        # outside the sandbox's permissions gets), for the edge's metrics (observe/).
        self.answers: Counter[str] = Counter()

    def _count(self, response: bytes) -> None:
        rcode = response[3] & 0x0F if len(response) > 3 else RCODE_FORMERR
        self.answers["granted" if rcode == 0 else "denied" if rcode in _DENIED else "error"] += 1

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            for s in (sock, listener):
                s.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            # TCP only: a restarted edge rebinds past TIME_WAIT. On UDP the same option would
            # let a second edge share the port and take some of the first one's queries.
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)
            sock.bind((self.address, self.port))
            sock.setblocking(False)
            listener.bind((self.address, self.port))
            listener.setblocking(False)
            self._tcp = await asyncio.start_server(self._serve_tcp, sock=listener, limit=MAX_TCP_MESSAGE + 2)
        except OSError:
            sock.close()
            listener.close()
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
            respond = self._by_ifindex(ifindex) if ifindex is not None else None
            if respond is None or len(self._tasks) >= _MAX_INFLIGHT:
                continue  # not from a link of ours (say nothing), or too busy (the client retries)
            self._spawn(self._answer_udp(respond, data, peer))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_udp(self, respond: Responder, data: bytes, peer: tuple[str, int]) -> None:
        try:
            response = await respond(data)
        except Exception:
            log.exception("name server: answering a query")
            return
        if response is None or self._sock is None:
            return
        self._count(response)
        if len(response) > 512:
            response = _truncated(response)  # the client asks again over TCP
        try:
            self._sock.sendto(response, peer)
        except OSError as exc:
            log.debug("name server reply to %s: %s", peer, exc)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        respond = self._by_address(peer[0]) if peer else None
        try:
            if respond is None:
                return
            for _ in range(16):  # a few queries per connection, then the client reconnects
                head = await asyncio.wait_for(reader.readexactly(2), 10)
                (size,) = struct.unpack("!H", head)
                if not 12 <= size <= MAX_TCP_MESSAGE:
                    return
                data = await asyncio.wait_for(reader.readexactly(size), 10)
                response = await respond(data)
                if response is None:
                    return
                self._count(response)
                writer.write(struct.pack("!H", len(response)) + response)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            writer.close()

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        for task in self._tasks:
            task.cancel()


def _truncated(response: bytes) -> bytes:
    msg = dns.message.from_wire(response)
    msg.answer, msg.authority, msg.additional = [], [], []
    msg.flags |= dns.flags.TC
    return msg.to_wire()
