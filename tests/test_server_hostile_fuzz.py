"""Fuzz: a seeded barrage of generated bad and odd requests against the in-process server
(fake engine, hybrid.server.testing). Every answer must be a 4xx with an OpenAI-style error body, or a
200 with a well-formed completion; never a 5xx, never a hang. Afterwards the server is idle with every
KV slot free and a greedy request returns the same text as before the barrage.

The fake engine fails on purpose for prompts containing the BEL byte (id 8) - its failure-injection
hook, tested elsewhere - so generated prompts avoid it.
"""

import concurrent.futures as cf
import json
import random

import pytest

from hybrid.server.testing import FAIL_BYTE, fake_runtime
from test_server_http import ServerThread, _completion, _raw

SEED = 20240614
N_CASES = 400
BODY_LIMIT = 64 << 10
ODD_VALUES = [None, True, False, 0, -1, 1, 2, 7, 2**31, 2**63, 2**64, 2**70, -2**70, 10**30, 0.5, -0.0, 1e-40,
              5e-324, 1e-300, 1e308, -1e308, 2.0000001, "", "x", "1", "NaN", "\u0000", "é€😀", [], [1], [[]], {},
              {"a": 1}, [None], ["a", 1], "x" * 500]
RAW_CONSTANTS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1" * 400, b"0." + b"0" * 400 + b"1",
                 b'"\\ud800"', b'"\\udfff\\ud800"', b'"\xff\xfe"', b'"\xc3\x28"', b'"\xed\xa0\x80"']
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "n", "stop", "stream", "stream_options", "model", "best_of", "logprobs", "echo", "response_format",
          "tools", "suffix", "user", "logit_bias", "presence_penalty"]


def _text(rng, n=None):
    n = rng.randint(0, 40) if n is None else n
    pool = "abc xyz 0123 .,!?\n\t\"\\<>|éß€😀\u200b\u0000\x7f" + "".join(chr(rng.randint(0x80, 0x2FFF)) for _ in range(4))
    return "".join(rng.choice(pool) for _ in range(n)).replace(chr(FAIL_BYTE), "")


def _valid(rng, chat):
    body = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.0, 1e-40, 0.7, 2.0])}
    if chat:
        body["messages"] = [{"role": rng.choice(["system", "user", "assistant", "developer"]),
                             "content": _text(rng)} for _ in range(rng.randint(1, 3))]
        body["messages"][-1]["role"] = "user"
    else:
        body["prompt"] = rng.choice([_text(rng) or "x", [_text(rng) or "y", "z"],
                                     [rng.choice([t for t in range(1, 257) if t != FAIL_BYTE + 1])
                                      for _ in range(rng.randint(1, 6))]])
    return body


def _extreme_sampling(rng, body):
    for name, values in (("temperature", [0, 1e-40, 5e-324, 1e-300, 1e-7, 1.0, 2.0]),
                         ("top_p", [1e-300, 5e-324, 1e-9, 0.5, 1.0]),
                         ("top_k", [-1, 0, 1, 2, 256, 257, 10**6, 2**62]),
                         ("seed", [-(2**63), -1, 0, 2**64 - 1, 12345]), ("n", [1, 2, 3, 8]),
                         ("stop", [None, "a", ["\n", "é"], ["x"] * 16])):
        if rng.random() < 0.6:
            body[name] = rng.choice(values)
    body["stream"] = rng.random() < 0.4
    return body


