"""Walks README.md's table of OpenAI request parameters and endpoints against an in-process server: every
parameter listed as supported has an observable effect (checked against the fake engine's own logits, replayed
here), every one listed as refused gets a 400 naming it, and the table lists exactly the keys the request
schema knows, so a parameter can be neither silently ignored nor missing from the documentation.
"""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

import pytest
import torch

from hybrid.server import schemas
from hybrid.server.adapter import Runtime
from hybrid.server.testing import FakeEngine, FakeTokenizer
from test_server_grammar import CHECKS as GRAMMAR_CHECKS
from test_server_http import ServerThread

README = Path(__file__).resolve().parents[1] / "README.md"
PATHS = {"C": "/v1/completions", "Ch": "/v1/chat/completions"}
PROMPT = "Hello"
EOS = 0
# a value that is not "off" for each refused option whose generic test value ("on") would not read as one
REFUSED_VALUES = {"best_of": 2, "modalities": ["text", "audio"],
                  "functions": [{"name": "f"}], "function_call": "auto"}
TOOL_F = {"type": "function", "function": {"name": "f"}}
ENDPOINT_BODIES = {"/tokenize": {"prompt": PROMPT}, "/detokenize": {"tokens": [73, 106]}}
TOOL_G = {"type": "function", "function": {"name": "g"}}


class ScoringEngine(FakeEngine):
    """The fake engine with Engine.forward's every-position logits (last_only=False), which echo with logprobs
    prefills through."""

    def forward(self, input_ids, positions, slots, last_only: bool = False):
        if last_only:
            return super().forward(input_ids, positions, slots, last_only=True)
        (slot,) = slots.tolist()
        h = self.history[slot]
        assert self.lengths[slot] == len(h) and positions[0].tolist() == list(range(len(h), len(h) + input_ids.shape[1]))
        rows = []
        for t in input_ids[0].tolist():
            h.append(t)
            rows.append(self._logits(h))
        self.calls.append(("score", (slot,), (input_ids.shape[1],)))
        return torch.stack(rows)[None]  # [1, T, V]


def _section() -> str:
    text = README.read_text()
    return text[text.index("## Serving over the OpenAI API"): text.index("## Commands")]


def _table() -> list[tuple[list[str], list[str], str]]:
    """(parameter names, endpoints, 'supported' | 'refused') per row of the parameter table."""
    rows = []
    for line in _section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] in ("supported", "refused"):
            rows.append((re.findall(r"`([^`]+)`", cells[0]), [e.strip() for e in cells[1].split(",")], cells[2]))
    return rows


def _endpoint_table() -> list[tuple[str, str, bool]]:
    """(method, path, supported) per endpoint of the endpoint table."""
    out = []
    for line in _section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and (cells[1] == "supported" or cells[1].startswith("refused")):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                method, path = name.split()
                out.append((method, path, cells[1] == "supported"))
    return out


ROWS = [(name, ep, status) for names, eps, status in _table() for name in names for ep in eps]


@pytest.fixture(scope="module")
def server():
    s = ServerThread(Runtime(ScoringEngine(max_batch=4, max_context=128), FakeTokenizer(), "on"))
    yield s
    s.close()


# --- helpers ----------------------------------------------------------------------------------------
def _body(ep: str, **kw) -> dict:
    base = {"prompt": PROMPT} if ep == "C" else {"messages": [{"role": "user", "content": PROMPT}]}
    return {**base, "max_tokens": 8, "temperature": 0, **kw}


def _post(server, ep: str, **kw) -> tuple[int, dict]:
    status, _, body = server.post(PATHS[ep], _body(ep, **kw))
    return status, body


def _ok(server, ep: str, **kw) -> dict:
    status, body = _post(server, ep, **kw)
    assert status == 200, body
    return body


def _text(body: dict, i: int = 0) -> str:
    c = body["choices"][i]
    return c["text"] if "text" in c else c["message"]["content"]


def _stream(server, ep: str, **kw) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", PATHS[ep], json.dumps(_body(ep, stream=True, **kw)), {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    data = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert data[-1] == "[DONE]", raw
    return [json.loads(d) for d in data[:-1]]


def _prompt_ids(ep: str) -> list[int]:
    tok = FakeTokenizer()
    return tok.encode(PROMPT) if ep == "C" else tok.encode_chat([{"role": "user", "content": PROMPT}])


