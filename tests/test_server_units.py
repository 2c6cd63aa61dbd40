"""Unit tests of the server's pure parts: request validation, streaming detokenization, sampling, metrics."""

import pytest
import torch

from hybrid.runtime.streamer import TextStream
from hybrid.server.errors import ApiError
from hybrid.server.metrics import Metrics
from hybrid.server.testing import fake_runtime
from hybrid.server.schemas import SamplingParams, parse_request


# --- validation ---------------------------------------------------------------------------------
def test_parse_completion_defaults_and_values():
    req = parse_request({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                         "seed": 3, "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                         "user": "u1"}, chat=False, max_choices=4)
    assert req.prompts == ["hi"] and req.max_tokens == 5 and req.stream and req.include_usage
    assert req.sampling == SamplingParams(temperature=0.0, top_p=0.5, seed=3, stop=("x",))
    assert req.sampling.greedy
    assert parse_request({"prompt": [1, 2]}, False, 4).prompts == [[1, 2]]
    assert parse_request({"prompt": [[1], [2, 3]]}, False, 4).prompts == [[1], [2, 3]]
    # an empty string is allowed here; emptiness is checked after tokenization
    assert parse_request({"prompt": ""}, False, 4).prompts == [""]
    assert parse_request({"prompt": ["a", "b"]}, False, 4).prompts == ["a", "b"]


def test_parse_chat_normalises_messages():
    req = parse_request({"messages": [{"role": "developer", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                      {"role": "assistant", "content": None}],
                         "max_completion_tokens": 7}, chat=True, max_choices=4)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]
    assert req.max_tokens == 7 and req.sampling.temperature == 1.0


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "seed": "1"}, "seed"),
    ({"prompt": "x", "seed": 1 << 70}, "seed"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 5}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "some_vendor_extra": 1}, "some_vendor_extra"),
    ({"prompt": "x", "model": 3}, "model"),
])
def test_parse_completion_rejects(body, param):
    with pytest.raises(ApiError) as e:
        parse_request(body, chat=False, max_choices=4)
    assert e.value.status == 400
    assert e.value.param == param
    assert e.value.body()["error"]["message"]


@pytest.mark.parametrize("body", [
    {},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},  # no schema
])
def test_parse_chat_rejects(body):
    with pytest.raises(ApiError) as e:
        parse_request(body, chat=True, max_choices=4)
    assert e.value.status == 400


# --- streaming detokenization -------------------------------------------------------------------
def _bytes_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _run(stream: TextStream, ids):
    pieces = [stream.push(t) for t in ids]
    if not stream.stopped:
        pieces.append(stream.finish())
    return pieces


def test_stop_string_split_across_tokens_is_never_streamed():
    s = TextStream(_bytes_decode, stop=("END",))
    pieces = _run(s, list(b"abcENxEND tail"))
    assert "".join(pieces) == "abcENx"
    assert s.stopped and s.text == "abcENx"
    # the held-back "EN" is released only once "x" shows it is not the stop string
    assert pieces[:6] == ["a", "b", "c", "", "", "ENx"]


def test_earliest_of_several_stop_strings_wins():
    s = TextStream(_bytes_decode, stop=("zz", "b"))
    assert "".join(_run(s, list(b"aabzz"))) == "aa"


def test_a_completion_that_opens_with_a_stop_string_is_empty():
    """The stop string at the very start of the text (index 0) stops with nothing emitted."""
    s = TextStream(_bytes_decode, stop=("ab",))
    pieces = _run(s, list(b"abcd"))
    assert "".join(pieces) == "" and s.stopped and s.text == ""
    s = TextStream(_bytes_decode, stop=("a",))  # a one-character stop string on the first token
    assert s.push(ord("a")) == "" and s.stopped and s.text == ""


def test_held_back_prefix_is_flushed_at_the_end():
    s = TextStream(_bytes_decode, stop=("xyz",))
    pieces = _run(s, list(b"abxy"))
    assert pieces[-1] == "xy" and "".join(pieces) == "abxy" and not s.stopped


def test_multibyte_character_is_not_split():
    ids = list("aé€".encode())  # 1 + 2 + 3 bytes
    s = TextStream(_bytes_decode)
    pieces = _run(s, ids)
    assert "".join(pieces) == "aé€"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"


# --- sampling through the adapter ----------------------------------------------------------------
def test_sampling_greedy_topk1_tiny_topp_are_argmax_and_seeds_reproduce():
    rt = fake_runtime()
    torch.manual_seed(0)
    logits = torch.randn(4, 50)  # [B, V]
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=1.5, seed=-7)]
    out = rt.sample(logits, [rt.sampler(p) for p in params])
    assert out[:3] == best[:3]
    # the seeded row draws the same token alone as in the batch
    assert rt.sample(logits[3:], [rt.sampler(params[3])]) == out[3:]
    draws = {tuple(rt.sample(logits[3:], [rt.sampler(SamplingParams(temperature=1.5, seed=s))]))
             for s in range(40)}
    assert len(draws) > 1  # temperature sampling really samples


