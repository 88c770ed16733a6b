"""The mirror's file server: ``python -m tests.netpolicy.file_server ADDRESS PORT DIR [CERT KEY]``
serves DIR over HTTP, or over TLS (any server name) given a certificate and key, and prints
``ready`` once it listens. ``GET /headers`` answers the request's headers as a JSON list of
``[name, value]`` (what the egress added to a request).

Not ``python -m http.server``: its server_bind looks its own address up in reverse DNS
(socket.getfqdn), which in a fresh network namespace with no name server waits out the
resolver's timeouts, 10 s per server (the egress modules spent 40 s of setup there).
"""

from __future__ import annotations

import functools
import http.server
import json
import socketserver
import ssl
import sys


class _Server(http.server.ThreadingHTTPServer):
    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/headers":
            return super().do_GET()
        body = json.dumps(list(self.headers.items())).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main(address: str, port: int, directory: str, tls: list[str]) -> None:
    handler = functools.partial(_Handler, directory=directory)
    server = _Server((address, port), handler)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*tls)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:6])
