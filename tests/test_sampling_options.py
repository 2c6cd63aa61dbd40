"""The sampler's options (hybrid.runtime.sampling.BatchSampler), each against a hand computation on small logits:
the OpenAI presence / frequency penalties, the HF / vLLM repetition penalty, min_p, logit_bias, min_tokens,
ignore_eos and stop_token_ids (through the server's loop), logprobs against the engine's own logits (a tiny real
model, prompt scoring in chunks included), batch mates that never mix, and a batch without options sampling
bitwise as the stateless sampler does.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.runtime import sampling
from hybrid.runtime.sampling import BatchSampler, SamplingParams, filter_logits, sample
from hybrid.server import adapter
from hybrid.server.metrics import Metrics
from hybrid.server.routes import _stop_ids
from hybrid.server.scheduler import Scheduler, Sequence
from hybrid.server.schemas import parse_request
from hybrid.server.testing import FakeTokenizer, fake_runtime
from test_server_scheduler import Collector

X = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5, 4.0], dtype=torch.float64)  # [V=6] logits for the hand computations


def _force(bs, s, token: int, V: int = 6) -> int:
    """One sampling step whose logits make `token` win whatever the options (+1000)."""
    logits = torch.zeros(1, V)
    logits[0, token] = 1000.0
    return bs.sample(logits, [s])[0]


def _sampler(params: SamplingParams, prompt=(), ends=(), V: int = 6, generated=()):
    bs = BatchSampler(V, "cpu", rows=2)
    s = bs.open(params, prompt, ends)
    for t in generated:
        assert _force(bs, s, t, V) == t
    return bs, s


# --- penalties ------------------------------------------------------------------------------------------
def test_presence_and_frequency_penalties_count_generated_tokens_only():
    bs, s = _sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[5], generated=[2, 2, 3])
    want = X.clone()
    want[2] = 3.0 - 0.25 * 2 - 0.5  # generated twice
    want[3] = -1.0 - 0.25 * 1 - 0.5  # once
    # token 5 is in the prompt only: OpenAI's penalties do not see it
    assert torch.equal(bs.shape(X[None], [s])[0], want)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    bs, s = _sampler(SamplingParams(repetition_penalty=2.0), prompt=[5, 1], generated=[3])
    want = X.clone()
    want[5], want[1], want[3] = 4.0 / 2, 2.0 / 2, -1.0 * 2
    assert torch.equal(bs.shape(X[None], [s])[0], want)


def test_a_penalty_changes_the_greedy_choice():
    bs, s = _sampler(SamplingParams(frequency_penalty=2.0), generated=[5])
    assert bs.sample(X[None].float(), [s]) == [2]  # 5 (4.0) drops to 2.0 < 3.0


# --- min_p, logit_bias ----------------------------------------------------------------------------------
def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    for min_p, kept in ((0.0, 4), (0.2, 3), (0.5, 2), (0.61, 1), (1.0, 1)):
        x = filter_logits(logits, SamplingParams(temperature=1.0, min_p=min_p))
        assert torch.isfinite(x).tolist() == [i < kept for i in range(4)], min_p
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=3)
    draws = sample(logits[None].expand(400, 4), [p] * 400, [p.generator(torch.device("cpu"))] * 400)
    assert set(draws) == {0, 1, 2}


def test_logit_bias_is_added_to_the_logits():
    p = SamplingParams(logit_bias=((1, 0.5), (5, -100.0)))
    bs, s = _sampler(p)
    want = X.clone()
    want[1] += 0.5
    want[5] -= 100.0
    assert torch.equal(bs.shape(X[None], [s])[0], want)
    assert bs.sample(X[None].float(), [s]) == [2]  # 5 is biased away, 1 not enough up; the stateless sampler agrees
    assert sample(X[None].float(), [p], [None]) == [2]
    assert sample(X[None].float(), [SamplingParams(logit_bias=((0, 3.5),))], [None]) == [0]


# --- min_tokens, ignore_eos, stop_token_ids -------------------------------------------------------------------
def test_min_tokens_masks_the_end_ids_until_then():
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0, 8.0, 3.0]])  # EOS (0) wins, then the stop id 4
    bs, s = _sampler(SamplingParams(min_tokens=2), ends=[0, 4])
    assert [bs.sample(logits, [s])[0] for _ in range(3)] == [5, 5, 0]
    bs, s = _sampler(SamplingParams(min_tokens=2), ends=[4])  # ignore_eos: only the stop id is masked
    assert bs.sample(logits, [s]) == [0]


def _run(rt, requests, max_tokens=10):
    """(prompt, request body) pairs through the server's loop, stop ids as the route derives them."""
    sched = Scheduler(rt, Metrics(), max_queue=64, prefill_chunk=512)
    sinks = []
    for ids, body in requests:
        req = parse_request({"prompt": "x", "temperature": 0, **body}, chat=False, max_choices=4)
        sinks.append(Collector())
        sched.submit([Sequence(list(ids), max_tokens, req.sampling, sinks[-1],
                               stop_ids=_stop_ids(req, rt.eos_token_ids))])
    sched.start()
    try:
        for s in sinks:
            assert s.done.wait(20)
    finally:
        sched.stop()
    return [s.terminal[0] for s in sinks], sinks


