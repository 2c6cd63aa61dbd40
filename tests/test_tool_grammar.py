"""tool_choice "required" / a named function, forced by a grammar of the model's own call format
(hybrid.server.tool_grammar).

Three levels: the grammars on the fake byte vocabulary (every marker written as text), the scripted fake server
(reasoning before a call, parallel calls, what cannot be combined), and an agent loop with the official `openai`
client against a real tiny model (random weights) of every family with a tool parser, its tokenizer holding the
family's markers as tokens and rendering the family's published chat template (tests/chat_templates/).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from llguidance import LLMatcher

from hybrid.server.testing import FakeTokenizer
from hybrid.server.tool_calls import ToolPlan, ToolRequestError, parse_output
from hybrid.server.tool_grammar import call_grammar, forced_grammar, thinking_state

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _valid(value, schema: dict) -> bool:
    """`value` satisfies `schema` (the keywords the schemas above use)."""
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return isinstance(value, dict) and all(k in value for k in schema.get("required", ())) and \
            (schema.get("additionalProperties", True) or set(value) <= set(props)) and \
            all(_valid(v, props[k]) for k, v in value.items() if k in props)
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


# --- the grammars, on the fake byte vocabulary -----------------------------------------------------------------

BYTES = FakeTokenizer().grammar_tokenizer()
# format -> (chat template the variant is chosen by, a forced answer of two calls, its calls)
TWO_CALLS = {
    "hermes": ("", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    "hermes-xml": ("<function=", '<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n'
                   '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
                   '<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>'),
    "deepseek": ("", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 3}'
                 '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜>'
                 '<｜tool▁calls▁end｜>'),
    "deepseek-v3": ("```json", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Oslo", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "kimi_k2": ("", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Oslo", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
                '<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|><|tool_calls_section_end|>'),
    "glm45": ("", '\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n'
              '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_time\n'
              '<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>'),
}
HARMONY = ('<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary '
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima", "days": 1}')


def _matcher(plan: ToolPlan, template: str = "", reasoning=None, thinking="free", special=lambda t: None):
    lark, _ = call_grammar(plan, special, template, reasoning, thinking)
    m = LLMatcher(BYTES, LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _admits(m, text: str) -> bool:
    """Whether the grammar takes `text` whole, ending there (only an end id may follow)."""
    return m.consume_tokens([b + 1 for b in text.encode()]) and m.is_accepting()


def _plan(fmt: str, tools=TOOLS, parallel=True, choice="required", name=None) -> ToolPlan:
    return ToolPlan(fmt.split("-")[0], tuple(tools), choice, name, parallel)


@pytest.mark.parametrize("variant", sorted(TWO_CALLS))
def test_each_format_admits_its_calls_and_they_read_back(variant):
    template, text = TWO_CALLS[variant]
    assert _admits(_matcher(_plan(variant), template), text)
    out = parse_output(text, _plan(variant))
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"] and out.content is None
    assert json.loads(out.tool_calls[1].arguments) == {"zone": "UTC"}
    assert all(_valid(json.loads(c.arguments), SCHEMAS[c.name]) for c in out.tool_calls)
    assert not _admits(_matcher(_plan(variant, parallel=False), template), text)  # one call only
    assert not _admits(_matcher(_plan(variant), template), "Sure! " + text)  # no text before the calls
    # a named function: that one only
    assert not _admits(_matcher(_plan(variant, [TIME], choice="function", name="get_time"), template), text)


def test_a_named_function_admits_its_own_call_only():
    plan = _plan("hermes", [TIME], choice="function", name="get_time")
    assert _admits(_matcher(plan), '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert not _admits(_matcher(plan), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                       '</tool_call>')


def test_harmony_may_think_then_calls_once():
    plan = _plan("harmony")
    assert _admits(_matcher(plan, reasoning="harmony"), HARMONY)
    assert _admits(_matcher(plan, reasoning="harmony"), HARMONY[HARMONY.index("<|channel|>commentary"):])
    out = parse_output(HARMONY, plan)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Lima", "days": 1})]
    assert out.reasoning == "The user wants the weather."
    assert not _admits(_matcher(plan, reasoning="harmony"), HARMONY + HARMONY[HARMONY.index("<|channel|>comm"):])


@pytest.mark.parametrize("arguments", ['{"city": "Rome"}', '{"days": 2}', '{"city": "Oslo", "days": 9}',
                                       '{"city": "Oslo", "x": 1}', '{"city":"Oslo"}', '{ "city": "Oslo"}'])
def test_arguments_outside_the_schema_are_refused(arguments):
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + '}\n</tool_call>'
    assert not _admits(_matcher(_plan("hermes")), text)


def test_reasoning_stays_free_where_the_prompt_left_it():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    think = "<think>\nThe zone is UTC.\n</think>\n\n" + call
    plan = _plan("hermes")
    assert _admits(_matcher(plan, reasoning="think", thinking="free"), think)
    assert _admits(_matcher(plan, reasoning="think", thinking="free"), call)
    assert _admits(_matcher(plan, reasoning="think", thinking="open"), think[len("<think>"):])
    assert not _admits(_matcher(plan, reasoning="think", thinking="open"), call)  # the open reasoning must close
    assert not _admits(_matcher(plan, reasoning="think", thinking="closed"), think)  # thinking off: none
    assert _admits(_matcher(plan, reasoning="think", thinking="closed"), call)
    # where the prompt leaves the model: Qwen3's generation prompt with thinking on, off, and opened
    assert thinking_state("think", False, "<|im_start|>assistant\n") == "free"
    assert thinking_state("think", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert thinking_state("think", True, "<|im_start|>assistant\n<think>\n") == "open"
    assert thinking_state(None, False, "</think>") == "free"


def test_a_marker_that_is_a_special_token_is_emitted_as_that_token():
    ids = {"<tool_call>": 7, "</tool_call>": 9}
    lark, texts = call_grammar(_plan("hermes", [TIME]), ids.get)
    assert "<[7]>" in lark and "<[9]>" in lark and '"<tool_call>"' not in lark and texts == set()
    lark, texts = call_grammar(_plan("hermes", [TIME]), lambda t: None)
    assert texts == {"<tool_call>", "</tool_call>"}


def test_text_pairs_hold_string_values_to_the_schema():
    plan = _plan("glm45", [TIME, WEATHER])
    m = _matcher(plan)
    assert not _admits(m, "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>" + "x" * 13 + "</arg_value>\n"
                          "</tool_call>")  # maxLength 12
    assert not _admits(_matcher(plan), "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value> UTC</arg_value>\n"
                                       "</tool_call>")  # (the reader would strip the space)
    assert not _admits(_matcher(plan), "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome"
                                       "</arg_value>\n</tool_call>")
    dated = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"day": {"type": "string", "format": "date"}}}}}
    with pytest.raises(ToolRequestError, match="'day' of 'book' has a 'format'") as info:
        call_grammar(_plan("glm45", [dated]), lambda t: None)
    assert info.value.param == "tools"
    lark, _ = call_grammar(_plan("hermes", [dated]), lambda t: None)  # JSON arguments: llguidance holds the format
    assert '"format": "date"' in lark
    counted = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "$defs": {"n": {"type": "integer", "minimum": 0}}, "properties": {"n": {"$ref": "#/$defs/n"}},
        "required": ["n"]}}}
    call = "<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>{}</arg_value>\n</tool_call>"
    assert _admits(_matcher(_plan("glm45", [counted])), call.format(3))  # a property's $ref reaches its $defs
    assert not _admits(_matcher(_plan("glm45", [counted])), call.format(-3))


# --- the scripted fake server --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def think_server():
    """test_server_tools' scripted fake behind a thinking model's template (the prompt opens the reasoning);
    prompts prefilled whole (the script finds its start marker in one chunk)."""
    from hybrid.server.adapter import Runtime
    from test_server_http import ServerThread
    from test_server_tools import ScriptedEngine, ThinkTokenizer

    engine = ScriptedEngine()
    engine.model.cfg.family, engine.start = "qwen3_moe", FakeTokenizer().encode("<assistant><think>\n")
    s = ServerThread(Runtime(engine, ThinkTokenizer(), "on"), prefill_chunk=2048)
    yield s
    s.close()


def _post(server, **body):
    return server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                                                "temperature": 0, "max_tokens": 300, **body})


def test_the_scripted_model_reasons_then_its_calls_pass_the_grammar(think_server):
    """The prompt opened the reasoning: it must close before the calls; both calls pass (parallel)."""
    engine = think_server.runtime.engine
    calls = TWO_CALLS["hermes"][1]
    engine.script = "Two tools.\n</think>\n\n" + calls
    status, _, body = _post(think_server, tools=TOOLS, tool_choice="required")
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Two tools."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    engine.script = calls  # never closes its reasoning: the grammar refuses the end until it has, and calls
    status, _, body = _post(think_server, tools=TOOLS, tool_choice="required")
    assert status == 200 and "tool_calls" not in body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "length"
    status, _, body = _post(think_server, tools=TOOLS)  # auto: nothing forced, the model ends where it likes
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"


def test_a_forced_call_beside_a_response_format_is_refused(think_server):
    status, _, body = _post(think_server, tools=TOOLS, tool_choice="required",
                            response_format={"type": "json_object"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, _, body = _post(think_server, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"d": {"type": "string", "format": "nope"}}}}}],
        tool_choice="required")
    assert status == 400 and body["error"]["param"] == "tools" and "cannot be forced" in body["error"]["message"]


# --- real tiny models of each family ------------------------------------------------------------------------------

DS_MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
              "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
              "<｜tool▁output▁end｜>"]
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
           topk_group=1, first_k_dense_replace=0, num_key_value_heads=4)


class Family(NamedTuple):
    """A tiny model of one family: its preset shrunk, its published template, its tokenizer's markers."""

    preset: str
    template: str  # a file in tests/chat_templates
    specials: list  # special tokens
    plain: list  # other added tokens (Qwen3 and DeepSeek publish their tool markers so)
    ends: list  # end ids (config.json's eos_token_id)
    bos: str | None
    config: dict  # config.json overrides
    extras: dict  # the request's extras; "avoid": logit_bias against the tokens that open its reasoning
    tool_result: str  # what the template writes for the tool result "sunny" of a call to {name}


