"""A reasoning model's constraint holds its answer, not its reasoning (hybrid.server.reasoned_grammar): the grammars on
the fake byte vocabulary for each place the prompt leaves a model (inside its think block, free to think, a harmony
model), every kind of request grammar inside the wrap, and the scripted server: reasoning then a schema's JSON gives
reasoning_content and content that validates."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from hybrid.server import grammars
from hybrid.server.reasoned_grammar import grammar_list, reasoning_prefix, wrap
from hybrid.server.testing import FakeTokenizer
from hybrid.server.tool_grammar import _Lark
from test_tool_grammar import think_server  # noqa: F401  (the scripted server behind a thinking template)

BYTES = FakeTokenizer().grammar_tokenizer()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
          "required": ["city"], "additionalProperties": False}
ANSWER = '{"city":"Oslo"}'


def _matcher(grammar: str, reasoning: str, thinking: str):
    g = _Lark(lambda t: None)  # every marker as text on the byte vocabulary
    m = LLMatcher(BYTES, wrap(grammar, reasoning_prefix(g, reasoning, thinking), g.rules), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _admits(grammar: str, reasoning: str, thinking: str, text: str) -> bool:
    """Whether the wrapped grammar takes `text` whole, ending there (only an end id may follow)."""
    m = _matcher(grammar, reasoning, thinking)
    return m.consume_tokens([b + 1 for b in text.encode()]) and m.is_accepting()


def _schema() -> str:
    return grammars.json_grammar(SCHEMA, "response_format")


def test_inside_the_think_block_the_reasoning_must_end_before_the_answer():
    g = _schema()
    assert _admits(g, "think", "open", "Oslo is cold.\n</think>\n\n" + ANSWER)
    assert _admits(g, "think", "open", "</think>" + ANSWER)
    assert not _admits(g, "think", "open", ANSWER)  # still reasoning: no answer yet
    assert not _admits(g, "think", "open", 'Hm.\n</think>\n\n{"city":"Rome"}')  # the schema holds the answer
    assert not _admits(g, "think", "open", "Hm.\n</think>\n\nOslo")


def test_free_to_think_the_model_may_answer_at_once_or_think_first():
    g = _schema()
    assert _admits(g, "think", "free", ANSWER)
    assert _admits(g, "think", "free", "<think>Cold.</think>\n\n" + ANSWER)
    assert not _admits(g, "think", "free", "Cold. " + ANSWER)  # text outside a think block is the answer's
    assert not _admits(g, "think", "free", "<think>Cold.</think>\n\nOslo")


def test_a_harmony_model_answers_in_its_final_message():
    g = _schema()
    assert _admits(g, "harmony", "free", "<|channel|>analysis<|message|>Cold.<|end|><|start|>assistant"
                                         "<|channel|>final<|message|>" + ANSWER)
    assert _admits(g, "harmony", "free", "<|channel|>final<|message|>" + ANSWER)
    assert not _admits(g, "harmony", "free", ANSWER)
    assert not _admits(g, "harmony", "free", "<|channel|>final<|message|>Oslo")


@pytest.mark.parametrize("param, value, good, bad", [
    ("guided_regex", "[a-z]+ [0-9]{2}", "oslo 42", "Oslo 42"),
    ("guided_choice", ["yes", "no"], "no", "maybe"),
    ("grammar", 'root ::= "a" "b"+', "abbb", "ba"),
    ("grammar", 'start: "x" /[0-9]+/', "x12", "x"),
    ("response_format", {"type": "json_object"}, '{"a":[1]}', "[1]"),
])
def test_every_kind_of_request_grammar_holds_the_answer(param, value, good, bad):
    _, grammar = grammars.request_grammar({param: value})
    assert _admits(grammar, "think", "open", "Well.\n</think>\n\n" + good)
    assert not _admits(grammar, "think", "open", "Well.\n</think>\n\n" + bad)


def test_the_request_grammar_is_kept_as_compiled_under_its_own_name():
    inner = grammar_list(_schema())
    assert len(inner) == 1 and inner[0]["json_schema"]["properties"] == SCHEMA["properties"]
    top = json.loads(wrap(_schema(), '"<x>"', []))["grammars"]
    assert top[0]["lark_grammar"].startswith('start: "<x>" @answer') and top[1]["name"] == "answer"
    assert top[1]["json_schema"] == inner[0]["json_schema"]
    assert grammar_list('start: "a"') == [{"lark_grammar": 'start: "a"'}]  # plain Lark text: one grammar


# --- the scripted server (the prompt opens the reasoning) -------------------------------------------------------

def _post(server, **body):
    return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Which city?"}],
                                                "temperature": 0, "max_tokens": 200, **body})


RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


def test_the_model_reasons_then_its_answer_follows_the_schema(think_server):
    engine = think_server.runtime.engine
    engine.script = "Oslo, I think.\n</think>\n\n" + ANSWER
    status, _, body = _post(think_server, response_format=RF)
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Oslo, I think." and json.loads(message["content"]) == {"city": "Oslo"}
    assert body["choices"][0]["finish_reason"] == "stop"
    # a model that answers in its reasoning's place: the JSON is reasoning, the grammar waits for </think>
    engine.script = ANSWER
    status, _, body = _post(think_server, response_format=RF)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert not body["choices"][0]["message"].get("content")
