"""End to end: `hybrid serve` with the demo checkpoint (CPU) in a subprocess, driven over loopback.

One server for the module (start-up = importing torch + loading the model), with an API key, 8 KV slots
and a 256-token context, so 16 concurrent clients exercise queueing, slot reuse and batches whose
membership changes every few steps.

The server runs in float64. In fp32, CPU GEMMs round differently at different batch sizes (measured
~5e-7 on the demo's logits), and the router's top-k turns that into a different expert
at a near-tie within ~20 tokens, so fp32 greedy output can legitimately differ batched vs alone. In
fp64 that noise is far below any router or argmax margin, so a mismatch here means a real batching
bug (masking, positions, slots), which is what the test is for.
"""

import concurrent.futures as cf
import http.client
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

KEY = "test-key-e2e"
MAX_BATCH, MAX_CONTEXT = 8, 256
REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180  # importing torch + loading the demo model on a cold 2-core CI runner


def _start(log_path, extra_args):
    """Start `hybrid serve --port 0 ...` and return (process, port) once it announces itself."""
    env = dict(os.environ, HYBRID_API_KEY=KEY, HYBRID_NO_PROGRESS="1")
    cmd = [sys.executable, "-m", "hybrid", "serve", "--port", "0", *extra_args]
    with open(log_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    # The first stdout line is the announcement (or EOF if it died); a hung start must fail, not hang.
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        line = f"<nothing after {START_TIMEOUT_S} s>"
    if "listening on http://127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"server did not start: {line!r}\n{log_path.read_text()[-3000:]}", pytrace=False)
    return proc, int(line.split("127.0.0.1:")[1].split()[0])


def _stop(proc, log_path):
    proc.terminate()
    try:
        assert proc.wait(20) == 0, log_path.read_text()  # SIGTERM = clean shutdown, exit status 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    proc, port = _start(log, ["--max-batch", str(MAX_BATCH), "--max-context", str(MAX_CONTEXT),
                              "--max-body-bytes", "65536", "--dtype", "float64",
                              "--batch-prefill", "on"])  # the padded multi-prompt path must be exact too
    try:
        yield Server(port, proc)
    finally:
        _stop(proc, log)


class Server:
    def __init__(self, port, proc):
        self.port, self.proc = port, proc
        self.base = f"http://127.0.0.1:{port}"

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=60)

    def get(self, path):
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return r.read().decode()

    def health(self):
        return json.loads(self.get("/health"))

    def metric(self, name):
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def post(self, path, raw: bytes, key=KEY):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=raw, headers=headers)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        return r.status, json.loads(body)


def _model(server):
    return server.client().models.list().data[0].id