PROMPT = [10, 20, 30]


def test_ignore_eos_stop_token_ids_and_min_tokens_in_the_loop():
    eos = {"logit_bias": {"0": 100}}  # EOS always wins
    (plain, ignored, late), _ = _run(fake_runtime(), [(PROMPT, eos), (PROMPT, {**eos, "ignore_eos": True}),
                                                      (PROMPT, {**eos, "min_tokens": 4})])
    assert (plain.finish_reason, plain.completion_tokens) == ("stop", 1)
    assert (ignored.finish_reason, ignored.completion_tokens) == ("length", 10)
    assert (late.finish_reason, late.completion_tokens) == ("stop", 5)  # 4 tokens, then EOS
    (free,), sinks = _run(fake_runtime(), [(PROMPT, {})])
    text = sinks[0].text
    stop = FakeTokenizer().encode(text[3])[0]
    assert text[3] not in text[:3]
    (cut, held), sinks = _run(fake_runtime(), [(PROMPT, {"stop_token_ids": [stop]}),
                                               (PROMPT, {"stop_token_ids": [stop], "min_tokens": 6})])
    assert sinks[0].text == text[:3] and cut.finish_reason == "stop"
    assert held.completion_tokens >= 6 and sinks[1].text[:3] == text[:3] and sinks[1].text[3] != text[3]


# --- logprobs -------------------------------------------------------------------------------------------
def test_logprobs_are_the_raw_log_softmax_whatever_the_options():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    bs = BatchSampler(50, "cpu", rows=3)
    ps = [SamplingParams(logprobs=4), SamplingParams(temperature=0.7, seed=1, logprobs=0, presence_penalty=1.0),
          SamplingParams(logit_bias=((3, 50.0),), logprobs=2)]
    ss = [bs.open(p) for p in ps]
    tokens = bs.sample(logits, ss)
    assert tokens[2] == 3  # biased, yet its logprob is the model's
    lsm = torch.log_softmax(logits, -1)
    for s, t, row, p in zip(ss, tokens, lsm, ps):
        (r,) = s.take_records()
        assert r.token == t and r.logprob == float(row[t])
        top = torch.topk(row, p.logprobs)
        assert r.top == list(zip(top.indices.tolist(), top.values.tolist()))


@pytest.fixture(scope="module")
def tiny_runtime():
    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config
    from hybrid.runtime import Engine

    raw = hf_config("demo", layers=2)
    model = init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=0, std=0.1)
    return adapter.Runtime(Engine(model, max_batch=2, max_context=48), None, "on")  # token ids only


