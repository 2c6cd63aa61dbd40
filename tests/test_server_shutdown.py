"""Shutdown, disconnects and hostile inputs that once hurt the whole server.

In-process (the fake engine of hybrid.server.testing, stopped through run_server's `stop` as a signal
would): a shutdown stops accepting, lets requests finish within the grace period and then ends the rest
with a 503 (streams: an error event); clients that leave are cancelled without a traceback in the log;
too many chat messages get a 400. In subprocesses, only what needs real signals or a real command line:
`hybrid serve` on the demo checkpoint under SIGTERM (and a second signal), a model name that is not
UTF-8, and `bench.serve_load --spawn` killed with its server child running.
"""

import asyncio
import http.client
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybrid.server.app import build_app, run_server
from hybrid.server.config import ServerConfig
from hybrid.server.routes import STATE
from hybrid.server.testing import fake_runtime

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180  # importing torch + building the demo checkpoint on a cold 2-core runner
EXIT_BOUND_S = 15  # a shutdown must end within this (it used to take 122 s with a stream in flight)


class InProcessServer:
    """The app on 127.0.0.1:<free port>, its event loop in a background thread."""

    def __init__(self, runtime, name="fake", **config):
        self.runtime = runtime
        cfg = ServerConfig(port=0, max_batch=runtime.max_batch, max_context=runtime.max_context, **config)
        self.app = build_app(cfg, runtime, name)
        self._loop = asyncio.new_event_loop()
        self._stop = None
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self._loop)
            self._stop = asyncio.Event()

            def announce(host, port):
                self.port = port
                ready.set()

            self._loop.run_until_complete(run_server(self.app, "127.0.0.1", 0, announce, stop=self._stop))
            self._loop.close()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert ready.wait(10), "server did not start"

    def stop(self):
        """What the first SIGTERM does."""
        self._loop.call_soon_threadsafe(self._stop.set)

    def close(self):
        self.runtime.engine.gate.set()
        if self.thread.is_alive():
            self.stop()
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server did not stop"

    def health(self):
        return json.loads(get(self.port, "/health")[2])


@pytest.fixture
def make_server():
    servers = []

    def make(runtime=None, name="fake", **config):
        servers.append(InProcessServer(runtime or fake_runtime(max_batch=2, max_context=128), name, **config))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def get(port, path, conn=None):
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    c.request("GET", path)
    r = c.getresponse()
    return r.status, dict(r.getheaders()), r.read().decode()


def post(port, path, body, conn=None):
    """-> (status, parsed JSON body)."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    c.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read())


def request_bytes(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def open_stream(port, body, path="/v1/completions", events=1):
    """A streaming request on a raw socket, once `events` SSE events arrived -> (socket, bytes so far)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(request_bytes(path, {**body, "stream": True}))
    got = b""
    while got.count(b"data: ") < events:
        more = s.recv(65536)
        assert more, f"connection closed early: {got!r}"
        got += more
    return s, got


def read_to_close(s) -> bytes:
    got = b""
    while more := s.recv(65536):
        got += more
    s.close()
    return got


def sse_payloads(raw: bytes) -> list:
    """The data of each SSE event (JSON decoded, "[DONE]" as is) in a chunked HTTP response."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_until(cond, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def refused(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # queued in the backlog as the listener closed: not refused yet, ask again
        return False


# --- shutdown, in process ---------------------------------------------------------------------------

def test_shutdown_ends_requests_still_running_after_the_grace(make_server):
    srv = make_server(shutdown_grace_s=0.2)
    srv.runtime.engine.gate.clear()  # the engine blocks inside its first model call, as in a long step
    stream, _ = open_stream(srv.port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
                            path="/v1/chat/completions")  # (chat: the role chunk comes before any token)
    plain = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    plain.sendall(request_bytes("/v1/completions", {"prompt": "hello", "max_tokens": 50}))
    wait_until(lambda: srv.health()["waiting"] == 1, "both requests to be queued")
    srv.stop()
    streamed = sse_payloads(read_to_close(stream))
    assert streamed[-2]["error"]["code"] == "unavailable" and "shutting down" in streamed[-2]["error"]["message"]
    assert streamed[-1] == "[DONE]"
    head, _, body = read_to_close(plain).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "unavailable"
    srv.runtime.engine.gate.set()
    srv.thread.join(10)
    assert not srv.thread.is_alive()  # run_server returned: connections closed, engine thread stopped
    assert not srv.app[STATE].scheduler.alive


def test_shutdown_stops_accepting_and_lets_requests_finish_within_the_grace(make_server):
    srv = make_server(shutdown_grace_s=30)
    kept = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=15)
    assert get(srv.port, "/health", conn=kept)[0] == 200  # a kept-alive connection, idle
    srv.runtime.engine.gate.clear()
    stream, _ = open_stream(srv.port, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                       "temperature": 0}, path="/v1/chat/completions")
    srv.stop()
    wait_until(lambda: refused(srv.port), "the listening socket to close")
    status, body = post(srv.port, "/v1/completions", {"prompt": "late", "max_tokens": 2}, conn=kept)
    assert status == 503 and "shutting down" in body["error"]["message"]
    srv.runtime.engine.gate.set()  # the request in flight finishes well within the grace
    streamed = sse_payloads(read_to_close(stream))
    assert streamed[-1] == "[DONE]" and not any("error" in p for p in streamed[:-1])
    assert streamed[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    srv.thread.join(10)
    assert not srv.thread.is_alive()  # and the server then exits without waiting out the 30 s


# --- disconnects ------------------------------------------------------------------------------------

def test_clients_that_leave_are_cancelled_quietly_and_free_their_slots(make_server, caplog):
    caplog.set_level(logging.DEBUG)
    srv = make_server(fake_runtime(max_batch=2, max_context=128, step_delay_s=0.01))
    long_one = {"prompt": "hello", "max_tokens": 100, "temperature": 0}
    for body in (long_one, {**long_one, "stream": True},
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        raw = request_bytes(path, body)
        for cut, linger in ((len(raw) - 3, 0), (len(raw), 0), (len(raw), 0.1)):
            # part of the body, then gone; all of it and gone at once; gone during generation
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(raw[:cut])
            time.sleep(linger)
            s.close()
    wait_until(lambda: srv.health()["free_slots"] == 2 and srv.health()["waiting"] == 0, "slots to be freed")
    assert post(srv.port, "/v1/completions", {"prompt": "still fine", "max_tokens": 3})[0] == 200
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert "Traceback" not in caplog.text


# --- hostile message counts -------------------------------------------------------------------------

def test_too_many_chat_messages_get_a_400_naming_the_limit(make_server):
    srv = make_server()
    status, body = post(srv.port, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": ""}] * 25_000, "max_tokens": 1})
    assert status == 400
    err = body["error"]
    assert err["param"] == "messages" and err["code"] == "array_above_max_length"
    assert "25000" in err["message"] and "2048" in err["message"] and "--max-messages" in err["message"]
    assert srv.health()["status"] == "ok"


def test_the_message_limit_is_configurable_and_inclusive(make_server):
    srv = make_server(max_messages=3)
    three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert post(srv.port, "/v1/chat/completions", {"messages": three, "max_tokens": 2})[0] == 200
    status, body = post(srv.port, "/v1/chat/completions", {"messages": three + three[:1], "max_tokens": 2})
    assert status == 400 and "at most 3" in body["error"]["message"]


# --- the served model name --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bad\udcffname", "two\nlines", ""])
def test_served_model_name_must_be_printable_utf8(name):
    with pytest.raises(ValueError, match="--served-model-name"):
        ServerConfig(served_model_name=name)


def test_a_printable_non_ascii_model_name_is_served():
    assert ServerConfig(served_model_name="modèle-ü 2").served_model_name == "modèle-ü 2"


def _serve_cli(args, env=None):
    cmd = [sys.executable.encode(), b"-m", b"hybrid", b"serve", b"--port", b"0", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, timeout=60,
                          env=dict(os.environ, HYBRID_NO_PROGRESS="1", **(env or {})))


def test_cli_refuses_a_model_name_that_is_not_utf8_in_one_line():
    r = _serve_cli([b"--served-model-name", b"bad\xffname"])  # bytes argv: Python sees a lone surrogate
    err = r.stderr.decode(errors="replace").strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--served-model-name" in err and "UTF-8" in err


def test_cli_refuses_a_model_directory_name_that_cannot_be_the_model_id(tmp_path):
    from hybrid.runtime.demo import demo_checkpoint

    demo = demo_checkpoint()
    model = os.path.join(os.fsencode(tmp_path), b"model\tname")  # the default id: the directory's name
    os.mkdir(model)
    for f in demo.iterdir():  # (copies: the loader refuses links that lead out of the directory)
        shutil.copyfile(f, os.path.join(model, os.fsencode(f.name)))
    r = _serve_cli([b"--model", model, b"--max-context", b"64", b"--max-batch", b"1"])
    last = r.stderr.decode(errors="replace").strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr.decode(errors="replace"), r.stderr
    assert "--served-model-name" in last and "control" in last


# --- `hybrid serve` under signals -------------------------------------------------------------------

def _start_cli(tmp_path, *args):
    """`hybrid serve --port 0 ...` on the demo -> (process, port, stderr path) once it listens."""
    log = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "hybrid", "serve", "--port", "0", "--max-batch", "2", "--max-context", "1024",
           *args]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, HYBRID_NO_PROGRESS="1"),
                                stdout=subprocess.PIPE, stderr=err, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        line = ""
    if "listening on http://127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"server did not start: {line!r}\n{log.read_text()[-3000:]}", pytrace=False)
    return proc, int(line.split("127.0.0.1:")[1].split()[0]), log


# Greedy decoding of this prompt on the demo runs to max_tokens (no early EOS), i.e. many seconds on a CPU.
LONG_STREAM = {"prompt": "hello", "max_tokens": 1000, "temperature": 0}


def _wait_exit(proc, timeout=EXIT_BOUND_S):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the server was still running {timeout} s after the signal", pytrace=False)


def test_sigterm_ends_a_long_stream_with_an_error_event_and_exits_0(tmp_path):
    proc, port, log = _start_cli(tmp_path, "--shutdown-grace", "0.5")
    try:
        stream, _ = open_stream(port, LONG_STREAM, events=3)
        proc.send_signal(signal.SIGTERM)
        rc = _wait_exit(proc)
        streamed = sse_payloads(read_to_close(stream))
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert rc == 0 and "Traceback" not in err, err
    assert "error" in streamed[-2], f"the stream was not ended by the shutdown (did LONG_STREAM stop early?): " \
        f"{streamed[-3:]}"
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "unavailable", streamed[-3:]
    assert "SIGTERM" in err


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_exits_at_once_without_a_traceback(tmp_path, second):
    proc, port, log = _start_cli(tmp_path, "--shutdown-grace", "600")
    try:
        stream, _ = open_stream(port, LONG_STREAM, events=3)
        proc.send_signal(signal.SIGINT)  # the first: drain for up to 600 s
        wait_until(lambda: "SIGINT" in log.read_text(), "the server to start draining")
        proc.send_signal(second)  # the second: now (a second Ctrl-C used to raise KeyboardInterrupt)
        rc = _wait_exit(proc)
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert rc == -second and "Traceback" not in err, err


# --- bench.serve_load --spawn -----------------------------------------------------------------------

def _alive(pid) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_serve_load_killed_by_sigterm_reaps_its_server(tmp_path):
    cmd = [sys.executable, "-m", "bench.serve_load", "--spawn", "--max-batch", "2", "--max-context", "1024",
           "--clients", "2", "--requests", "100", "--max-tokens", "500", "--json", str(tmp_path / "out.json")]
    load = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HYBRID_NO_PROGRESS="1"))
    child = None
    try:
        for line in load.stdout:  # "# spawned `hybrid serve` (pid N) at URL" once the server listens
            if "(pid " in line:
                child = int(line.split("(pid ")[1].split(")")[0])
                break
        assert child is not None, f"serve_load ended early: {load.stderr.read()[-2000:]}"
        assert _alive(child)
        load.send_signal(signal.SIGTERM)
        rc = load.wait(EXIT_BOUND_S + 30)
        reaped = not _alive(child)
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)  # (before reading stderr: a surviving child holds it open)
        if load.poll() is None:
            load.kill()
            load.wait()
    assert reaped, "the spawned server outlived serve_load"
    assert rc != 0 and "Traceback" not in load.stderr.read()
