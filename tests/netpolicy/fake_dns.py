"""A fake upstream name server for the tests: a fixed zone, over UDP and TCP, counting queries.

In-process (``async with FakeDns(zone) as dns``) for unit tests on loopback, or as a process in
a test's network namespace: ``python -m tests.netpolicy.fake_dns ADDRESS PORT ZONE_JSON`` prints
``ready`` once it listens. A zone maps a name to records ``[type, value, ttl]`` (A, CNAME, TXT).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from collections.abc import Iterable
from types import TracebackType

import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

Zone = dict[str, list[tuple[str, str, int]]]


def respond(zone: Zone, wire: bytes) -> bytes:
    query = dns.message.from_wire(wire)
    reply = dns.message.make_response(query)
    q = query.question[0]
    name = q.name.to_text(omit_final_dot=True).lower()
    if name not in zone:
        reply.set_rcode(dns.rcode.NXDOMAIN)
        return reply.to_wire()
    for _ in range(8):  # follow CNAMEs within the zone, as a recursive resolver would
        records = zone.get(name, [])
        cname = [r for r in records if r[0] == "CNAME"]
        if cname:
            target = cname[0][1]
            reply.answer.append(_rrset(name, "CNAME", [target + "."], cname[0][2]))
            name = target
            continue
        wanted = [r for r in records if r[0] == dns.rdatatype.to_text(q.rdtype)]
        if wanted:
            values = [f'"{r[1]}"' if r[0] == "TXT" else r[1] for r in wanted]
            reply.answer.append(_rrset(name, wanted[0][0], values, wanted[0][2]))
        break
    return reply.to_wire()


def _rrset(name: str, rtype: str, values: Iterable[str], ttl: int) -> dns.rrset.RRset:
    return dns.rrset.from_text_list(
        dns.name.from_text(name), ttl, dns.rdataclass.IN, dns.rdatatype.from_text(rtype), list(values)
    )


class FakeDns(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone, address: str = "127.0.0.1", port: int = 0) -> None:
        self.zone, self.address, self.port = zone, address, port
        self.queries: list[str] = []
        self._transport: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # One port for UDP and TCP: a free UDP port may be taken for TCP; then try another.
        for _ in range(20):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((self.address, self.port))
            port = sock.getsockname()[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, self.address, port)
            except OSError:
                sock.close()
                if self.port:
                    raise
                continue
            self.port = port
            transport, _ = await loop.create_datagram_endpoint(lambda: self, sock=sock)
            self._transport = transport
            return
        raise OSError("no port free for both UDP and TCP")

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._note(data)
        assert self._transport is not None
        self._transport.sendto(respond(self.zone, data), addr)

    def _note(self, data: bytes) -> None:
        q = dns.message.from_wire(data).question[0]
        self.queries.append(f"{q.name.to_text(omit_final_dot=True)}/{dns.rdatatype.to_text(q.rdtype)}")

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (size,) = struct.unpack("!H", await reader.readexactly(2))
            data = await reader.readexactly(size)
            self._note(data)
            out = respond(self.zone, data)
            writer.write(struct.pack("!H", len(out)) + out)
            await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()

    async def __aenter__(self) -> FakeDns:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def _main(address: str, port: int, zone: Zone) -> None:
    server = FakeDns(zone, address, port)
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    raw = json.loads(sys.argv[3])
    asyncio.run(_main(sys.argv[1], int(sys.argv[2]), {k: [tuple(r) for r in v] for k, v in raw.items()}))