# --- metrics -------------------------------------------------------------------------------------
def test_metrics_text_and_expert_split_hook():
    split = {}
    m = Metrics(expert_split=lambda: split)
    m.request_done("/v1/completions", 200)
    m.request_done("/v1/completions", 400)
    m.prefilled(12)
    m.generated(3, batch_size=3)
    text = m.render({"hybrid_queue_depth": ("q", 2)})
    assert 'hybrid_requests_total{endpoint="/v1/completions",status="400"} 1' in text
    assert "hybrid_prompt_tokens_total 12" in text and "hybrid_generation_tokens_total 3" in text
    assert "hybrid_queue_depth 2" in text and "hybrid_decode_batch_size 3" in text
    assert "cold_expert" not in text  # no hybrid layer -> no series at all
    m.observe_sequence(queue_wait_s=0.02, ttft_s=0.3, duration_s=7.0)
    m.observe_sequence(queue_wait_s=0.2)
    text = m.render({})
    assert 'hybrid_queue_wait_seconds_bucket{le="0.025"} 1' in text
    assert 'hybrid_queue_wait_seconds_bucket{le="0.25"} 2' in text
    assert 'hybrid_queue_wait_seconds_bucket{le="+Inf"} 2' in text and "hybrid_queue_wait_seconds_count 2" in text
    assert 'hybrid_sequence_duration_seconds_bucket{le="5"} 0' in text
    assert 'hybrid_sequence_duration_seconds_bucket{le="10"} 1' in text
    split.update({0: (4, 4), 5: (2, 0)})
    text = m.render({})
    assert 'hybrid_cold_experts_total{layer="0",lane="cpu"} 4' in text
    assert 'hybrid_cold_expert_cpu_share{layer="0"} 0.5' in text
    assert 'hybrid_cold_expert_cpu_share{layer="5"} 1.0' in text
    for line in text.splitlines():  # every sample line is "name{labels} number"
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


# --- CLI -----------------------------------------------------------------------------------------
def test_serve_cli_rejects_bad_settings_in_one_line(tmp_path, capsys):
    from hybrid.cli import main

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    cases = [(["--plan", str(plan)], "not a placement plan"),
             (["--plan", str(tmp_path / "missing.json")], "no such file"),
             (["--max-batch", "0"], "max_batch must be >= 1"),
             (["--port", "70000"], "port must be in 0..65535"),
             (["--read-timeout", "0"], "read_timeout must be in"),
             (["--read-timeout", "nan"], "read_timeout must be in")]
    for extra, needle in cases:
        assert main(["serve", *extra]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # (a demo-model note may come first)
        assert needle in last and last.startswith("hybrid serve: error:")


# --- prompt limits and Host checks at their boundaries (cheap units; the HTTP tests cover the wiring) ------------
def test_prompt_size_floor_is_a_ceiling_and_the_limit_is_inclusive():
    from hybrid.server.prompt_limits import PromptTooLong, check_sizes, floor_by_size

    assert floor_by_size(9, 4) == 3 and floor_by_size(8, 4) == 2 and floor_by_size(9, None) == 0
    check_sizes(["x" * 8, "y" * 4], limit=4, max_token_chars=4)  # at least 2 + 1 = 3 tokens: fits a limit of 4
    with pytest.raises(PromptTooLong) as e:
        check_sizes(["x" * 8, "y" * 5], limit=4, max_token_chars=4)  # at least 2 + 2 = 4: not below the limit
    assert e.value.at_least == 4
    with pytest.raises(PromptTooLong):
        check_sizes(["x" * 9], limit=3, max_token_chars=4)  # 9 characters are at least 3 tokens, not 2


def test_prompt_prefix_check_refuses_at_limit_plus_slack():
    from hybrid.server.prompt_limits import FIRST_PREFIX_CHARS_PER_TOKEN, SLACK, PromptTooLong, check_prefixes

    limit = 10
    text = "b" * (FIRST_PREFIX_CHARS_PER_TOKEN * limit + 1)  # long enough for one prefix to be tokenized
    check_prefixes(lambda t: [0] * (limit + SLACK - 1), [text], limit)  # the prefix's floor: limit - 1
    with pytest.raises(PromptTooLong):
        check_prefixes(lambda t: [0] * (limit + SLACK), [text], limit)  # floor == limit: refused
    with pytest.raises(PromptTooLong):  # two texts' prefixes together
        check_prefixes(lambda t: [0] * (limit // 2 + SLACK), [text, text], limit)
    check_prefixes(lambda t: 1 / 0, ["short"], limit)  # a text shorter than the first prefix is not tokenized here


@pytest.mark.parametrize("header, name", [("Example.COM:8000", "example.com"), ("[::1]:8000", "::1"),
                                          ("::1", "::1"), ("fe80::1", "fe80::1"), ("localhost.", "localhost")])
def test_host_name(header, name):
    from hybrid.server.guards import host_name

    assert host_name(header) == name


@pytest.mark.parametrize("header, ok", [("evillocalhost", False), ("evillocalhost:80", False), ("a.localhost", True),
                                        ("::1", True), ("LocalHost", True), ("127.0.0.1.evil.example", False)])
def test_host_allowed(header, ok):
    from hybrid.server.guards import host_allowed

    assert host_allowed(header, "127.0.0.1") is ok
