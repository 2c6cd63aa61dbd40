"""Tool calling and reasoning output on /v1/chat/completions, through the in-process server: the model's
text is scripted (ScriptedEngine), the parsers' results must come back in OpenAI's shapes, streamed and
not, and the request's tools must reach the chat template.
"""

from __future__ import annotations

import http.client
import json

import pytest
import torch

from hybrid.server.adapter import Runtime
from hybrid.server.testing import VOCAB, FakeEngine, FakeTokenizer
from test_server_http import ServerThread

CHAT = "/v1/chat/completions"
SPECIAL = VOCAB - 1  # byte 0xFF (never valid UTF-8 alone): a control token in SpecialTokenizer
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """The fake engine whose greedy output is `script` (bytes, or token ids; a callable gets the prompt's
    text), then EOS. The generated part of a slot is what follows the last `start` marker."""

    def __init__(self, **kw):
        super().__init__(max_batch=4, max_context=2048, **kw)
        self.script = ""
        self.start = FakeTokenizer().encode("<assistant>")
        self.prompts: list[str] = []

    def _logits(self, ids: list[int]) -> torch.Tensor:
        s, n = self.start, len(self.start)
        at = max(i for i in range(len(ids) - n + 1) if ids[i:i + n] == s) + n
        prompt, done = ids[:at], len(ids) - at
        if done == 0:
            self.prompts.append(FakeTokenizer().decode(prompt))
        script = self.script(self.prompts[-1]) if callable(self.script) else self.script
        want = FakeTokenizer().encode(script) if isinstance(script, str) else list(script)
        logits = torch.full((VOCAB,), -50.0)
        logits[want[done] if done < len(want) else 0] = 50.0
        return logits


class SpecialTokenizer(FakeTokenizer):
    """id SPECIAL is the control token `<tool_call>` (dropped unless skip_special_tokens=False)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, run = [], []
        for i in list(ids) + [None]:
            if i == SPECIAL or i is None:
                out.append(super().decode(run))
                run = []
                if i is not None and not skip_special_tokens:
                    out.append("<tool_call>")
            else:
                run.append(i)
        return "".join(out)


class ThinkTokenizer(FakeTokenizer):
    """A thinking model's template: writes </think> and opens the reasoning in the generation prompt."""

    chat_template = FakeTokenizer.chat_template + " <think>...</think>"

    def encode_chat(self, messages, **kw):
        return super().encode_chat(messages, **kw) + self.encode("<think>\n")


class PlainTokenizer(FakeTokenizer):
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # renders no tools: no parser


def _server(tokenizer=FakeTokenizer, family="qwen3_moe") -> ServerThread:
    engine = ScriptedEngine()
    engine.model.cfg.family = family
    if tokenizer is ThinkTokenizer:
        engine.start = FakeTokenizer().encode("<assistant><think>\n")
    return ServerThread(Runtime(engine, tokenizer(), "on"))


@pytest.fixture(scope="module")
def server():
    s = _server(SpecialTokenizer)
    yield s
    s.close()


@pytest.fixture(scope="module")
def think_server():
    s = _server(ThinkTokenizer)
    yield s
    s.close()


def _body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0, "max_tokens": 200, **kw}


def _chat(server, **kw) -> dict:
    status, _, body = server.post(CHAT, _body(**kw))
    assert status == 200, body
    return body


def _stream(server, **kw) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", CHAT, json.dumps(_body(stream=True, **kw)), {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    data = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert data[-1] == "[DONE]", raw
    return [json.loads(d) for d in data[:-1]]


