"""A `serve` process for tests: started on a free port, waited for, stopped (tests/serve/ share it).

`start_server` runs `python -m flux_klein_mlx serve --model M --port P ARGS` offline and yields a ready
`Server` (its status, an OpenAI client with the test key); `http` is a plain request that never raises on
an HTTP error status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from command_line import free_port

KEY = "test-key-123"
ROOT = Path(__file__).resolve().parents[2]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
    """(status, parsed JSON or raw bytes) without raising on HTTP errors."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, data, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, data, ctype = e.code, e.read(), e.headers.get("content-type", "")
    return status, json.loads(data) if ctype.startswith("application/json") else data


class Server:
    def __init__(self, proc, port, save_dir):
        self.proc, self.port, self.save_dir = proc, port, save_dir
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {KEY}"}

    def status(self) -> dict:
        code, body = http("GET", self.url + "/v1/status", headers=self.auth, timeout=10)
        assert code == 200, body
        return body

    def client(self, **kw):
        import openai  # a test extra: the files that start a server skip without it

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=kw.pop("timeout", 120), **kw
        )

    def wait_idle(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st["waiting"] == 0 and not st["running"]:
                return st
            time.sleep(0.05)  # a status request is cheap: poll often, the deadline is what bounds the wait
        raise AssertionError("the server did not become idle")


def start_server(model, args, tmp_path_factory, save_dir=None, launcher=("-m", "flux_klein_mlx")):
    """`serve` in a subprocess on a free port; yields a ready `Server`, stops it afterwards."""
    port = free_port()
    cmd = [sys.executable, *launcher, "serve", "--model", str(model), "--port", str(port), *args]
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    srv = Server(proc, port, save_dir)
    srv.log = Path(log.name)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, "server exited: " + Path(log.name).read_text()
        try:
            if srv.status()["state"] == "ready":
                break
        except (OSError, AssertionError):
            pass
        assert time.monotonic() < deadline, "server not ready in 90 s: " + Path(log.name).read_text()
        time.sleep(0.05)  # ready is noticed within 50 ms (each of the suite's ~15 server starts waited up to 0.3 s)
    yield srv
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    log.close()