def _case(rng, i, key=None):
    """-> (description, raw HTTP request bytes, app_level) ; app_level False: garbage at the HTTP layer,
    answered by aiohttp itself (any 4xx, or a closed connection, is fine)."""
    chat = rng.random() < 0.4
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    kind = i % 10
    ctype = b"application/json"
    extra = b""
    if kind == 0:  # random bytes
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    elif kind == 1:  # a valid body, truncated or mutated
        raw = bytearray(json.dumps(_valid(rng, chat)).encode())
        for _ in range(rng.randint(1, 4)):
            op, at = rng.random(), rng.randrange(len(raw))
            if op < 0.3:
                del raw[at]
            elif op < 0.6:
                raw.insert(at, rng.choice(b'{}[]",:\\x0 \xff'))
            else:
                raw = raw[:at]
                break
        body = bytes(raw)
    elif kind in (2, 3):  # a field of the wrong type or an odd value
        b = _valid(rng, chat)
        b[rng.choice(FIELDS)] = rng.choice(ODD_VALUES)
        body = json.dumps(b).encode()
    elif kind == 4:  # a raw constant JSON cannot hold, spliced in as a value
        b = _valid(rng, chat)
        name = rng.choice(FIELDS)
        b[name] = "@@"
        body = json.dumps(b).encode().replace(b'"@@"', rng.choice(RAW_CONSTANTS))
    elif kind in (5, 6):  # valid, with extreme sampling parameters (these must work: 200)
        body = json.dumps(_extreme_sampling(rng, _valid(rng, chat))).encode()
    elif kind == 7:  # odd headers
        body = json.dumps(_valid(rng, chat)).encode()
        choice = rng.randrange(6)
        if choice == 0:
            ctype = rng.choice([b"", b"text/plain", b"application/jsonx", b"application/json\xff", b"*/*"])
        elif choice == 1:
            extra = b"Authorization: Bearer " + bytes(rng.randrange(128, 256) for _ in range(8)) + b"\r\n"
        elif choice == 2:
            extra = b"X-Junk: " + bytes(rng.randrange(128, 256) for _ in range(20)) + b"\r\n"
        elif choice == 3:
            extra = b"Host: " + rng.choice([b"evil.example", b"localhost:1", b"[::1]", b"\xff\xfe", b""]) + b"\r\n"
        elif choice == 4:
            extra = b"X-Long: " + b"a" * rng.choice([100, 9000, 20000]) + b"\r\n"
        else:
            extra = b"Accept-Encoding: \x00\x01\r\nUser-Agent: " + _text(rng, 30).encode("utf-8", "replace") + b"\r\n"
    elif kind == 8:  # oversize: a prompt over the body cap, or over the context
        b = _valid(rng, chat)
        big = "w" * rng.choice([200, 5000, BODY_LIMIT + 10])
        if chat:
            b["messages"][-1]["content"] = big
        else:
            b["prompt"] = big
        body = json.dumps(b).encode()
    else:  # structurally odd chat / prompt shapes
        shapes = [[], [[]], [[], []], [1, "a"], [{"role": "user"}], [{"role": "user", "content": [{"type": "image"}]}],
                  [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                  [[1, 2], [-3]], [[99999]], {"a": 1}, "", [[8]]]
        b = _valid(rng, chat)
        b["messages" if chat else "prompt"] = rng.choice(shapes)
        body = json.dumps(b).encode()
    if b"[[8]]" in body:  # (id 8 = the fake's failure byte; see the module docstring)
        body = body.replace(b"[[8]]", b"[[9]]")
    head = b"POST " + path + b" HTTP/1.1\r\n"
    if b"Host:" not in extra:
        head += b"Host: 127.0.0.1\r\n"
    if ctype:
        head += b"Content-Type: " + ctype + b"\r\n"
    if key and b"Authorization:" not in extra:
        head += b"Authorization: Bearer " + key.encode() + b"\r\n"
    head += extra + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    return kind, head + body, kind != 7 or choice not in (2, 4, 5)


def _check(kind, raw_response: bytes, app_level: bool) -> int:
    """Asserts the answer is well formed; returns its status."""
    if not raw_response:
        assert not app_level, "connection closed without an answer"
        return 0
    head, _, body = raw_response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    assert status < 500, (status, body[:300])
    headers = head.decode("latin-1").lower()
    if "transfer-encoding: chunked" in headers:
        body = _unchunk(body)
    if status >= 400:
        if app_level:
            err = json.loads(body)["error"]
            assert isinstance(err["message"], str) and err["message"] and err["type"]
        return status
    assert status == 200
    if "text/event-stream" in headers:
        events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for ev in events[:-1]:
            chunk = json.loads(ev)
            assert "error" not in chunk, chunk
            assert chunk["object"] in ("text_completion", "chat.completion.chunk")
    else:
        resp = json.loads(body)
        assert resp["choices"] and all(c["finish_reason"] in ("stop", "length") for c in resp["choices"])
        u = resp["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] >= 1
    return status


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


KEY = "fuzz-key"


@pytest.mark.parametrize("key", [None, KEY])  # no key: Host is checked; a key: Authorization is
def test_fuzzed_requests_get_4xx_or_well_formed_200_and_the_server_stays_healthy(key):
    server = ServerThread(fake_runtime(max_batch=4, max_context=128), max_queue=8, max_body_bytes=BODY_LIMIT,
                          read_timeout_s=10.0, api_key=key)
    try:
        _barrage(server, key)
    finally:
        server.close()


def _barrage(server, key):
    client = server.client(key or "none")
    before = _completion(client, "a normal greedy request", max_tokens=16)[0]
    rng = random.Random(SEED)
    cases = [_case(rng, i, key) for i in range(N_CASES)]
    with cf.ThreadPoolExecutor(4) as pool:  # concurrent: bad requests share batches with good ones
        statuses = list(pool.map(lambda c: _check(c[0], _raw(server.port, c[1], timeout=30), c[2]), cases))
    assert len(statuses) == N_CASES
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"{N_CASES} fuzzed requests, key={key is not None}: statuses {counts}")
    # the barrage really exercised both sides: refusals of several kinds and successful generations
    assert counts.get(200, 0) >= 40 and len([s for s in counts if 400 <= s < 500]) >= 4, counts
    assert server.wait_idle()["free_slots"] == 4
    assert _completion(client, "a normal greedy request", max_tokens=16)[0] == before
    assert server.health()["status"] == "ok"