# Random weights would think forever: thinking is off where the template has a switch; Kimi-K2-Thinking and
# gpt-oss are steered off their reasoning by logit_bias (the grammar leaves reasoning free).
FAMILIES = {
    "qwen3": Family("qwen3-30b-a3b", "qwen3.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
                    ["<|im_end|>", "<|endoftext|>"], None, {}, {"chat_template_kwargs": {"enable_thinking": False}},
                    "<tool_response>\nsunny\n</tool_response>"),
    "deepseek-v3.1": Family("deepseek-v3", "deepseek_v31.jinja", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
                            DS_MARKERS, ["<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>", MLA, {},
                            "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"),
    "kimi-k2": Family("kimi-k2", "kimi_k2_thinking.jinja",
                      ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                       "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                       "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"], [],
                      ["<|im_end|>"], None, MLA, {"avoid": "<think>"}, "## Return of functions.{name}:"),
    "glm-4.5": Family("glm-4.5", "glm45.jinja",
                      ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                       "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                       "</arg_value>", "<tool_response>", "</tool_response>", "<|endoftext|>"], [],
                      ["<|endoftext|>", "<|user|>", "<|observation|>"], None,
                      dict(n_group=1, topk_group=1, first_k_dense_replace=0),
                      {"chat_template_kwargs": {"enable_thinking": False}}, "<|observation|>\n<tool_response>\nsunny"),
    "gpt-oss": Family("gpt-oss-120b", "gpt_oss.jinja",
                      ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                       "<|endoftext|>"], [], ["<|return|>", "<|call|>", "<|endoftext|>"], None,
                      dict(layer_types=["sliding_attention"], experts_per_token=2), {"avoid": "analysis"},
                      '<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'),
}