def _reassembled(chunks: list[dict]) -> dict:
    """A streamed choice 0 put back together as a message, plus its finish_reason."""
    msg, calls, reason = {"content": "", "reasoning_content": ""}, {}, None
    for ch in chunks:
        c = ch["choices"][0]
        d = c["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for t in d.get("tool_calls") or ():
            entry = calls.setdefault(t["index"], {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            if "id" in t:
                entry["id"], entry["function"]["name"] = t["id"], t["function"]["name"]
            entry["function"]["arguments"] += t["function"]["arguments"]
        reason = c["finish_reason"] or reason
    msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": msg, "finish_reason": reason}


def _weather_call(msg: dict) -> None:
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_tool_call_comes_back_as_tool_calls(server):
    server.runtime.engine.script = "Let me look. " + CALL
    choice = _chat(server, tools=[WEATHER])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    _weather_call(choice["message"])
    assert '"get_weather"' in server.runtime.engine.prompts[-1]  # the tools reached the template
    # without tools the same text is plain content, as before
    plain = _chat(server)["choices"][0]
    assert plain == {"index": 0, "message": {"role": "assistant", "content": "Let me look. " + CALL},
                     "logprobs": None, "finish_reason": "stop"}


def test_a_streamed_tool_call_reassembles_to_the_unstreamed_one(server):
    server.runtime.engine.script = "Let me look. " + CALL + "\n" + TIME_CALL
    whole = _chat(server, tools=[WEATHER, TIME])["choices"][0]
    got = _reassembled(_stream(server, tools=[WEATHER, TIME], logprobs=True))
    assert got["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert got["message"]["content"] == whole["message"]["content"] == "Let me look."
    strip = lambda calls: [{**c, "id": None} for c in calls]  # noqa: E731 - ids are fresh per response
    assert strip(got["message"]["tool_calls"]) == strip(whole["message"]["tool_calls"])
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "get_time"]
    # text held back as a possible marker start comes out at the end
    server.runtime.engine.script = "Checking <tool"
    got = _reassembled(_stream(server, tools=[WEATHER]))
    assert got["message"]["content"] == "Checking <tool" and got["finish_reason"] == "stop"


def test_streamed_logprobs_are_all_kept_when_the_parser_holds_text_back(server):
    server.runtime.engine.script = CALL
    chunks = _stream(server, tools=[WEATHER], logprobs=True)
    records = [x for ch in chunks for x in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert len(records) == len(FakeTokenizer().encode(CALL))


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    server.runtime.engine.script = CALL + "\n" + TIME_CALL
    msg = _chat(server, tools=[WEATHER, TIME], parallel_tool_calls=False)["choices"][0]["message"]
    _weather_call(msg)
    status, _, body = server.post(CHAT, _body(tools=[WEATHER], parallel_tool_calls="no"))
    assert status == 400 and body["error"]["param"] == "parallel_tool_calls"


def test_a_control_token_marker_is_kept_for_the_parser(server):
    """SPECIAL decodes to <tool_call> only with special tokens kept: the server must keep them to see the call."""
    tail = FakeTokenizer().encode(CALL[len("<tool_call>"):])
    server.runtime.engine.script = [SPECIAL] + tail
    choice = _chat(server, tools=[WEATHER])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    _weather_call(choice["message"])
    assert _chat(server)["choices"][0]["message"]["content"] == CALL[len("<tool_call>"):]  # skipped, as before


def test_tool_choice_none_named_and_required(server):
    engine = server.runtime.engine
    engine.script = CALL
    none = _chat(server, tools=[WEATHER], tool_choice="none")["choices"][0]
    assert none["message"]["content"] == CALL and none["finish_reason"] == "stop" and "tool_calls" not in none["message"]
    assert '"get_weather"' not in engine.prompts[-1]  # "none": tools not rendered
    named = _chat(server, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _weather_call(named["choices"][0]["message"])  # (the grammar lets only the named function's call through)
    assert '"get_weather"' in engine.prompts[-1] and '"get_time"' not in engine.prompts[-1]
    req = _chat(server, tools=[WEATHER], tool_choice="required")["choices"][0]
    assert req["finish_reason"] == "tool_calls"
    _weather_call(req["message"])
    status, _, body = server.post(CHAT, _body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert status == 400 and body["error"]["param"] == "tool_choice"


def test_tools_for_a_model_without_a_parser_get_a_400():
    s = _server(PlainTokenizer, family="mixtral")
    try:
        status, _, body = s.post(CHAT, _body(tools=[WEATHER]))
        assert status == 400 and body["error"]["param"] == "tools" and "tool_choice" in body["error"]["message"]
        status, _, _ = s.post(CHAT, _body(tools=[WEATHER], tool_choice="none"))
        assert status == 200
    finally:
        s.close()


def test_reasoning_content_is_split_streamed_and_not(think_server):
    think_server.runtime.engine.script = "The user wants weather.\n</think>\n\nIt is sunny."
    msg = _chat(think_server)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The user wants weather."}
    got = _reassembled(_stream(think_server))
    assert got["message"]["reasoning_content"] == msg["reasoning_content"]
    assert got["message"]["content"] == msg["content"] and got["finish_reason"] == "stop"


def test_reasoning_then_a_tool_call(think_server):
    think_server.runtime.engine.script = "Need the tool.</think>" + CALL
    choice = _chat(think_server, tools=[WEATHER])["choices"][0]
    assert choice["message"]["reasoning_content"] == "Need the tool." and choice["message"]["content"] is None
    _weather_call(choice["message"])


def test_a_tool_result_turn_is_rendered_through_the_template(server):
    engine = server.runtime.engine
    engine.script = "It is sunny in Paris."
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "use the tool",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = _chat(server, messages=messages, tools=[WEATHER])
    assert body["choices"][0]["message"]["content"] == "It is sunny in Paris."
    want = FakeTokenizer().decode(FakeTokenizer().encode_chat(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "reasoning_content": "use the tool",
          "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}], tools=[WEATHER]))
    assert engine.prompts[-1] == want.replace("null<tool_call>", "<tool_call>")  # (null content reaches it as "")
    status, _, err = server.post(CHAT, _body(messages=[{"role": "tool", "content": "x"}]))
    assert status == 400 and err["error"]["param"] == "messages[0].tool_call_id"


def test_template_kwargs_reach_the_template_and_owned_keys_are_refused(server):
    server.runtime.engine.script = "ok"
    _chat(server, chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low")
    assert server.runtime.engine.prompts[-1].startswith('<enable_thinking>false\n<reasoning_effort>"low"\n')
    for kw, param in (({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                      ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                      ({"reasoning_effort": "max"}, "reasoning_effort")):
        status, _, body = server.post(CHAT, _body(**kw))
        assert status == 400 and body["error"]["param"] == param, body


def test_tool_schemas_count_in_the_size_check(server):
    huge = {"type": "function", "function": {"name": "f", "description": "x" * 5000}}
    status, _, body = server.post(CHAT, _body(tools=[huge], max_tokens=None))
    assert status == 400 and "refused before tokenizing" in body["error"]["message"], body


def test_an_agent_loop_turn_with_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    server.runtime.engine.script = lambda prompt: "Sunny." if "<tool>" in prompt else CALL
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER], temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER], temperature=0)
    assert second.choices[0].message.content == "Sunny." and second.choices[0].finish_reason == "stop"
