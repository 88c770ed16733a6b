"""A connection opened to an address learned from an answer outlives the answer (as Cilium's
toFQDNs policies: established flows stay accepted), on a port the edge does not check by name
(8080: no HAProxy in between, the kernel's sets alone decide); a new connection after the
expiry is refused, and a revoke cuts the established one too."""

from __future__ import annotations

import json

from dsec.sdk.client import Sandbox
from tests.conftest import Sandboxes
from tests.e2e.test_egress import probe, the_mirror  # noqa: F401 (a fixture)
from tests.netpolicy import mirror
from tests.support import eventually

WEB = [mirror.ADDRESS, mirror.PORT]

# Inside the sandbox, in the background: resolve, connect, say so, wait for /tmp/go, then send
# a request on that connection and write what came back (the body, or how it was cut).
HELD = r"""
import json, os, socket, sys, time
address = socket.gethostbyname(sys.argv[1])
held = socket.create_connection((address, int(sys.argv[2])), timeout=10)
open("/tmp/connected", "w").close()
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)  # the test's signal: a file it writes
try:
    held.sendall(b"GET /hello.txt HTTP/1.0\r\nHost: x\r\n\r\n")
    data = b""
    while chunk := held.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    out = body.decode() if b" 200 " in head.split(b"\r\n")[0] else "refused: " + head[:40].decode()
except OSError as e:
    out = "cut: " + type(e).__name__
with open("/tmp/result.tmp", "w") as f:
    json.dump(out, f)
os.rename("/tmp/result.tmp", "/tmp/result")
"""


async def hold_a_connection(sb: Sandbox) -> None:
    await sb.write_file("/tmp/held.py", HELD.encode())
    await sb.run_shell(f"nohup python3 /tmp/held.py {mirror.DNS_NAME} {mirror.PORT} >/tmp/held.log 2>&1 &")

    async def connected() -> bool:
        return (await sb.run_shell("test -e /tmp/connected")).exit_code == 0

    await eventually(connected, "the sandbox's connection to the learned address", 60)


async def result_of_held(sb: Sandbox) -> str:
    await sb.write_file("/tmp/go", b"")

    async def result() -> str | None:
        r = await sb.run_shell("cat /tmp/result 2>/dev/null")
        return r.stdout if r.exit_code == 0 else None

    out: str = json.loads(await eventually(result, "the held connection's answer", 60))
    return out


async def test_an_established_connection_outlives_the_answer_s_ttl_a_new_one_does_not(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    await hold_a_connection(sb)

    # The answer's TTL ends (the test node adds no grace): new connections are refused...
    async def expired() -> bool:
        return not (await probe(sb, connect=[WEB]))["open"]

    await eventually(expired, "the learned address to expire", 120)
    # ... while the one opened before goes on working.
    assert await result_of_held(sb) == mirror.BODY
    assert (await probe(sb, connect=[WEB]))["open"] == []


async def test_a_revoke_cuts_an_established_connection_to_a_learned_address(
    the_mirror: None,  # noqa: F811
    make_sandbox: Sandboxes,
) -> None:
    sb = await make_sandbox(network_rules={"mirror-dns": True})
    await hold_a_connection(sb)
    await sb.set_network_rules({"mirror-dns": False})
    assert (await result_of_held(sb)).startswith("cut: ")
