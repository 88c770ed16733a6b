"""The mirror's file server: ``python -m tests.netpolicy.file_server ADDRESS PORT DIR [CERT KEY]``
serves DIR over HTTP, or over TLS (any server name) given a certificate and key, and prints
``ready`` once it listens.

Not ``python -m http.server``: its server_bind looks its own address up in reverse DNS
(socket.getfqdn), which in a fresh network namespace with no name server waits out the
resolver's timeouts, 10 s per server (the egress modules spent 40 s of setup there).
"""

from __future__ import annotations

import functools
import http.server
import socketserver
import ssl
import sys


class _Server(http.server.ThreadingHTTPServer):
    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


def main(address: str, port: int, directory: str, tls: list[str]) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=directory)
    server = _Server((address, port), handler)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*tls)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:6])
