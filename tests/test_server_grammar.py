"""The grammar options of the OpenAI server (hybrid.server.grammars): llama.cpp's `grammar` (GBNF or Lark) and
`json_schema`, vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`.

Each holds the output by constrained decoding: the text follows the regex / is one of the choices / parses and
follows the schema, and the choice ends with "stop" once the grammar is complete, streamed or not. A bad
regex, grammar or schema, or two constraints in one request, is a 400 naming the parameter. On the fake engine
(its logits are seeded noise, so its free text follows none of these): every option on both endpoints, the
refusals, and a constrained row batched beside a free one that stays bitwise what it is alone. On the demo
model (a real engine, byte-level BPE vocabulary): regex, choice, GBNF and guided_json.

The `check_*` functions take (server, endpoint); tests/test_server_params.py runs them too, as the effect of
each parameter its README table lists as supported.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import pytest

from hybrid.server import grammars
from hybrid.server.testing import fake_runtime
from test_server_http import ServerThread

PATHS = {"C": "/v1/completions", "Ch": "/v1/chat/completions"}
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ['say "hi"', "back\\slash", "é ü", "x"]  # quotes, a backslash and non-ASCII: escaped in the grammar
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "enum": ["red", "green"]}},
          "required": ["n", "tag"], "additionalProperties": False}


# --- helpers ------------------------------------------------------------------------------------------------------
def _body(ep: str, **kw) -> dict:
    base = {"prompt": "Hello"} if ep == "C" else {"messages": [{"role": "user", "content": "Hello"}]}
    return {**base, "max_tokens": 40, "temperature": 0, **kw}


def _post(server, ep: str, **kw) -> tuple[int, dict]:
    status, _, body = server.post(PATHS[ep], _body(ep, **kw))
    return status, body


def _text(body: dict, i: int = 0) -> str:
    c = body["choices"][i]
    return c["text"] if "text" in c else c["message"]["content"]


def _stream(server, ep: str, **kw) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", PATHS[ep], json.dumps(_body(ep, stream=True, **kw)), {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    out = ""
    for e in events[:-1]:
        c = json.loads(e)["choices"]
        if c:
            out += c[0]["text"] if "text" in c[0] else (c[0]["delta"].get("content") or "")
    return out


def _held(server, ep: str, **kw) -> str:
    """The constrained output, which ended with the grammar (stop), streamed the same."""
    status, body = _post(server, ep, **kw)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop", body
    text = _text(body)
    assert _stream(server, ep, **kw) == text
    return text


def _refused(server, ep: str, param: str, **kw) -> None:
    status, body = _post(server, ep, **kw)
    assert status == 400 and body["error"]["param"] == param, body


def _free(server, ep: str) -> str:
    status, body = _post(server, ep)
    assert status == 200
    return _text(body)


def _follows_schema(text: str) -> bool:
    out = json.loads(text)
    return set(out) == {"n", "tag"} and type(out["n"]) is int and 0 <= out["n"] <= 999 and out["tag"] in ("red", "green")


# --- one check per parameter (README's table) ---------------------------------------------------------------------
def check_guided_regex(server, ep):
    assert not re.fullmatch(REGEX, _free(server, ep))  # the model's own text does not: the effect is observable
    assert re.fullmatch(REGEX, _held(server, ep, guided_regex=REGEX))
    _refused(server, ep, "guided_regex", guided_regex="[0-9")
    _refused(server, ep, "guided_regex", guided_regex="(a)\\1")  # back-references: not a regular language


def check_guided_choice(server, ep):
    assert _free(server, ep) not in CHOICES
    assert _held(server, ep, guided_choice=CHOICES) in CHOICES
    sampled = {_held(server, ep, guided_choice=CHOICES, temperature=1.5, seed=s) for s in range(6)}
    assert sampled <= set(CHOICES) and len(sampled) > 1  # drawn among them, not stuck on one
    for bad in ([], "x", [1]):
        _refused(server, ep, "guided_choice", guided_choice=bad)


def check_grammar(server, ep):
    assert _held(server, ep, grammar='root ::= "yes" | "no"') in ("yes", "no")  # GBNF
    assert re.fullmatch("a+b", _held(server, ep, grammar='start: "a"+ "b"'))  # llguidance's Lark
    _refused(server, ep, "grammar", grammar='root ::= "yes" | maybe')  # an undefined rule
    _refused(server, ep, "grammar", grammar='root ::= "yes')
    _refused(server, ep, "grammar", grammar="start: <|no_such_token|>")  # checked against the model's vocabulary


def check_guided_grammar(server, ep):
    assert re.fullmatch(r"[a-c]{2,4}!", _held(server, ep, guided_grammar='root ::= [a-c]{2,4} "!"'))
    _refused(server, ep, "guided_grammar", guided_grammar="root ::= [a-")


def check_guided_json(server, ep):
    with pytest.raises(ValueError):
        json.loads(_free(server, ep))
    text = _held(server, ep, guided_json=SCHEMA)
    assert _follows_schema(text)
    assert _held(server, ep, guided_json=json.dumps(SCHEMA)) == text  # vLLM also takes the schema's JSON text
    _refused(server, ep, "guided_json", guided_json={"type": "nope"})
    _refused(server, ep, "guided_json", guided_json="{not json")


def check_json_schema(server, ep):
    assert _follows_schema(_held(server, ep, json_schema=SCHEMA))
    _refused(server, ep, "json_schema", json_schema={"type": "string", "format": "nope"})


def check_structured_outputs(server, ep):
    assert _follows_schema(_held(server, ep, structured_outputs={"json": SCHEMA}))
    assert re.fullmatch(REGEX, _held(server, ep, structured_outputs={"regex": REGEX}))
    assert _held(server, ep, structured_outputs={"choice": CHOICES}) in CHOICES
    assert _held(server, ep, structured_outputs={"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    obj = _text(_post(server, ep, structured_outputs={"json_object": True, "regex": None})[1])
    assert obj.startswith("{") and not _free(server, ep).startswith("{")  # an object opens (it may be cut)
    assert _text(_post(server, ep, structured_outputs={"json_object": False})[1]) == _free(server, ep)  # off
    for bad in ({"regex": REGEX, "choice": CHOICES}, {"regex": "[0-9"}, {"structural_tag": "x"}, ["regex"]):
        _refused(server, ep, "structured_outputs", structured_outputs=bad)


CHECKS = {name[len("check_"):]: f for name, f in list(globals().items()) if name.startswith("check_")}


# --- the fake engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake():
    s = ServerThread(fake_runtime(max_batch=4, max_context=256))
    yield s
    s.close()


@pytest.mark.parametrize("name, ep", [(n, e) for n in CHECKS for e in PATHS])
def test_each_option_holds_the_output(fake, name, ep):
    CHECKS[name](fake, ep)


@pytest.mark.parametrize("ep, first, second", [
    ("C", {"guided_regex": REGEX}, {"guided_choice": CHOICES}),
    ("C", {"guided_choice": CHOICES}, {"guided_regex": REGEX}),  # the second one sent is named
    ("Ch", {"response_format": {"type": "json_object"}}, {"grammar": 'root ::= "a"'}),
    ("Ch", {"json_schema": SCHEMA}, {"structured_outputs": {"regex": REGEX}}),
])
def test_two_constraints_are_a_400_naming_the_second(fake, ep, first, second):
    _refused(fake, ep, next(iter(second)), **first, **second)


def test_off_values_are_no_constraint(fake):
    free = _free(fake, "Ch")
    assert _text(_post(fake, "Ch", response_format={"type": "text"}, guided_regex=None, grammar=None)[1]) == free
    status, body = _post(fake, "Ch", response_format={"type": "text"}, guided_choice=["x"])
    assert status == 200 and _text(body) == "x"  # text is no constraint: nothing to clash with


def test_a_forced_tool_call_beside_a_constraint_is_a_400_naming_tool_choice(fake):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        status, body = _post(fake, "Ch", tools=tools, tool_choice=choice, guided_regex=REGEX)
        assert status == 400 and body["error"]["param"] == "tool_choice" and "guided_regex" in body["error"]["message"]
    status, body = _post(fake, "Ch", tools=tools, tool_choice="auto", guided_choice=["x"])
    assert status == 200 and _text(body) == "x"


def test_sizes_are_bounded(fake):
    _refused(fake, "C", "guided_regex", guided_regex="a" * (grammars.MAX_GRAMMAR_CHARS + 1))
    _refused(fake, "C", "guided_choice", guided_choice=[str(i) for i in range(grammars.MAX_CHOICES + 1)])


def test_grammars_may_name_tokens_of_the_vocabulary(fake):
    """`<[id]>` is a token by id (checked against the vocabulary: one past it is a 400)."""
    a, b = (ord(c) + 1 for c in "AB")  # the fake's token ids: byte + 1
    assert _held(fake, "C", grammar=f"start: <[{a}]> <[{b}]>") == "AB"
    _refused(fake, "C", "grammar", grammar="start: <[99999]>")


def test_a_constrained_row_batched_beside_a_free_one_leaves_it_untouched():
    """The mask is per row: a free request decoded in the same steps as a constrained one gets exactly its solo
    text, and the constrained one still follows its regex."""
    s = ServerThread(fake_runtime(max_batch=4, max_context=256))
    try:
        engine = s.runtime.engine
        solo = _text(_post(s, "C", max_tokens=30)[1])
        engine.gate.clear()  # hold the engine until both are queued, so they run together
        out = {}
        threads = [threading.Thread(target=lambda k=k, kw=kw: out.__setitem__(k, _post(s, "C", max_tokens=30, **kw)))
                   for k, kw in (("free", {}), ("held", {"guided_regex": "[a-z]{20}"}))]
        for t in threads:
            t.start()
        time.sleep(0.5)
        calls = len(engine.calls)
        engine.gate.set()
        for t in threads:
            t.join(30)
        assert any(c[0] == "decode" and len(c[1]) == 2 for c in engine.calls[calls:])  # one batch
        assert _text(out["free"][1]) == solo
        assert re.fullmatch("[a-z]{20}", _text(out["held"][1]))
    finally:
        s.close()


# --- the demo model (a real engine) -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    import torch

    from hybrid.models import load_model
    from hybrid.runtime.demo import demo_checkpoint
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.tokenizer import Tokenizer
    from hybrid.server.adapter import Runtime

    path = demo_checkpoint()
    tok = Tokenizer(path)
    model = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    s = ServerThread(Runtime(Engine(model, tok, max_batch=4, max_context=256, eager=True), tok, "on"))
    yield s
    s.close()


@pytest.mark.parametrize("ep", list(PATHS))
def test_the_demo_model_is_held_to_each_constraint(demo, ep):
    assert re.fullmatch(REGEX, _held(demo, ep, guided_regex=REGEX))
    assert _held(demo, ep, guided_choice=CHOICES) in CHOICES
    assert _held(demo, ep, grammar='root ::= "yes" | "no"') in ("yes", "no")
    assert _follows_schema(_held(demo, ep, guided_json=SCHEMA))
    status, body = _post(demo, ep, guided_regex=REGEX, n=3, temperature=1.0, seed=7)
    assert status == 200 and all(re.fullmatch(REGEX, _text(body, i)) for i in range(3))
    _refused(demo, ep, "grammar", grammar="start: <|no_such_token|>")
