"""A merchant's webhook endpoint on loopback, for the tests: it records what it
accepts, and can be told to be down (503) or to hold every request until
released (a slow endpoint)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


class Receiver:
    def __init__(self) -> None:
        self.mode = "up"  # up | down | hold
        self.accepted: list[Received] = []
        self.refused = 0
        self.concurrent = 0
        self.most_concurrent = 0
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.concurrent += 1
                    receiver.most_concurrent = max(receiver.most_concurrent, receiver.concurrent)
                try:
                    if receiver.mode == "hold":
                        receiver.released.wait(60)
                    if receiver.mode == "down":
                        with receiver._lock:
                            receiver.refused += 1
                        self.send_response(503)
                    else:
                        headers = {k.lower(): v for k, v in self.headers.items()}
                        with receiver._lock:
                            receiver.accepted.append(Received(headers, body))
                        self.send_response(204)
                    self.send_header("content-length", "0")
                    self.end_headers()
                finally:
                    with receiver._lock:
                        receiver.concurrent -= 1

            def log_message(self, *_args: Any) -> None:
                pass

        return Handler

    def of_type(self, event_type: str, object_id: str | None = None) -> list[Received]:
        with self._lock:
            seen = list(self.accepted)
        return [
            r
            for r in seen
            if r.payload["type"] == event_type
            and (object_id is None or r.payload["data"]["id"] == object_id)
        ]

    def wait_for(self, what: Callable[[], Any], timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := what()):
            assert time.monotonic() < deadline, f"not received in {timeout} s: {self.accepted}"
            time.sleep(0.05)
        return found


@contextmanager
def receiving() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver._thread.start()
    try:
        yield receiver
    finally:
        receiver.released.set()
        receiver._server.shutdown()
        receiver._server.server_close()
