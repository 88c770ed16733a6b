"""A certificate authority of the test's own, and server certificates it signs (openssl's
command line), for fake upstreams served over HTTPS."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Authority:
    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path, name: str = "dsec test CA") -> Authority:
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / "ca.pem", directory / "ca.key"
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", str(key), "-out", str(cert),
        )  # fmt: skip
        return cls(cert, key)

    def issue(self, directory: Path, *names: str) -> tuple[Path, Path]:
        """A server certificate for ``names`` (DNS names or IP addresses): (cert, key)."""
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / names[0].replace("*", "star")
        cert, key, csr, ext = (stem.with_suffix(s) for s in (".pem", ".key", ".csr", ".ext"))
        alt = ",".join(f"IP:{n}" if n.replace(".", "").isdigit() else f"DNS:{n}" for n in names)
        ext.write_text(
            f"subjectAltName={alt}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
            "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
        )
        _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={names[0]}",
                 "-keyout", str(key), "-out", str(csr))  # fmt: skip
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
                 "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
        return cert, key


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx
