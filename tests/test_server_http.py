"""HTTP-level tests against an in-process server backed by the deterministic fake engine (hybrid.server.testing).

The fake's output depends only on each sequence's own tokens, so these tests pin the server's own
behaviour (batching bookkeeping, limits, errors, cancellation) without a model; test_server_e2e.py
repeats the essentials with the real demo model in a subprocess.
"""

import asyncio
import concurrent.futures as cf
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from hybrid.server.app import build_app, run_server
from hybrid.server.config import ServerConfig
from hybrid.server.routes import STATE
from hybrid.server.testing import EngineCrash, fake_runtime


class ServerThread:
    """Runs the app on 127.0.0.1:<free port> in a background event loop."""

    def __init__(self, runtime, **config):
        self.runtime = runtime
        cfg = ServerConfig(port=0, max_batch=runtime.max_batch, max_context=runtime.max_context, **config)
        self.app = build_app(cfg, runtime, "fake")
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "server did not start"
        self.base = f"http://127.0.0.1:{self.port}"

    def _main(self):
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()

        def announce(host, port):
            self.port = port
            self._ready.set()

        self._loop.run_until_complete(run_server(self.app, "127.0.0.1", 0, announce, stop=self._stop))

    def close(self):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def get(self, path):
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return r.read().decode()

    def health(self):
        return json.loads(self.get("/health"))

    def post(self, path, body, headers=None, raw: bytes | None = None, method="POST"):
        """-> (status, headers, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        try:
            return r.status, dict(r.getheaders()), json.loads(text)
        except ValueError:
            return r.status, dict(r.getheaders()), text

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0)

    def wait_idle(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["free_slots"] == h["max_batch"]:
                return h
            time.sleep(0.02)
        raise AssertionError(f"server not idle: {self.health()}")


@pytest.fixture
def server():
    s = ServerThread(fake_runtime(max_batch=4, max_context=128, step_delay_s=0.002))
    yield s
    s.close()


def _raw(port, data: bytes, timeout=15.0) -> bytes:
    """Send raw bytes, read until the server closes the connection (a hang past `timeout` fails the test)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        got = b""
        while True:
            more = s.recv(65536)
            if not more:
                return got
            got += more
    finally:
        s.close()


def _wait_health(srv, key, value):
    """Polls /health until its `key` reads `value`."""
    while srv.health()[key] != value:
        time.sleep(0.01)


