"""Hostile clients: requests that can never be served, broken or misplaced credentials,
cross-site and DNS-rebinding requests, stalled uploads, huge prompts, clients that leave while queued.

Each test drives the in-process server of test_server_http.py (fake engine) over real sockets.
"""

import concurrent.futures as cf
import json
import logging
import socket
import time

import pytest

from hybrid.server.testing import fake_runtime
from test_server_http import ServerThread, _completion, _raw, _wait_health


@pytest.fixture
def server():
    s = ServerThread(fake_runtime(max_batch=4, max_context=128), max_queue=8, max_body_bytes=4 << 20)
    yield s
    s.close()


def _request(path, body: bytes, headers: bytes = b"Content-Type: application/json\r\n") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + headers +
            b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _status_and_body(response: bytes):
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# --- 2: n that can never be queued ----------------------------------------------------------------
def test_more_choices_than_the_queue_holds_is_400_not_429(server):
    status, headers, body = server.post("/v1/completions", {"prompt": "x", "n": 9, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "n", body
    assert "can never be queued" in body["error"]["message"] and "Retry-After" not in headers
    status, _, body = server.post("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
    assert status == 400 and "9 choices" in body["error"]["message"]
    status, _, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                           "n": 9, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "n"
    assert server.post("/v1/completions", {"prompt": "x", "n": 8, "max_tokens": 2})[0] == 200  # fits


# --- 3: credentials -------------------------------------------------------------------------------
@pytest.fixture
def keyed():
    s = ServerThread(fake_runtime(), api_key="s3cret")
    yield s
    s.close()


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"\xc3\x28 s3cret", b"Bearer s3cret\x80", b"\xff"])
def test_non_utf8_authorization_is_401(keyed, value):
    got = _raw(keyed.port, _request(b"/v1/completions", b'{"prompt": "x"}',
                                    b"Content-Type: application/json\r\nAuthorization: " + value + b"\r\n"))
    status, body = _status_and_body(got)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("value, status", [(b"bearer s3cret", 200), (b"BEARER  s3cret ", 200), (b"Bearer s3cret", 200),
                                           (b"Basic s3cret", 401), (b"Bearer s3cre", 401), (b"s3cret", 401)])
def test_the_auth_scheme_is_case_insensitive_and_the_key_exact(keyed, value, status):
    """RFC 9110 section 11.1: the scheme name is case-insensitive; the credentials are not."""
    req = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n"
    got, body = _status_and_body(_raw(keyed.port, req))
    assert got == status, body


def test_key_in_query_string_is_refused_and_never_logged(caplog):
    caplog.set_level(logging.INFO, logger="hybrid.server")  # turns the access log on (--log-level info)
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    srv = ServerThread(fake_runtime(), api_key="s3cret")
    try:
        status, _, body = srv.post("/v1/completions?api_key=s3cret&x=1", {"prompt": "x", "max_tokens": 2})
        assert status == 401 and "query string is not accepted" in body["error"]["message"]
        ok = srv.post("/v1/completions?key=s3cret", {"prompt": "x", "max_tokens": 2},
                      {"Authorization": "Bearer s3cret"})
        assert ok[0] == 200
        deadline = time.monotonic() + 10  # the access line is written after the response
        while sum("/v1/completions" in r.getMessage() for r in caplog.records) < 2:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.02)
    finally:
        srv.close()
    lines = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
    assert all("s3cret" not in line for line in lines), lines
    assert all("?[redacted]" in line for line in lines), lines


# --- 6: cross-site POSTs, DNS rebinding -------------------------------------------------------------
@pytest.mark.parametrize("ctype, status", [(b"", 415), (b"text/plain", 415), (b"application/x-www-form-urlencoded", 415),
                                           (b"multipart/form-data; boundary=x", 415),
                                           (b"application/json; charset=utf-8", 200), (b"Application/JSON", 200)])
def test_posts_must_be_json(server, ctype, status):
    header = b"Content-Type: " + ctype + b"\r\n" if ctype else b""
    got, body = _status_and_body(_raw(server.port, _request(b"/v1/completions", b'{"prompt": "x", "max_tokens": 2}',
                                                            header)))
    assert got == status, body
    if status == 415:
        assert body["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("host, ok", [(b"evil.example", False), (b"evil.example:8000", False),
                                      (b"localhost.evil.example", False), (b"127.0.0.1.nip.io", False),
                                      (b"localhost", True), (b"LOCALHOST:1234", True), (b"127.0.0.1:9", True),
                                      (b"[::1]:8000", True), (b"app.localhost", True), (b"10.1.2.3", True)])
