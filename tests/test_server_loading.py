"""What `hybrid serve` answers while the model loads (hybrid.server.loading): /health is a 503 with the loading
state and the load's progress bars, every other path a 503 "loading"; a port in use fails before the load."""

from __future__ import annotations

import http.client
import json
import socket

import pytest
from tqdm import tqdm

from hybrid.server.loading import LoadingServer


def _get(port: int, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return r.status, body


def test_health_says_loading_with_progress_until_stopped():
    srv = LoadingServer("127.0.0.1", 0).start()
    try:
        with tqdm(total=40, desc="loading model", unit="B", disable=False) as bar:
            bar.update(10)
            status, body = _get(srv.bound_port, "/health")
            assert status == 503 and body["status"] == "loading" and body["elapsed_s"] >= 0
            assert {"stage": "loading model", "done": 10.0, "total": 40.0, "unit": "B"} in body["progress"]
        status, body = _get(srv.bound_port, "/v1/models")
        assert status == 503 and body["error"]["code"] == "loading"
    finally:
        srv.stop()
    with pytest.raises(OSError):  # the port is free again: nothing answers
        socket.create_connection(("127.0.0.1", srv.bound_port), timeout=2).close()


def test_a_port_in_use_fails_before_the_load(monkeypatch, capsys):
    import hybrid.server.adapter
    from hybrid.cli import main

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(hybrid.server.adapter, "load_runtime", loaded)
    try:
        assert main(["serve", "--port", str(port)]) == 2
    finally:
        held.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]
