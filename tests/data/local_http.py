"""A localhost HTTP server over a temp folder, for download tests without network.

``http.server.SimpleHTTPRequestHandler`` ignores ``Range`` (always 200, whole file), so this handler
implements ``Range: bytes=N-`` itself, can be told to ignore it, to send the body chunked or to cut
a response short, and
logs every request (path, Range header, status, bytes of body sent).
"""

from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class ServerState:
    root: Path
    base_url: str = ""
    support_range: bool = True
    cut_after: int | None = None  # send only this many body bytes, then close (interrupted download)
    chunked: bool = False  # Transfer-Encoding: chunked (one chunk of the whole body), no Content-Length
    log: list[dict] = field(default_factory=list)

    def url(self, name: str) -> str:
        return f"{self.base_url}/{name}"


def _handler(state: ServerState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            path = state.root / self.path.lstrip("/")
            range_header = self.headers.get("Range")
            entry = {"path": self.path, "range": range_header, "status": None, "sent": 0}
            state.log.append(entry)
            if not path.is_file():
                entry["status"] = 404
                self.send_error(404, "Not Found")
                return
            data = path.read_bytes()
            start = 0
            match = re.fullmatch(r"bytes=(\d+)-", range_header or "")
            if state.support_range and match:
                start = int(match.group(1))
                if start >= len(data):
                    entry["status"] = 416
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                entry["status"] = 206
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                entry["status"] = 200
                self.send_response(200)
            body = data[start:]
            if state.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes" if state.support_range else "none")
            self.end_headers()
            if state.cut_after is not None:
                body = body[: state.cut_after]
                self.close_connection = True
            # recorded before writing: the client may have read the whole body (and the test checked the log)
            # before this thread runs again, so setting it afterwards would race under load
            entry["sent"] = len(body)
            if state.chunked:  # the chunk header promises the whole body; a cut leaves it short
                self.wfile.write(f"{len(data) - start:x}\r\n".encode() + body)
                if state.cut_after is None:
                    self.wfile.write(b"\r\n0\r\n\r\n")
            else:
                self.wfile.write(body)

    return Handler


@contextmanager
def serve_folder(root: Path):
    """Serve ``root`` on 127.0.0.1 (a free port) in a thread; yields the :class:`ServerState`."""
    state = ServerState(root=Path(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