def test_host_must_be_a_loopback_name_without_an_api_key(server, host, ok):
    req = (b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
    status, body = _status_and_body(_raw(server.port, req))
    assert status == (200 if ok else 403), body
    if not ok:
        assert body["error"]["code"] == "invalid_host"
    probe = b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
    assert _status_and_body(_raw(server.port, probe))[0] == 200  # probes and scrapers by any name


def test_host_is_not_checked_when_an_api_key_is_set(keyed):
    req = b"GET /v1/models HTTP/1.1\r\nHost: models.example.com\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n"
    assert _status_and_body(_raw(keyed.port, req))[0] == 200


# --- 5: stalled clients -----------------------------------------------------------------------------
@pytest.fixture
def impatient():
    s = ServerThread(fake_runtime(), read_timeout_s=1.0)
    yield s
    s.close()


def test_connection_stalled_mid_header_is_closed(impatient):
    t0 = time.monotonic()
    got = _raw(impatient.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty", timeout=20)
    assert got == b"" and time.monotonic() - t0 < 15  # closed by the server, not by our timeout


def test_connection_that_never_sends_anything_is_closed(impatient):
    assert _raw(impatient.port, b"", timeout=20) == b""


def test_body_stalled_midway_gets_408_and_is_closed(impatient):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    got = _raw(impatient.port, head + b'{"prompt": ', timeout=20)
    status, body = _status_and_body(got)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert _completion(impatient.client(), "still fine", max_tokens=3)[2].completion_tokens >= 1


# --- 4: huge prompts are refused before they are tokenized ------------------------------------------
class Recorder:
    """Wraps the tokenizer's encode, recording the length of every text it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.lengths, self._encode = [], tokenizer.encode
        tokenizer.encode = self

    def __call__(self, text):
        self.lengths.append(len(text))
        return self._encode(text)


MB = 1 << 20


def test_prompt_too_long_by_size_alone_is_refused_without_tokenizing(server):
    rec = Recorder(server.runtime.tokenizer)
    for body in ({"prompt": "x" * MB}, {"prompt": ["short", "y" * MB]},
                 {"messages": [{"role": "user", "content": "z" * MB}]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, _, resp = server.post(path, body)
        assert status == 400 and resp["error"]["code"] == "context_length_exceeded", resp
        assert "maximum context length is 128 tokens" in resp["error"]["message"]
    assert rec.lengths == []  # the fake's tokens are single bytes: the length says it all


def test_huge_prompts_cost_a_bounded_prefix_and_leave_normal_requests_alone(server):
    """Without a size bound from the tokenizer (max_token_chars None), 8 clients sending 1 MB prompts
    get 400s after tokenizing short prefixes only, and a greedy request sent meanwhile is unchanged."""
    rt = server.runtime
    want = _completion(server.client(), "normal request", max_tokens=8)[0]
    rt.max_token_chars = None
    rec = Recorder(rt.tokenizer)
    bodies = [("/v1/completions", {"prompt": "w" * MB}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "v" * (MB // 2)},
                                                     {"role": "user", "content": "u" * (MB // 2)}]})] * 4
    with cf.ThreadPoolExecutor(9) as pool:
        refused = [pool.submit(server.post, path, body) for path, body in bodies]
        normal = pool.submit(_completion, server.client(), "normal request", max_tokens=8)
        assert normal.result(60)[0] == want
        for f in refused:
            status, _, resp = f.result(60)
            assert status == 400 and resp["error"]["code"] == "context_length_exceeded", resp
    assert rec.lengths and max(rec.lengths) <= 4 * rt.max_context  # never the whole megabyte
    assert server.wait_idle()["free_slots"] == 4


# --- 8: clients that leave while queued count as cancelled --------------------------------------------
def test_cancelled_queued_requests_are_counted():
    rt = fake_runtime(max_batch=1, max_context=64)
    srv = ServerThread(rt, max_queue=4)
    try:
        rt.engine.gate.clear()  # the engine blocks inside the first prefill
        with cf.ThreadPoolExecutor(1) as pool:
            first = pool.submit(srv.post, "/v1/completions", {"prompt": "one", "max_tokens": 3})
            _wait_health(srv, "free_slots", 0)
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(_request(b"/v1/completions", b'{"prompt": "two", "max_tokens": 3}'))
            _wait_health(srv, "waiting", 1)
            s.close()  # leaves while queued
            deadline = time.monotonic() + 10  # the server noticed: its handler ended as "client closed"
            while 'status="499"} 1' not in srv.get("/metrics"):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert srv.health()["waiting"] == 1  # still queued: the engine has not looked yet
            rt.engine.gate.set()
            assert first.result(10)[0] == 200
        srv.wait_idle()
        assert "hybrid_sequences_cancelled_total 1" in srv.get("/metrics")
    finally:
        rt.engine.gate.set()
        srv.close()