def _replay(server, ep: str, n: int, shape=lambda x, out: x) -> list[int]:
    """The greedy tokens the fake engine gives, each step's logits [V] passed through shape(float64 logits,
    tokens so far) first: what the server must produce for an option whose effect `shape` describes."""
    prompt, out = _prompt_ids(ep), []
    for _ in range(n):
        t = int(torch.argmax(shape(server.runtime.engine._logits(prompt + out).double(), out)))
        if t == EOS:
            break
        out.append(t)
    return out


def _decode(ids) -> str:
    return FakeTokenizer().decode(ids)


def _log_softmax(server, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(server.runtime.engine._logits(ids), -1)


# --- one effect check per supported parameter ---------------------------------------------------------
def check_model(server, ep):
    assert _ok(server, ep, model="fake")["model"] == "fake"
    status, body = _post(server, ep, model="other")
    assert status == 404 and body["error"]["param"] == "model"


def check_prompt(server, ep):
    assert _text(_ok(server, ep)) == _decode(_replay(server, ep, 8))
    assert _text(_ok(server, ep, prompt=_prompt_ids(ep))) == _text(_ok(server, ep))  # token ids, same prompt


def check_messages(server, ep):
    assert _text(_ok(server, ep)) == _decode(_replay(server, ep, 8))


def check_max_tokens(server, ep, name="max_tokens"):
    body = _ok(server, ep, ignore_eos=True, **{"max_tokens": None, name: 5})
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"


def check_max_completion_tokens(server, ep):
    check_max_tokens(server, ep, "max_completion_tokens")


def check_n(server, ep):
    body = _ok(server, ep, n=3, temperature=2.0, seed=7, max_tokens=20)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2] and len({_text(body, i) for i in range(3)}) == 3


def check_stream(server, ep):
    chunks = _stream(server, ep)
    key = (lambda c: c["text"]) if ep == "C" else (lambda c: c["delta"].get("content") or "")
    assert "".join(key(ch["choices"][0]) for ch in chunks) == _text(_ok(server, ep))