def _tokenizer(template: str, specials, plain, vocab_multiple: int = 64):
    """A byte-level BPE tokenizer trained on the template's own text, the markers added as tokens, padded with
    placeholders to a multiple of `vocab_multiple`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[AddedToken(s, special=True) for s in specials],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(template.splitlines() + [json.dumps(TOOLS)] * 3, trainer)
    tok.add_tokens([AddedToken(s, special=False) for s in plain])
    n = tok.get_vocab_size(with_added_tokens=True)
    size = -(-n // vocab_multiple) * vocab_multiple
    tok.add_tokens([f"<id{i}>" for i in range(n, size)])
    return tok


def _checkpoint(out: Path, name: str) -> Path:
    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    f = FAMILIES[name]
    template = (TEMPLATES / f.template).read_text()
    tok = _tokenizer(template, f.specials, f.plain)
    cfg = hf_config(f.preset, layers=1)
    cfg.update(vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=64,
               moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts_per_tok=2, eos_token_id=[tok.token_to_id(e) for e in f.ends],
               bos_token_id=tok.token_to_id(f.bos) if f.bos else None, max_position_embeddings=4096)
    for experts in ("num_experts", "n_routed_experts", "num_local_experts"):
        if experts in cfg:
            cfg[experts] = 4
    cfg.update(f.config)
    write_random_checkpoint(out, cfg, seed=0)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": f.ends[0],
                                                           "bos_token": f.bos}))
    return out


def _serve(path: Path):
    from hybrid.models import load_model
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.tokenizer import Tokenizer
    from hybrid.server.adapter import Runtime
    from test_server_http import ServerThread

    model = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    tok = Tokenizer(path)
    return ServerThread(Runtime(Engine(model, tok, max_batch=2, max_context=2048, eager=True), tok, "on"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    server = _serve(_checkpoint(tmp_path_factory.mktemp("tools") / request.param, request.param))
    yield request.param, server
    server.close()


def _extras(name: str, runtime) -> dict:
    """The family's request extras; "avoid": logit_bias against the tokens that start that reasoning opener."""
    extras = dict(FAMILIES[name].extras)
    avoid = extras.pop("avoid", None)
    if avoid:
        decode = runtime.tokenizer.decode
        extras["logit_bias"] = {str(i): -100 for i in range(runtime.vocab_size)
                                if (t := decode([i], skip_special_tokens=False)) and avoid.startswith(t)}
    return extras