def test_openai_client_completions_and_chat(server):
    c, model = server.client(), _model(server)
    r = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 12
    chunks = list(c.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    chat = c.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # seeded sampling reproduces
    kw = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=0.9, top_p=0.95, seed=42)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def test_openai_client_json_schema_output_parses_on_a_real_model(server):
    """response_format json_schema through the openai client against the demo model (a small model trained on
    Shakespeare, its byte-level BPE of 2048 tokens): the reply is JSON that follows the schema. The integer is
    bounded because a model that never saw JSON, free to, may write digits until max_tokens."""
    c, model = server.client(), _model(server)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "A city, as JSON."}],
                                  max_tokens=200, temperature=0, response_format={
                                      "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"city", "population"} and isinstance(out["population"], int) and len(out["city"]) <= 12
    assert 0 <= out["population"] <= 10**8


def test_api_key_enforced(server):
    status, body = server.post("/v1/completions", b'{"prompt": "x"}', key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key").completions.create(model=_model(server), prompt="x", max_tokens=2)
    assert server.health()["status"] == "ok"


def _solo_or_batched(server, model, i, n_tokens):
    """Even i: completion (non-streamed); odd i: chat (streamed). Greedy."""
    c = server.client()
    words = "Paris is the capital and largest city of France near a small river".split()
    text = " ".join(words[: 2 + i % 11]) + f" {i}"  # different prompts of different lengths
    if i % 2 == 0:
        r = c.completions.create(model=model, prompt=text, max_tokens=n_tokens, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                            max_tokens=n_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens


def test_16_concurrent_clients_match_solo_greedy_runs(server):
    model, n = _model(server), 16
    solo = [_solo_or_batched(server, model, i, 20) for i in range(n)]
    steps0 = server.metric("hybrid_decode_steps_total")
    rows0 = server.metric("hybrid_decode_batch_rows_total")
    with cf.ThreadPoolExecutor(n) as pool:
        batched = list(pool.map(lambda i: _solo_or_batched(server, model, i, 20), range(n)))
    for i in range(n):
        assert batched[i] == solo[i], f"request {i}: batched output differs from its solo run"
    mean_batch = (server.metric("hybrid_decode_batch_rows_total") - rows0) / \
        (server.metric("hybrid_decode_steps_total") - steps0)
    assert mean_batch > 2.0  # they really ran together
    h = server.health()
    assert h["free_slots"] == MAX_BATCH and h["running"] == 0 and h["waiting"] == 0


def test_disconnect_mid_stream_frees_the_slot(server):
    cancelled0 = server.metric("hybrid_sequences_cancelled_total")
    generated0 = server.metric("hybrid_generation_tokens_total")
    body = json.dumps({"model": _model(server), "prompt": "Hello", "max_tokens": 200, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    assert server.health()["running"] == 1
    s.close()
    deadline = time.monotonic() + 10
    while True:
        h = server.health()
        if h["running"] == 0 and h["free_slots"] == MAX_BATCH:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.02)
    assert server.metric("hybrid_sequences_cancelled_total") == cancelled0 + 1
    assert server.metric("hybrid_generation_tokens_total") - generated0 < 200


@pytest.mark.parametrize("path, raw, status, needle", [
    ("/v1/completions", b'{"prompt": "x", ', 400, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hello " * 300}).encode(), 400,
     f"maximum context length is {MAX_CONTEXT}"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": MAX_CONTEXT}).encode(), 400,
     "maximum context length"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', 400, "role"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/completions", json.dumps({"prompt": "x" * 70000}).encode(), 413, "larger than the limit"),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}', 404, "does not exist"),
])
def test_bad_inputs_get_their_status(server, path, raw, status, needle):
    got, body = server.post(path, raw)
    assert got == status
    assert needle in body["error"]["message"]
    assert server.health()["status"] == "ok"


def test_metrics_without_hybrid_layer(server):
    text = server.get("/metrics")
    for name in ("hybrid_requests_total", "hybrid_generation_tokens_per_second", "hybrid_queue_depth",
                 "hybrid_decode_batch_size", "hybrid_prompt_tokens_total", "hybrid_kv_slots_free"):
        assert f"# TYPE {name} " in text
    assert "cold_expert" not in text  # plain model: no hybrid series at all


def test_hybrid_layer_split_reaches_metrics(tmp_path):
    """With cold experts on the CPU executor (--gpu-experts; on a CPU-only box both lanes run on the
    CPU), /metrics reports per layer how many cold experts ran on the CPU lane vs were shipped."""
    log = tmp_path / "stderr.txt"
    proc, port = _start(log, ["--max-batch", "2", "--max-context", "128", "--gpu-experts", "4"])
    try:
        srv = Server(port, proc)
        before = srv.get("/metrics")
        c = srv.client()
        c.completions.create(model=_model(srv), prompt="The quick brown fox", max_tokens=8, temperature=0)
        after = srv.get("/metrics")
    finally:
        _stop(proc, log)

    def split(text):
        out = {}
        for line in text.splitlines():
            if line.startswith("hybrid_cold_experts_total{"):
                labels, value = line.rsplit(" ", 1)
                out[labels] = float(value)
        return out

    b, a = split(before), split(after)
    import torch

    # without CUDA the series say so (their "shipped" lane is a DRAM copy for torch on the CPU)
    dev = "" if torch.cuda.is_available() else ',device="cpu"'
    assert {f'hybrid_cold_experts_total{{layer="{i}",lane="{lane}"{dev}}}' for i in range(4)
            for lane in ("cpu", "shipped")} == set(a)
    info = "cuda" if torch.cuda.is_available() else "cpu"
    assert any(l.startswith(f'hybrid_device_info{{device="{info}"') and l.endswith(" 1") for l in after.splitlines())
    assert sum(a.values()) > sum(b.get(k, 0) for k in a)  # the request's batches were counted
    shares = [float(l.rsplit(" ", 1)[1]) for l in after.splitlines() if l.startswith("hybrid_cold_expert_cpu_share{")]
    assert len(shares) == 4 and all(0.0 <= x <= 1.0 for x in shares)
