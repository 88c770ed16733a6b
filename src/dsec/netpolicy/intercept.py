"""Egress headers (``egress_headers``): the node's CA, and the proxy's header map.

A sandbox whose spec names headers for a host gets them on every request to that host: the
name check (:mod:`.sniproxy`) sends a TLS connection whose server name is such a host, from
such a sandbox, to a second HAProxy frontend that terminates it with a certificate for that
name signed by the node's CA (which the sandbox is given to trust: :data:`SANDBOX_CA_PATHS`),
sets the headers (a Lua action reading :data:`LUA`'s map), and re-encrypts to the original
destination, verifying the host's own certificate for that name
(``EgressConfig.upstream_ca``). Every other connection is spliced as before, end to end.

Plain HTTP to such a host gets, in the HTTP frontend, only the headers that hold no secret: there
nothing proves where the request goes (the sandbox picks the address and the ``Host``), and a
secret would cross the network in clear.

The certificates are made here, one per host, before the host's first header entry, and
handed to the running HAProxy (``add ssl crt-list``), not by HAProxy's own
``generate-certificates``: HAProxy 2.6 (Debian 12's) fails the first handshake of every name
it has not made a certificate for yet (measured: an empty reply, then success).

The secret goes only to a server proving it is the host (the upstream check), whatever the
sandbox puts in its ``Host`` header, and only to hosts its grants reach by name.

The map holds, per (host, sandbox address), one entry per header, ``|host|source#i`` -> the
hex of ``name NUL value``, and ``|host|source#pi`` for those plain HTTP gets (a map value is
one word; a CLI line stays within HAProxy's 16 KiB buffer: 64 + 2048 bytes at most, doubled).
It is written to a 0600 file under the edge's 0700 data directory (HAProxy reloads it if it
restarts alone).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path

from dsec.protocol.egress_headers import CA_BUNDLE, CA_ENV, filled, placeholders

CA_DAYS = 3650
LEAF_DAYS = 825
SANDBOX_CA_PATHS = (
    "/usr/local/share/ca-certificates/dsec-egress.crt",  # update-ca-certificates keeps it
    CA_ENV["NODE_EXTRA_CA_CERTS"],
)
SYSTEM_BUNDLE = CA_BUNDLE  # Debian's, appended to

LUA = """\
local headers = Map.new("{map}", Map._str)

local function unhex(s)
  return (s:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end))
end

-- Every header the map holds for this request's key (|host|source), set in order: all of
-- them on a connection whose TLS was ended here ("tls"), those without a secret on plain HTTP.
core.register_action("dsec_headers", {{ "http-req" }}, function(txn, kind)
  local key = txn:get_var("txn.key")
  if key == nil then return end
  local suffix = (kind == "tls") and "#" or "#p"
  local i = 0
  while i < 64 do
    local v = headers:lookup(key .. suffix .. i)
    if v == nil or v == "" then return end
    local pair = unhex(v)
    local sep = pair:find("\\0", 1, true)
    if sep == nil then return end
    txn.http:req_set_header(pair:sub(1, sep - 1), pair:sub(sep + 1))
    i = i + 1
  end
end, 1)
"""


def entries(
    headers: Mapping[str, Mapping[str, str]], secrets: Mapping[str, str], source: str
) -> dict[str, str]:
    """The map entries that give ``source`` (a link's address) ``headers`` (host -> header ->
    value, placeholders filled from ``secrets``)."""
    out = {}
    for host, hs in filled(headers, secrets).items():
        plain = 0
        for i, (name, value) in enumerate(hs.items()):
            entry = (name.encode() + b"\0" + value.encode()).hex()
            out[f"|{host}|{source}#{i}"] = entry
            if not placeholders(headers[host][name]):  # no secret in it: plain HTTP gets it too
                out[f"|{host}|{source}#p{plain}"] = entry
                plain += 1
    return out


def host_of(key: str) -> str:
    """The host of an :func:`entries` key."""
    return key.split("|")[1]


class NodeCa:
    """The node's egress CA and the proxy's default certificate, made once, kept in ``dir``."""

    def __init__(self, directory: Path, node: str) -> None:
        self.dir = directory
        self.node = node
        self.sign_file = directory / "ca.pem"  # certificate and key
        self.cert_file = directory / "ca.crt"  # the certificate alone: what sandboxes trust
        self.default_file = directory / "default.pem"  # the bind's certificate (never shown)
        self.hosts_dir = directory / "hosts"  # a certificate per host: <host>.pem

    def ensure(self) -> None:
        if self.sign_file.exists() and self.cert_file.exists() and self.default_file.exists():
            return
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"DSec egress CA ({self.node})"[:64])])
        ca = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        leaf_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsec-egress")]))
            .issuer_name(name)
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("dsec-egress")]), critical=False)
            .sign(key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        plain = serialization.NoEncryption()
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, plain)
        leaf_key_pem = leaf_key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL, plain)
        self.dir.mkdir(parents=True, exist_ok=True)
        _write(self.default_file, leaf.public_bytes(pem) + leaf_key_pem, 0o600)
        _write(self.sign_file, ca.public_bytes(pem) + key_pem, 0o600)
        _write(self.cert_file, ca.public_bytes(pem), 0o644)

    def certificate(self) -> bytes:
        return self.cert_file.read_bytes()

    def host_file(self, host: str) -> Path:
        return self.hosts_dir / f"{host}.pem"

    def host_pem(self, host: str) -> bytes:
        """A certificate for ``host`` signed by the CA, with its key (made and kept on first
        use; an EC key: a few milliseconds)."""
        path = self.host_file(host)
        if path.exists():
            return path.read_bytes()
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        signed = self.sign_file.read_bytes()
        ca = x509.load_pem_x509_certificate(signed)
        ca_key = serialization.load_pem_private_key(signed, password=None)
        assert isinstance(ca_key, rsa.RSAPrivateKey)  # ensure() made it
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(min(now + datetime.timedelta(days=LEAF_DAYS), ca.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        self.hosts_dir.mkdir(mode=0o700, exist_ok=True)
        _write(path, pem, 0o600)
        return pem


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
