"""A local HTTP server standing in for a Slack incoming webhook: it keeps every JSON body POSTed to it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Webhook:
    def __init__(self):
        self.posts: list[dict] = []
        self.release = threading.Event()  # cleared: the server holds each answer until it is set
        self.release.set()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts.append(json.loads(body))
                hook.release.wait(timeout=60)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts(self) -> list[str]:
        return [p["text"] for p in self.posts]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
