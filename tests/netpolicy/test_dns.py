"""The sandboxes' name server answers only allowed names, and only queries."""

from __future__ import annotations

import struct

import pytest

from dsec.netpolicy import dns

NAMES = {"mirror.test": ["10.231.0.2", "10.231.0.3"]}


def query(name: str, qtype: int = dns.QTYPE_A, *, qid: int = 0x1234, flags: int = 0x0100) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, flags, 1, 0, 0, 0) + qname + struct.pack("!HH", qtype, 1)


def parse(resp: bytes) -> tuple[int, int, int, list[str]]:
    qid, flags, _qd, an, _ns, _ar = struct.unpack_from("!HHHHHH", resp)
    addresses = []
    pos = len(resp) - an * 16  # each answer: pointer, type, class, ttl, rdlength, 4 bytes
    for _ in range(an):
        ptr, qtype, qclass, _ttl, rdlen = struct.unpack_from("!HHHIH", resp, pos)
        assert (ptr, qtype, qclass, rdlen) == (0xC00C, dns.QTYPE_A, 1, 4)
        addresses.append(".".join(str(b) for b in resp[pos + 12 : pos + 16]))
        pos += 16
    return qid, flags, flags & 0xF, addresses


def test_an_allowed_name_resolves_to_its_configured_addresses() -> None:
    resp = dns.answer(query("Mirror.Test"), NAMES.get)
    assert resp is not None
    qid, flags, rcode, addresses = parse(resp)
    assert (qid, rcode, addresses) == (0x1234, 0, ["10.231.0.2", "10.231.0.3"])
    assert flags & 0x8000 and flags & 0x0100  # a response, recursion desired echoed


def test_any_other_name_does_not_exist() -> None:
    resp = dns.answer(query("pypi.org"), NAMES.get)
    assert resp is not None and parse(resp)[2] == dns.RCODE_NXDOMAIN


def test_other_record_types_of_an_allowed_name_have_no_data() -> None:
    resp = dns.answer(query("mirror.test", qtype=28), NAMES.get)  # AAAA
    assert resp is not None
    assert parse(resp)[2:] == (0, [])


@pytest.mark.parametrize(
    "bad",
    [
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x05abc",  # name runs past the end
        b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01",  # pointer loop
        b"\x12\x34\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x01",  # two questions
    ],
)
def test_malformed_queries_get_a_format_error(bad: bytes) -> None:
    resp = dns.answer(bad, NAMES.get)
    assert resp is not None and parse(resp)[2] == dns.RCODE_FORMERR


def test_responses_and_runts_get_nothing() -> None:
    assert dns.answer(query("mirror.test", flags=0x8100), NAMES.get) is None  # no reflection
    assert dns.answer(b"\x00\x01", NAMES.get) is None


def test_other_opcodes_are_not_implemented() -> None:
    resp = dns.answer(query("mirror.test", flags=0x2100), NAMES.get)  # opcode 4: NOTIFY
    assert resp is not None and parse(resp)[2] == dns.RCODE_NOTIMP