def _streamed(client, **kw) -> tuple[list[dict], str]:
    """A streamed request's calls reassembled (OpenAI's delta protocol) and its finish_reason."""
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_an_agent_loop_of_a_forced_call_and_its_result(family, choice):
    """tools + tool_choice -> a call in the family's format, parsed, valid for its schema; streamed the same; the
    result sent back as a tool message is rendered by the family's template and answered (tool_choice none)."""
    import openai

    from hybrid.server.schemas import parse_messages

    name, server = family
    runtime = server.runtime
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    extras = _extras(name, runtime)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = dict(model="fake", messages=messages, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              temperature=0, max_tokens=200, extra_body=extras)
    first = client.chat.completions.create(**kw).choices[0]
    assert first.finish_reason == "tool_calls", first.message
    (call,) = first.message.tool_calls
    assert call.function.name == choice or (choice == "required" and call.function.name in SCHEMAS)
    assert _valid(json.loads(call.function.arguments), SCHEMAS[call.function.name]), call.function.arguments
    streamed, reason = _streamed(client, **kw)
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call.function.name, call.function.arguments)]

    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    template_kw = extras.get("chat_template_kwargs", {})
    second = client.chat.completions.create(model="fake", messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=4,
                                            extra_body={"chat_template_kwargs": template_kw})
    sent = parse_messages({"messages": messages})
    assert second.usage.prompt_tokens == len(runtime.encode_chat(sent, **template_kw))  # tools "none": not rendered
    shown = runtime.tokenizer.apply_chat_template(sent, **template_kw)
    assert FAMILIES[name].tool_result.format(name=call.function.name) in shown


def test_a_model_whose_markers_cannot_be_written_is_not_forced(tmp_path, caplog):
    """A word-level tokenizer without the hermes markers (nor bytes to spell them): no grammar, one log line, and
    the call is only checked afterwards (as before)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = _checkpoint(tmp_path / "qwen3", "qwen3")
    size = json.loads((path / "config.json").read_text())["vocab_size"]
    words = {"[UNK]": 0, "<|im_end|>": 1, "<|im_start|>": 2, **{f"w{i}": i for i in range(3, size)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.ByteFallback()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_end|>", "<|im_start|>")])
    tok.save(str(path / "tokenizer.json"))
    server = _serve(path)
    try:
        with caplog.at_level(logging.WARNING, logger="hybrid.server"):
            for _ in range(2):
                status, _, body = _post(server, tools=TOOLS, tool_choice="required", max_tokens=5)
                assert status == 200 and "tool_calls" not in body["choices"][0]["message"], body
        lines = [r.getMessage() for r in caplog.records if "cannot be forced" in r.getMessage()]
        assert len(lines) == 1 and "no token for" in lines[0] and "hermes" in lines[0], lines
        assert sum("made none" in r.getMessage() for r in caplog.records) == 2
        plan = ToolPlan("hermes", tuple(TOOLS), "auto")
        assert forced_grammar(server.runtime, plan, None, False, [1]) is None  # auto: nothing forced
    finally:
        server.close()
