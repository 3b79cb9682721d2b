"""A test server whose port is taken before it binds is started again on another port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import httpx

from .conftest import ServerProcess, lost_its_port

# A stand-in server: binds --host/--port as the real ones do, answers /health with 200.
HEALTH_SERVER = """
import argparse, http.server
ap = argparse.ArgumentParser(); ap.add_argument("--host"); ap.add_argument("--port", type=int)
args = ap.parse_args()
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""


def test_a_taken_port_is_recognised_from_the_log() -> None:
    assert lost_its_port("OSError: [Errno 98] Address already in use")
    assert lost_its_port("error while attempting to bind on address: address already in use")
    assert not lost_its_port("RuntimeError: model file not found")


def test_a_server_that_lost_its_port_comes_up_on_another(tmp_path: Path) -> None:
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess([sys.executable, str(script)], port, tmp_path / "server.log")
        try:
            server.wait_ready(30)
            assert server.port != port
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert f"port {port} was taken" in server.log()
        finally:
            server.stop()