def test_logprobs_of_prompt_and_output_equal_the_engines_logits(tiny_runtime, monkeypatch):
    """Echo with logprobs on a real model, its prompt in chunks of 4 scored in pieces of 3, after a request that
    left the same prompt in the prefix cache (a scored prompt must not skip it): every record equals log_softmax
    of what Engine.prefill gives after the same tokens."""
    monkeypatch.setattr(adapter, "SCORE_ROWS", 3)
    monkeypatch.setattr(sampling, "SCORE_ROWS", 3)
    rt = tiny_runtime
    prompt = [(7 * i + 3) % 1000 for i in range(20)]
    sched = Scheduler(rt, Metrics(), max_queue=4, prefill_chunk=4)
    sched.start()
    try:
        first, sink = Collector(), Collector()
        sched.submit([Sequence(prompt, 2, SamplingParams(), first)])
        assert first.done.wait(60)
        assert rt.engine.cached_prefix(prompt) > 0
        sched.submit([Sequence(prompt, 5, SamplingParams(logprobs=2, prompt_logprobs=2), sink, stop_ids=frozenset())])
        assert sink.done.wait(60)
    finally:
        sched.stop()
    prompt_records = next(e.logprobs for e in sink.events if e.kind == "prompt")
    records = [r for e in sink.events if e.kind in ("text", "done") for r in e.logprobs or ()]
    assert sink.terminal[0].kind == "done" and len(records) == 5
    assert [r.token for r in prompt_records] == prompt and prompt_records[0].logprob is None
    ids = prompt + [r.token for r in records]
    eng = rt.engine
    for i in range(1, len(ids)):
        slot = eng.allocate_slot()
        try:
            want = torch.log_softmax(eng.prefill(slot, ids[:i]), -1)
        finally:
            eng.free_slot(slot)
        got = prompt_records[i] if i < len(prompt) else records[i - len(prompt)]
        assert got.logprob == pytest.approx(float(want[ids[i]]), abs=1e-4), i
        assert [t for t, _ in got.top] == torch.topk(want, 2).indices.tolist(), i
    assert not rt._scoring and rt.batch_prefill  # scored, then ordinary again


def test_prompt_scoring_in_chunks_equals_one_pass():
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(1))
    ids = [4, 9, 1, 0, 22, 5, 6]
    s = BatchSampler(30, "cpu").open(SamplingParams(prompt_logprobs=1), ids)
    whole, _ = s.score_prompt(ids, logits, None)
    first, carry = s.score_prompt(ids[:3], logits[:3], None)
    rest, _ = s.score_prompt(ids[3:], logits[3:], carry)
    assert first + rest == whole and whole[0].logprob is None
    lsm = torch.log_softmax(logits, -1)
    assert [r.logprob for r in whole[1:]] == [float(lsm[i - 1, ids[i]]) for i in range(1, 7)]


# --- the batch ------------------------------------------------------------------------------------------
OPTIONS = [SamplingParams(), SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
           SamplingParams(repetition_penalty=1.7, logprobs=1), SamplingParams(logit_bias=((7, 2.0),), min_tokens=3),
           SamplingParams(temperature=0.9, min_p=0.05, seed=11, frequency_penalty=1.0)]


def test_batched_sequences_with_different_options_do_not_mix():
    V, steps = 40, 8
    g = torch.Generator().manual_seed(2)
    logits = [torch.randn(len(OPTIONS), V, generator=g) * 2 for _ in range(steps)]
    prompts = [[1, 2], [3, 4, 3], [5, 6, 7], [8], [9, 10]]
    bs = BatchSampler(V, "cpu", rows=1)  # fewer rows than penalized sequences: the counts grow
    together = [bs.open(p, pr, [0, 7]) for p, pr in zip(OPTIONS, prompts)]
    got = [bs.sample(step, together) for step in logits]
    for i, (p, pr) in enumerate(zip(OPTIONS, prompts)):
        alone_bs = BatchSampler(V, "cpu")
        alone = alone_bs.open(p, pr, [0, 7])
        want = [alone_bs.sample(step[i : i + 1], [alone])[0] for step in logits]
        assert [row[i] for row in got] == want, p
        assert together[i].take_records() == alone.take_records()