def _completion(client, prompt, **kw):
    r = client.completions.create(model="fake", prompt=prompt, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


def test_openai_client_completion_and_chat(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["fake"]
    text, reason, usage = _completion(c, "Hello", max_tokens=12)
    assert reason in ("length", "stop") and usage.prompt_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 1 <= usage.completion_tokens <= 12
    r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=9,
                                  temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len("<user>hi\n<assistant>")


def test_streaming_equals_non_streaming_and_ends_with_done(server):
    c = server.client()
    full, reason, _ = _completion(c, "stream me", max_tokens=30)
    chunks = list(c.completions.create(model="fake", prompt="stream me", max_tokens=30, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == full
    assert chunks[-1].choices[0].finish_reason == reason
    msgs = [{"role": "user", "content": "x"}]
    want = c.chat.completions.create(model="fake", messages=msgs, max_tokens=20, temperature=0)
    stream = c.chat.completions.create(model="fake", messages=msgs, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        want.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == want.usage.total_tokens
    # the raw wire format ends with the [DONE] sentinel
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 3, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.getheader("Content-Type").startswith("text/event-stream")
    body = r.read().decode()
    assert body.endswith("data: [DONE]\n\n") and body.startswith("data: {")


def test_concurrent_greedy_requests_match_solo_runs(server):
    prompts = [f"prompt number {i} " + "x" * i for i in range(16)]
    c = server.client()
    solo = [_completion(c, p, max_tokens=24)[0] for p in prompts]
    server.runtime.engine.max_rows_seen = 0
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _completion(c, p, max_tokens=24)[0], prompts))
    assert together == solo
    assert server.runtime.engine.max_rows_seen == 4  # they really were batched, up to max_batch
    server.wait_idle()


def test_stop_strings_cut_output(server):
    c = server.client()
    full, _, _ = _completion(c, "stop test", max_tokens=40)
    stop = full[10:13]
    cut = full[: full.index(stop)]
    text, reason, _ = _completion(c, "stop test", max_tokens=40, stop=[stop, "\x00never"])
    assert (text, reason) == (cut, "stop")
    streamed = c.completions.create(model="fake", prompt="stop test", max_tokens=40, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut


def test_seeded_sampling_reproduces_and_n_choices_differ(server):
    c = server.client()
    kw = dict(model="fake", prompt="seeded", max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b
    r = c.completions.create(n=3, **kw)
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert texts[0] == a and len(set(texts)) == 3


def _sse_disconnect_after(port, body, events=2):
    """Start a streaming request, read a few events, then drop the connection."""
    s = socket.create_connection(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    got = b""
    while got.count(b"data: ") < events:
        more = s.recv(4096)
        assert more, f"connection closed early: {got!r}"
        got += more
    s.close()
    return got


def _runs_to_length(server, prompt, max_tokens=100):
    """Greedy decoding of `prompt` does not end early (so a disconnect test cannot race a sampled EOS)."""
    r = server.client().completions.create(model="fake", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].finish_reason == "length"


def test_disconnect_mid_stream_frees_slot(server):
    assert _runs_to_length(server, "long one 4")
    before = int(server.get("/metrics").split("\nhybrid_generation_tokens_total ")[1].split()[0])
    server.runtime.engine.step_delay_s = 0.02
    _sse_disconnect_after(server.port, {"prompt": "long one 4", "max_tokens": 100, "stream": True, "temperature": 0})
    h = server.wait_idle(timeout=5)
    assert h["free_slots"] == 4
    metrics = server.get("/metrics")
    assert "hybrid_sequences_cancelled_total 1" in metrics
    generated = int(metrics.split("\nhybrid_generation_tokens_total ")[1].split()[0]) - before
    assert generated < 50  # cancelled early, not run to max_tokens


def test_disconnect_during_non_streaming_request_frees_slot(server):
    assert _runs_to_length(server, "long one 6")
    server.runtime.engine.step_delay_s = 0.02
    s = socket.create_connection(("127.0.0.1", server.port))
    payload = json.dumps({"prompt": "long one 6", "max_tokens": 100, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    deadline = time.monotonic() + 5
    while server.health()["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.close()
    server.wait_idle(timeout=5)
    assert "hybrid_sequences_cancelled_total 1" in server.get("/metrics")


def test_full_queue_gets_429_and_accepted_requests_still_complete():
    rt = fake_runtime(max_batch=1, max_context=64)
    srv = ServerThread(rt, max_queue=1)
    try:
        rt.engine.gate.clear()  # the engine blocks inside the first prefill
        with cf.ThreadPoolExecutor(2) as pool:
            first = pool.submit(srv.post, "/v1/completions", {"prompt": "one", "max_tokens": 3})
            _wait_health(srv, "free_slots", 0)
            second = pool.submit(srv.post, "/v1/completions", {"prompt": "two", "max_tokens": 3})
            _wait_health(srv, "waiting", 1)
            status, headers, body = srv.post("/v1/completions", {"prompt": "three", "max_tokens": 3})
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert body["error"]["type"] == "rate_limit_error"
            assert "hybrid_queue_depth 1" in srv.get("/metrics")
            rt.engine.gate.set()
            assert first.result(10)[0] == 200 and second.result(10)[0] == 200
        srv.wait_idle()
    finally:
        rt.engine.gate.set()
        srv.close()


def test_bad_inputs_get_their_status_and_never_hurt_the_server(server):
    cases = [
        (dict(raw=b"{not json"), 400, None),
        (dict(raw=b"\xff\xfe"), 400, None),
        (dict(raw=b'{"prompt": "x", "temperature": NaN}'), 400, None),
        (dict(raw=b"[" * 200_000), 400, None),  # nesting deeper than the JSON parser's recursion limit
        (dict(body=["a list"]), 400, None),
        (dict(body={"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
        (dict(body={"prompt": "x", "temperature": "warm"}), 400, "temperature"),
        (dict(body={"prompt": "x" * 200}), 400, "prompt"),
        (dict(body={"prompt": "x" * 100, "max_tokens": 50}), 400, "max_tokens"),
        (dict(body={"prompt": [5, 99999]}), 400, "prompt"),
        (dict(body={"prompt": "x", "model": "gpt-4"}), 404, "model"),
        (dict(body={"prompt": "x", "logprobs": 99}), 400, "logprobs"),
        (dict(raw=b'{"prompt": "' + b"x" * (1 << 20) + b'"}'), 413, None),
    ]
    for kw, status, param in cases:
        got, _, body = server.post("/v1/completions", kw.get("body"), raw=kw.get("raw"))
        assert got == status, (kw, body)
        assert body["error"]["message"] and body["error"]["param"] == param, body
    got, _, body = server.post("/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert got == 400 and body["error"]["param"] == "messages[0].content"
    status, _, body = server.post("/v1/completions", {"prompt": "x" * 200})
    assert "maximum context length is 128 tokens" in body["error"]["message"]
    status, headers, _ = server.post("/v1/completions", None, raw=b"", method="GET")
    assert status == 405 and headers["Allow"] == "POST"
    assert server.post("/v1/nope", {})[0] == 404
    # still healthy, still serving, no slot leaked
    assert server.wait_idle()["free_slots"] == 4
    assert _completion(server.client(), "ok", max_tokens=3)[2].completion_tokens >= 1
    assert 'hybrid_requests_total{endpoint="/v1/completions",status="413"} 1' in server.get("/metrics")


def test_engine_failure_reaches_the_client_and_server_keeps_serving(server):
    status, _, body = server.post("/v1/completions", {"prompt": "boom\x07", "max_tokens": 5})
    assert status == 500 and "injected prefill failure" in body["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "boom\x07", "stream": True}),
                 {"Content-Type": "application/json"})
    text = conn.getresponse().read().decode()
    assert '"error"' in text and text.endswith("data: [DONE]\n\n")
    server.wait_idle()
    assert _completion(server.client(), "fine", max_tokens=3)[2].completion_tokens >= 1


def test_api_key_is_enforced():
    srv = ServerThread(fake_runtime(), api_key="s3cret")
    try:
        assert srv.post("/v1/completions", {"prompt": "x"})[0] == 401
        status, headers, body = srv.post("/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        ok = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, {"Authorization": "Bearer s3cret"})
        assert ok[0] == 200
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").models.list()
        assert srv.client("s3cret").models.list().data[0].id == "fake"
        assert srv.health()["status"] == "ok"  # health stays open for probes
    finally:
        srv.close()


def test_engine_crash_answers_accepted_requests_and_reports_unhealthy(server, monkeypatch):
    # The crash must leave the engine thread (a loop that swallowed it would keep running broken):
    # catch it here, so it is asserted instead of surfacing as a pytest warning with a traceback.
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_type))
    rt = server.runtime
    rt.engine.crash = True
    status, _, body = server.post("/v1/completions", {"prompt": "crash", "max_tokens": 5})
    assert status == 500 and "engine stopped" in body["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
        server.get("/health")
    assert e.value.code == 503
    status, _, body = server.post("/v1/completions", {"prompt": "after", "max_tokens": 5})
    assert status == 503 and body["error"]["code"] == "unavailable"
    server.app[STATE].scheduler._thread.join(10)
    assert escaped == [EngineCrash]


def test_load_script_reports_rates(server, tmp_path):
    from bench.serve_load import main

    out = tmp_path / "load.json"
    assert main(["--url", server.base, "--clients", "4", "--requests", "12", "--max-tokens", "6", "--stream",
                 "--prompt-words", "6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] == 12 and res["requests_per_s"] > 0 and res["output_tokens_per_s"] > 0
    assert res["output_tokens"] <= 12 * 6 and res["mean_decode_batch"] > 1.0
    assert res["cold_expert_cpu_share"] is None  # no hybrid layer behind the fake engine


def test_load_script_writes_outside_the_repository_by_default(server, tmp_path, monkeypatch, capsys):
    from bench.serve_load import main

    work, tmp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    monkeypatch.chdir(work)  # the old default was a path relative to the working directory
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    assert main(["--url", server.base, "--clients", "2", "--requests", "2", "--max-tokens", "2",
                 "--prompt-words", "6"]) == 0
    assert list(work.iterdir()) == []
    written = list(tmp.glob("hybrid-serve-load-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["ok"] == 2
    assert f"figures written to {written[0]}" in capsys.readouterr().out


def test_event_loop_answers_while_the_engine_is_busy(server):
    """The model runs on the engine thread only: with it stuck inside a step, HTTP still answers."""
    gate = server.runtime.engine.gate
    gate.clear()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(server.post, "/v1/completions", {"prompt": "slow", "max_tokens": 3})
            while server.health()["free_slots"] == 4:
                time.sleep(0.01)
            t0 = time.monotonic()
            assert server.health()["running"] == 1
            assert "hybrid_kv_slots_free 3" in server.get("/metrics")
            assert server.post("/v1/completions", {"prompt": "x", "temperature": 9})[0] == 400
            assert time.monotonic() - t0 < 2.0
            gate.set()
            assert pending.result(10)[0] == 200
    finally:
        gate.set()
