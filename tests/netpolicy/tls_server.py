"""An HTTPS file server for the mirror: ``python -m tests.netpolicy.tls_server ADDRESS PORT DIR
CERT KEY`` serves DIR over TLS (any server name) and prints ``ready`` once it listens."""

from __future__ import annotations

import functools
import http.server
import ssl
import sys


def main(address: str, port: int, directory: str, cert: str, key: str) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
    server = http.server.ThreadingHTTPServer((address, port), handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