def test_a_batch_without_options_samples_bitwise_as_before_and_allocates_nothing():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=7, top_p=0.9, seed=6), SamplingParams(), SamplingParams()]
    bs = BatchSampler(100, "cpu", rows=6)
    got = bs.sample(logits, [bs.open(p) for p in params])
    want = sample(logits, params, [p.generator(torch.device("cpu")) for p in params])
    assert got == want
    assert [got[i] for i in (0, 2, 4, 5)] == logits.argmax(-1)[[0, 2, 4, 5]].tolist()
    assert torch.equal(logits, before) and bs.counts is None and bs.in_prompt is None
    assert all(p.greedy for p in params[::2])
    for stateful in (SamplingParams(presence_penalty=0.1), SamplingParams(min_tokens=1), SamplingParams(logprobs=0)):
        assert not stateful.greedy  # never decided on the device (decode ahead), where options cannot apply
        with pytest.raises(ValueError, match="per-sequence state"):
            sample(logits[:1], [stateful], [None])


def test_a_failed_batch_commits_nothing():
    bs = BatchSampler(6, "cpu", rows=2)
    pen = bs.open(SamplingParams(frequency_penalty=1.0))
    bad = bs.open(SamplingParams(temperature=1.0, seed=1, logit_bias=((0, 1.0),)))
    logits = torch.tensor([[0.0, 1, 2, 3, 4, 5], [float("nan")] * 6])
    with pytest.raises(ValueError, match="no finite logit"):
        bs.sample(logits, [pen, bad])
    assert int(bs.counts.sum()) == 0 and pen.n_sampled == bad.n_sampled == 0
    assert bs.sample(logits[:1], [pen]) == [5] and int(bs.counts.sum()) == 1
    bs.close(pen)
    assert bs._free and pen.row is None and not math.isnan(float(bs.counts.sum()))


def test_grammar_keeps_sampled_text_inside_a_json_schema():
    """Constrained decoding over a real byte-level BPE vocabulary (the tokenizers JSON llguidance reads, model rows
    padded past it): random logits, greedy and sampled rows in one batch beside an unconstrained row; each
    constrained row's text parses and follows the schema, and ends with EOS once the object is complete."""
    import json

    from llguidance import LLMatcher
    from tiny_models import json_bpe_tokenizer

    from hybrid.runtime.sampling import BatchSampler, SamplingParams
    from hybrid.server.adapter import grammar_tokenizer

    tok = json_bpe_tokenizer()
    eos, V = tok.token_to_id("<eos>"), tok.get_vocab_size() + 20  # the model's rows past the tokenizer's

    class Wrapped:
        def __init__(self):
            self.tok = tok

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(schema)
    bs = BatchSampler(V, "cpu", rows=3)
    bs.grammar_tokenizer = lambda: grammar_tokenizer(Wrapped(), V, [eos])
    rows = [bs.open(SamplingParams(grammar=grammar)), bs.open(SamplingParams(temperature=1.0, seed=5, grammar=grammar)),
            bs.open(SamplingParams())]
    out = [[] for _ in rows]
    done = [False, False, False]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(3, V, generator=g) * 3
        for i, t in enumerate(bs.sample(logits, rows)):
            if not done[i]:
                if t == eos and i < 2:
                    done[i] = True
                else:
                    out[i].append(t)
        if done[0] and done[1]:
            break
    assert done[0] and done[1]
    for ids in out[:2]:
        assert all(t < tok.get_vocab_size() for t in ids)  # never a padding row
        obj = json.loads(tok.decode(ids))
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and len(obj["name"]) <= 8
    # the unconstrained row beside them is not masked: its argmax of random logits reaches the padding rows
    assert any(t >= tok.get_vocab_size() for t in out[2]) and not rows[2].shaping
