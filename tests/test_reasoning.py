"""Reasoning split from the answer: <think> blocks (opened by the output or already by the prompt), gpt-oss's
harmony channels, streamed one character at a time (reassembling to the unstreamed split), and reasoning
and tool calls read from the same output."""

from __future__ import annotations

import json

import pytest

from hybrid.server.reasoning import (HarmonySplitter, ThinkSplitter, prompt_opens_reasoning, reasoning_format_for,
                                     split_reasoning)
from hybrid.server.tool_calls import OutputParser, ToolPlan, parse_output

THINK_CASES = [  # (output, prompt opened the think block, reasoning, content)
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, "The user greets.", "Hello!"),
    ("\n<think>a\n\nb</think>answer\n", False, "a\n\nb", "answer\n"),
    ("Just an answer, <think> is a word here.\n", False, None, "Just an answer, <think> is a word here.\n"),
    ("  plain  \n", False, None, "  plain  \n"),
    ("The user greets.\n</think>\n\nHello!", True, "The user greets.", "Hello!"),  # prompt ended in <think>\n
    ("cut off while thinking </thi", True, "cut off while thinking </thi", None),
    ("<think>\n\n</think>\n\nNo thoughts.", False, None, "No thoughts."),
    ("", False, None, None),
]


def stream_split(splitter, text):
    parts = [splitter.feed(c) for c in text] + [splitter.finish()]
    return "".join(p.reasoning for p in parts) or None, "".join(p.content for p in parts) or None, parts


@pytest.mark.parametrize("text,opened,reasoning,content", THINK_CASES)
def test_think_split_whole_and_streamed(text, opened, reasoning, content):
    assert split_reasoning(text, "think", opened) == (reasoning, content or "")
    r, c, _ = stream_split(ThinkSplitter(opened), text)
    assert (r, c) == (reasoning, content)


def test_a_split_end_marker_is_held_back_not_streamed_as_reasoning():
    s = ThinkSplitter(in_reasoning=True)
    assert s.feed("step one\n</thi").reasoning == "step one"
    d = s.feed("nk>\n\nDone")
    assert d.reasoning == "" and d.content == "Done"


@pytest.mark.parametrize("tail,opens", [
    ("<|im_start|>assistant\n<think>\n", True),  # Qwen3 thinking models, DeepSeek-R1
    ("<｜Assistant｜><think>", True),  # DeepSeek-V3.1, thinking=True
    ("<｜Assistant｜></think>", False),  # DeepSeek-V3.1, thinking=False
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, enable_thinking=False
    ("<|im_start|>assistant\n", False),  # Qwen3 default: the model writes <think> itself
])
def test_prompt_opens_reasoning_from_the_generation_prompt(tail, opens):
    assert prompt_opens_reasoning(tail) is opens
    assert prompt_opens_reasoning(tail, "harmony") is False


def test_reasoning_format_from_family_and_template():
    assert reasoning_format_for("gpt_oss", None) == "harmony"
    assert reasoning_format_for("qwen3_moe", "{{ content.split('</think>')[-1] }}") == "think"
    assert reasoning_format_for("qwen2_moe", "{{ messages }}") is None
    assert split_reasoning("<think>x</think>y", None) == (None, "<think>x</think>y")


def test_message_of_a_reasoning_only_answer_has_empty_content():
    out = parse_output("<think>\nstill thinking", None, "think")
    assert out.message() == {"role": "assistant", "content": "", "reasoning_content": "still thinking"}


HARMONY = ("<|channel|>analysis<|message|>User says hi. Reply.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Hello <there>!")


def test_harmony_channels_whole_and_streamed():
    assert split_reasoning(HARMONY, "harmony") == ("User says hi. Reply.", "Hello <there>!")
    r, c, parts = stream_split(HarmonySplitter(calls=False), HARMONY)
    assert (r, c) == ("User says hi. Reply.", "Hello <there>!")
    assert not any("<|" in p.content or "<|" in p.reasoning for p in parts)  # no marker half-streamed
    plain = "No harmony markers at all."
    assert split_reasoning(plain, "harmony") == (None, plain)


def test_harmony_call_is_content_when_no_tools_were_asked_for():
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}"
    assert split_reasoning(text, "harmony") == (None, '{"a": 1}')


QWEN3_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
QWEN3_OUTPUT = ("<think>\nThe user wants weather; call the tool. A <tool_call> here is only a thought.\n</think>\n\n"
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_and_tool_calls_from_one_output(opened):
    text = QWEN3_OUTPUT[len("<think>"):] if opened else QWEN3_OUTPUT
    plan = ToolPlan("hermes", tuple(QWEN3_TOOLS), "auto")
    whole = parse_output(text, plan, "think", opened, make_id=lambda: "call_0")
    assert whole.reasoning == "The user wants weather; call the tool. A <tool_call> here is only a thought."
    assert whole.content is None and [json.loads(c.arguments) for c in whole.tool_calls] == [{"city": "Paris"}]
    msg = whole.message()
    assert msg["reasoning_content"] == whole.reasoning and msg["content"] is None
    p = OutputParser(plan, "think", opened, make_id=lambda: "call_0")
    for c in text:
        p.feed(c)
    p.finish()
    assert p.result() == whole


def test_gpt_oss_reasoning_and_call_together():
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
    plan = ToolPlan("harmony", tuple(QWEN3_TOOLS), "auto")
    out = parse_output(text, plan, None, make_id=lambda: "call_0")
    assert out.reasoning == "Need weather." and out.content is None
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    p = OutputParser(plan, "harmony", make_id=lambda: "call_0")
    for c in text:
        p.feed(c)
    p.finish()
    assert p.result() == out
