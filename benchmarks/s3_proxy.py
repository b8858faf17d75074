"""An HTTP proxy in front of an S3 endpoint that adds latency to every request and can drop or stall chosen
ones: what a distant region or a flaky network does to a job, reproduced against a local S3 server.

The benchmarks time the loader through it at 20 and 100 ms a request; the failure tests drop connections
and stall responses through it. Clients reach it as they reach the store, by pointing AWS_ENDPOINT_URL at
`proxy.url`. One connection to the store per request (the client's keep-alive connection stays open), so
the latency is paid per request, as on a real link where each request waits a round trip.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# What `fault(method, path)` may answer for a request: None (forward it), "drop" (close the connection without
# an answer), "stall" (hold it without an answer until the proxy stops, or `stall_s` passes) or "slowdown" (answer
# 503 SlowDown, as S3 throttles).
Fault = Callable[[str, str], str | None]
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


class S3Proxy:
    """Forwards to `upstream` (http://host:port) from a free port of 127.0.0.1; `latency_s`, `fault` and
    `stall_s` may change while it runs. `requests` counts what it received, `faults` what it dropped or stalled."""

    def __init__(self, upstream: str, latency_s: float = 0.0, fault: Fault | None = None, stall_s: float = 3600.0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.latency_s, self.fault, self.stall_s = latency_s, fault, stall_s
        self.requests = self.faults = 0
        self._count = threading.Lock()
        self._stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> S3Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()  # stalled requests end (dropped) instead of holding the shutdown
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _verdict(self, method: str, path: str) -> str | None:
        with self._count:
            self.requests += 1
        verdict = self.fault(method, path) if self.fault else None
        if verdict not in (None, "drop", "stall", "slowdown"):
            raise ValueError(f"fault({method} {path}) gave {verdict!r}: None, 'drop', 'stall' or 'slowdown'")
        if verdict:
            with self._count:
                self.faults += 1
        return verdict


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Clients open many connections at once (start-up reads footers with 64 threads); socketserver's default
    # backlog of 5 would drop their SYNs, each then retried a second later: a stall no store has.
    request_queue_size = 128


def _handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive with the client, as an S3 endpoint speaks

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            verdict = proxy._verdict(self.command, self.path)
            if verdict == "stall":
                proxy._stopping.wait(proxy.stall_s)
            if verdict == "slowdown":
                self._answer(503, "Slow Down", SLOW_DOWN)
                return
            if verdict:
                self.close_connection = True
                return  # the client sees its connection closed with no answer
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            upstream = http.client.HTTPConnection(*proxy.upstream, timeout=300)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
            finally:
                upstream.close()
            self.send_response_only(answer.status, answer.reason)
            head = self.command == "HEAD"  # a HEAD answer's Content-Length is the object's size: passed on
            for key, value in answer.getheaders():
                if key.lower() not in HOP_BY_HOP and (head or key.lower() != "content-length"):
                    self.send_header(key, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _answer(self, status: int, reason: str, body: bytes) -> None:
            self.send_response_only(status, reason)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Forward
