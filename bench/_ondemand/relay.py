"""A TCP relay that adds a fixed one-way delay in each direction (a stand-in for `tc netem`).

    python relay.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS MAX_SECONDS

This kernel is built without ``sch_netem`` (and without ``sch_fq``, so no EDT/BPF pacing
either); no qdisc it has can hold packets for a fixed time. The bench therefore runs this relay
in the server's network namespace, in front of sshd: every byte that crosses the veth has waited
``DELAY_MS`` on its way in and again on its way out, i.e. one round trip costs 2 x DELAY_MS.
Data is delayed, not throttled: a chunk is forwarded DELAY_MS after it was received, whatever
else is in flight, so pipelined requests overlap as on a real link.

It exits by itself after MAX_SECONDS, and when its parent dies (PR_SET_PDEATHSIG is set by the
bench before exec).
"""

from __future__ import annotations

import asyncio
import socket
import sys

_CHUNK = 256 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(_CHUNK)
            queue.put_nowait((loop.time() + delay, data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _serve(listen: tuple[str, int], target: tuple[str, int], delay: float, max_seconds: float) -> None:
    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        _nodelay(c_writer)
        _nodelay(s_writer)
        try:
            await asyncio.gather(_pump(c_reader, s_writer, delay), _pump(s_reader, c_writer, delay))
        finally:
            c_writer.close()
            s_writer.close()

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    print("ready", flush=True)
    async with server:
        await asyncio.sleep(max_seconds)


def main() -> None:
    lhost, lport, thost, tport, delay_ms, max_seconds = sys.argv[1:7]
    asyncio.run(_serve((lhost, int(lport)), (thost, int(tport)), float(delay_ms) / 1000, float(max_seconds)))


if __name__ == "__main__":
    main()