def check_stream_options(server, ep):
    chunks = _stream(server, ep, stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def check_temperature(server, ep):
    hot = _text(_ok(server, ep, temperature=2.0, seed=1, max_tokens=20))
    assert hot != _decode(_replay(server, ep, 20))


def _greedy_at_temperature(server, ep, **kw):
    """A filter that keeps only the best token makes a hot draw greedy."""
    assert _text(_ok(server, ep, temperature=2.0, seed=1, max_tokens=20, **kw)) == _decode(_replay(server, ep, 20))


def check_top_p(server, ep):
    _greedy_at_temperature(server, ep, top_p=1e-9)


def check_top_k(server, ep):
    _greedy_at_temperature(server, ep, top_k=1)


def check_min_p(server, ep):
    _greedy_at_temperature(server, ep, min_p=1.0)


def check_seed(server, ep):
    a, b, c = (_text(_ok(server, ep, temperature=2.0, seed=s, max_tokens=20)) for s in (5, 5, 6))
    assert a == b != c


def check_stop(server, ep):
    full = _decode(_replay(server, ep, 30))
    stop = full[4:6]
    body = _ok(server, ep, max_tokens=30, stop=stop)
    assert _text(body) == full[: full.index(stop)] and body["choices"][0]["finish_reason"] == "stop"


def _penalized(server, ep, name, value, shape):
    want = _replay(server, ep, 30, shape)
    assert want != _replay(server, ep, 30)  # the penalty changes this output: its effect is observable
    assert _text(_ok(server, ep, max_tokens=30, **{name: value})) == _decode(want)


def _counts(out):
    c = torch.zeros(FakeEngine().model.cfg.vocab_size, dtype=torch.float64)
    for t in out:
        c[t] += 1
    return c


def check_presence_penalty(server, ep):
    _penalized(server, ep, "presence_penalty", 1.5, lambda x, out: x - 1.5 * (_counts(out) > 0))


def check_frequency_penalty(server, ep):
    _penalized(server, ep, "frequency_penalty", 1.5, lambda x, out: x - 1.5 * _counts(out))


def check_repetition_penalty(server, ep):
    def shape(x, out):
        seen = (_counts(out) + _counts(_prompt_ids(ep))) > 0
        return torch.where(seen, torch.where(x > 0, x / 3.0, x * 3.0), x)
    _penalized(server, ep, "repetition_penalty", 3.0, shape)


def check_logit_bias(server, ep):
    a = FakeTokenizer().encode("A")[0]
    assert _text(_ok(server, ep, logit_bias={str(a): 100})) == "A" * 8
    want = _replay(server, ep, 8, lambda x, out: x + 3.0 * (torch.arange(len(x)) == a))
    assert _text(_ok(server, ep, logit_bias={str(a): 3})) == _decode(want)


def check_stop_token_ids(server, ep):
    ids = _replay(server, ep, 30)
    j = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    body = _ok(server, ep, max_tokens=30, stop_token_ids=[ids[j]])
    assert _text(body) == _decode(ids[:j]) and body["choices"][0]["finish_reason"] == "stop"


def check_ignore_eos(server, ep):
    body = _ok(server, ep, logit_bias={str(EOS): 100})  # EOS always wins
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"
    body = _ok(server, ep, logit_bias={str(EOS): 100}, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"


def check_min_tokens(server, ep):
    body = _ok(server, ep, logit_bias={str(EOS): 100}, min_tokens=3, logprobs=0 if ep == "C" else True)
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "stop"
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"] if ep == "C" else lp["content"]) == 3  # the EOS that ended it is not part of the text
    assert _text(body) == _decode(_replay(server, ep, 3, lambda x, out: x + 100.0 * (torch.arange(len(x)) != EOS)))


def _expected_logprobs(server, ep, ids):
    """Per generated token: (its logprob, the top logprobs) under the fake's raw logits."""
    prompt = _prompt_ids(ep)
    return [_log_softmax(server, prompt + ids[:i]) for i in range(len(ids))]


def check_logprobs(server, ep):
    ids = _replay(server, ep, 8)
    want = _expected_logprobs(server, ep, ids)
    if ep == "C":
        lp = _ok(server, ep, logprobs=2)["choices"][0]["logprobs"]
        assert lp["tokens"] == [_decode([t]) for t in ids]
        assert lp["token_logprobs"] == pytest.approx([float(w[t]) for w, t in zip(want, ids)], abs=1e-5)
        assert lp["text_offset"] == list(range(len(ids)))  # one character per token here
        for top, w, t in zip(lp["top_logprobs"], want, ids):
            best = torch.topk(w, 2)
            assert set(top) == {_decode([i]) for i in best.indices.tolist()} | {_decode([t])}
    else:
        lp = _ok(server, ep, logprobs=True)["choices"][0]["logprobs"]["content"]
        assert [x["token"] for x in lp] == [_decode([t]) for t in ids]
        assert [x["bytes"] for x in lp] == [list(_decode([t]).encode()) for t in ids]
        assert [x["logprob"] for x in lp] == pytest.approx([float(w[t]) for w, t in zip(want, ids)], abs=1e-5)
        assert all(x["top_logprobs"] == [] for x in lp)
    assert _ok(server, ep)["choices"][0]["logprobs"] is None  # off unless asked


def check_top_logprobs(server, ep):
    ids = _replay(server, ep, 8)
    want = _expected_logprobs(server, ep, ids)
    body = _ok(server, ep, logprobs=True, top_logprobs=3)
    for x, w in zip(body["choices"][0]["logprobs"]["content"], want):
        best = torch.topk(w, 3)
        assert [y["token"] for y in x["top_logprobs"]] == [_decode([i]) for i in best.indices.tolist()]
        assert [y["logprob"] for y in x["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-5)
    # streamed: the same records, spread over the chunks
    chunks = _stream(server, ep, logprobs=True, top_logprobs=3)
    streamed = [x for ch in chunks for x in ((ch["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == body["choices"][0]["logprobs"]["content"]


def check_echo(server, ep):
    plain = _text(_ok(server, ep))
    assert _text(_ok(server, ep, echo=True)) == PROMPT + plain
    prompt = _prompt_ids(ep)
    calls = len(server.runtime.engine.calls)
    lp = _ok(server, ep, echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert any(c[0] == "score" for c in server.runtime.engine.calls[calls:])  # every position's logits
    n = len(prompt)
    assert lp["tokens"][:n] == list(PROMPT) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [float(_log_softmax(server, prompt[:i])[prompt[i]]) for i in range(1, n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-5)
    assert lp["text_offset"][: n + 1] == list(range(n + 1))
    chunks = _stream(server, ep, echo=True, logprobs=1)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == PROMPT + plain


def _prompt_tokens(server, ep, **kw) -> int:
    return _ok(server, ep, **kw)["usage"]["prompt_tokens"]


def check_tools(server, ep):
    """The tools reach the chat template (the fake's renders them into the prompt); test_server_tools.py checks
    the calls that come back."""
    plain = _prompt_tokens(server, ep)
    rendered = _prompt_tokens(server, ep, tools=[TOOL_F])
    assert rendered == len(FakeTokenizer().encode_chat([{"role": "user", "content": PROMPT}], tools=[TOOL_F])) > plain


def check_tool_choice(server, ep):
    assert _prompt_tokens(server, ep, tools=[TOOL_F, TOOL_G], tool_choice="none") == _prompt_tokens(server, ep)
    named = {"type": "function", "function": {"name": "g"}}
    assert _prompt_tokens(server, ep, tools=[TOOL_F, TOOL_G], tool_choice=named) == \
        _prompt_tokens(server, ep, tools=[TOOL_G])


def check_parallel_tool_calls(server, ep):
    from test_server_tools import _server, test_parallel_tool_calls_false_keeps_the_first_call

    scripted = _server()
    try:
        test_parallel_tool_calls_false_keeps_the_first_call(scripted)
    finally:
        scripted.close()


def check_chat_template_kwargs(server, ep):
    kw = {"enable_thinking": False}
    want = len(FakeTokenizer().encode_chat([{"role": "user", "content": PROMPT}], **kw))
    assert _prompt_tokens(server, ep, chat_template_kwargs=kw) == want > _prompt_tokens(server, ep)
    status, body = _post(server, ep, chat_template_kwargs={"messages": []})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"


def check_reasoning_effort(server, ep):
    want = len(FakeTokenizer().encode_chat([{"role": "user", "content": PROMPT}], reasoning_effort="low"))
    assert _prompt_tokens(server, ep, reasoning_effort="low") == want > _prompt_tokens(server, ep)
    status, body = _post(server, ep, reasoning_effort="extreme")
    assert status == 400 and body["error"]["param"] == "reasoning_effort"


def _label(name):
    def check(server, ep):
        assert _text(_ok(server, ep, **{name: "someone"})) == _text(_ok(server, ep))
        status, body = _post(server, ep, **{name: 3})
        assert status == 400 and body["error"]["param"] == name
    return check


def check_response_format(server, ep):
    """Constrained decoding: the fake model's free text is no JSON; with json_schema (and json_object) the output
    parses and follows the schema, streamed too; a schema that cannot be compiled is a 400."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"type": "string", "maxLength": 5}},
              "required": ["n", "tag"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    free = _text(_ok(server, ep, max_tokens=64))
    with pytest.raises(ValueError):
        json.loads(free)
    out = json.loads(_text(_ok(server, ep, max_tokens=64, response_format=rf)))
    assert set(out) == {"n", "tag"} and isinstance(out["n"], int) and isinstance(out["tag"], str) and len(out["tag"]) <= 5
    piece = (lambda c: c["text"]) if ep == "C" else (lambda c: c["delta"].get("content") or "")
    streamed = "".join(piece(c["choices"][0]) for c in _stream(server, ep, max_tokens=64, response_format=rf))
    assert json.loads(streamed) == out
    # sampled: a seed whose object closes within the fake model's 128-token context (a sample may run on in a string)
    sampled = _ok(server, ep, max_tokens=96, temperature=1.0, seed=7, response_format={"type": "json_object"})
    assert sampled["choices"][0]["finish_reason"] == "stop" and isinstance(json.loads(_text(sampled)), dict)
    status, body = _post(server, ep, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    assert status == 400 and body["error"]["param"] == "response_format"


CHECKS = {name[len("check_"):]: f for name, f in list(globals().items()) if name.startswith("check_")}
CHECKS.update({name: _label(name) for name in schemas.LABELS})
CHECKS.update(GRAMMAR_CHECKS)  # grammar, json_schema, guided_*, structured_outputs


# --- the walk -----------------------------------------------------------------------------------------
def test_the_table_lists_exactly_the_keys_the_schema_knows():
    for ep, chat in (("C", False), ("Ch", True)):
        listed = {name for name, e, _ in ROWS if e == ep}
        known = set(schemas.IMPLEMENTED_COMMON) | set(schemas.LABELS) | set(schemas.REFUSED_COMMON)
        known |= set(schemas.IMPLEMENTED_CHAT) | set(schemas.REFUSED_CHAT) if chat else \
            set(schemas.IMPLEMENTED_COMPLETIONS) | set(schemas.REFUSED_COMPLETIONS)
        assert listed == known, (ep, listed ^ known)
    assert {name for name, _, status in ROWS if status == "supported"} <= set(CHECKS)


@pytest.mark.parametrize("name, ep", [(n, e) for n, e, s in ROWS if s == "supported"])
def test_a_supported_parameter_has_its_effect(server, name, ep):
    CHECKS[name](server, ep)


@pytest.mark.parametrize("name, ep", [(n, e) for n, e, s in ROWS if s == "refused"])
def test_a_refused_parameter_gets_a_400_naming_it(server, name, ep):
    status, body = _post(server, ep, **{name: REFUSED_VALUES.get(name, "on")})
    assert status == 400 and body["error"]["param"] == name, body


def test_unknown_keys_get_a_400_naming_them_and_off_values_pass(server):
    for ep in PATHS:
        status, body = _post(server, ep, frobnicate=1)
        assert status == 400 and body["error"]["param"] == "frobnicate"
        assert "frobnicate" in body["error"]["message"]
    assert _text(_ok(server, "Ch", tools=[], tool_choice="none", response_format={"type": "text"})) == \
        _text(_ok(server, "Ch"))
    assert _text(_ok(server, "C", suffix="", best_of=1)) == _text(_ok(server, "C"))


@pytest.mark.parametrize("ep, kw, param", [
    ("C", {"presence_penalty": 2.5}, "presence_penalty"),
    ("Ch", {"frequency_penalty": "x"}, "frequency_penalty"),
    ("C", {"repetition_penalty": 0}, "repetition_penalty"),
    ("C", {"min_p": 1.5}, "min_p"),
    ("C", {"logit_bias": {"1": 101}}, "logit_bias"),
    ("C", {"logit_bias": {"01": 1}}, "logit_bias"),
    ("C", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
    ("C", {"logit_bias": [1]}, "logit_bias"),
    ("C", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("C", {"stop_token_ids": [100000]}, "stop_token_ids"),
    ("C", {"ignore_eos": 1}, "ignore_eos"),
    ("C", {"min_tokens": 9}, "min_tokens"),  # more than max_tokens (8)
    ("C", {"min_tokens": 17, "max_tokens": None}, "min_tokens"),  # more than the default budget (16)
    ("C", {"logprobs": 21}, "logprobs"),
    ("C", {"logprobs": True}, "logprobs"),
    ("Ch", {"logprobs": 2}, "logprobs"),
    ("Ch", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("Ch", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("C", {"echo": "yes"}, "echo"),
    ("C", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
])
def test_bad_values_get_a_400_naming_the_parameter(server, ep, kw, param):
    status, body = _post(server, ep, **kw)
    assert status == 400 and body["error"]["param"] == param, body


@pytest.mark.parametrize("method, path, supported", _endpoint_table())
def test_endpoints_are_served_or_404(server, method, path, supported):
    path = path.replace("{model}", "fake")
    if method == "GET":
        status = server.post(path, None, raw=b"", method="GET")[0]
    elif path in ENDPOINT_BODIES:
        status = server.post(path, ENDPOINT_BODIES[path])[0]
    else:
        status = server.post(path, _body("C" if "chat" not in path else "Ch"))[0]
    assert (status == 200) if supported else (status == 404), (method, path, status)


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize and /detokenize: a prompt's ids and count, a chat rendered as the chat route renders it,
    the ids back to text; bad bodies are 400s naming the parameter, another model a 404."""
    tok = FakeTokenizer()
    status, _, body = server.post("/tokenize", {"prompt": PROMPT})
    assert status == 200 and body["tokens"] == tok.encode(PROMPT) and body["count"] == len(PROMPT)
    assert body["max_model_len"] == 128
    msgs = [{"role": "user", "content": PROMPT}]
    status, _, body = server.post("/tokenize", {"messages": msgs})
    assert status == 200 and body["tokens"] == tok.encode_chat(msgs)
    status, _, body = server.post("/detokenize", {"tokens": tok.encode("héllo")})
    assert status == 200 and body["prompt"] == "héllo"
    for path, bad, param in (("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": PROMPT, "messages": msgs}, "prompt"),
                             ("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"prompt": "x", "n": 2}, "n"),
                             ("/detokenize", {"tokens": [1, 9999]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens"),
                             ("/detokenize", {"tokens": [True]}, "tokens")):
        status, _, body = server.post(path, bad)
        assert status == 400 and body["error"]["param"] == param, (path, bad, body)
    assert server.post("/tokenize", {"prompt": "x", "model": "other"})[0] == 404
