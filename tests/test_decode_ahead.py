"""Greedy decode queued ahead (Engine.decode_queue, the generate loop's one-step lookahead) on the CPU: the same
tokens, finish reasons, streamed text and slot lengths as the step-by-step loop, through stop tokens that end
one row while its batch mates run on, more prompts than slots, the context limit, length limits and a
conversation's held prefix. (On the GPU the queued steps are CUDA graph replays: tests/test_generate_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine, SamplingParams
from hybrid.runtime.config import RuntimeConfig
from hybrid.runtime.generation import Conversation


@pytest.fixture(scope="module")
def model():
    raw = hf_config("demo", layers=2)
    cfg = family_for(raw).parse_config(raw)
    return init_random_(build_empty(cfg, "cpu", torch.float32), seed=0, std=0.1)


def engines(model, max_batch=3, max_context=64):
    return {ahead: Engine(model, config=RuntimeConfig(max_batch=max_batch, max_context=max_context,
                                                      decode_ahead=ahead)) for ahead in (False, True)}


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def run(e, ps, n, **kw):
    streamed = {}
    out = e.generate(ps, n, stream=lambda i, t, d: streamed.setdefault(i, []).append(t), **kw)
    return [(c.token_ids, c.finish_reason) for c in out], streamed


def test_default_is_off_when_eager_and_config_forces_it(model):
    assert Engine(model, max_batch=1, max_context=16).decode_ahead is False
    assert Engine(model, config=RuntimeConfig(max_batch=1, max_context=16, decode_ahead=True)).decode_ahead


def test_same_tokens_as_step_by_step_when_a_stop_token_ends_one_row_early(model):
    es = engines(model)
    ps = prompts((5, 9, 3))
    free = run(es[False], ps, 12, stop_token_ids=[])[0]
    stop = free[1][0][4]  # row 1's fifth token: row 1 stops there, the others (unless they hit it) run on
    ref, ref_stream = run(es[False], ps, 12, stop_token_ids=[stop])
    got, got_stream = run(es[True], ps, 12, stop_token_ids=[stop])
    assert got == ref and got_stream == ref_stream
    assert ref[1] == (free[1][0][:4], "stop")  # the scenario is the intended one
    assert any(reason == "length" for _, reason in ref)
    assert es[True].free_slots == es[False].free_slots == 3


def test_more_prompts_than_slots_and_a_batch_that_changes(model):
    es = engines(model, max_batch=2)
    ps = prompts((4, 7, 2, 6, 5), seed=1)
    limits = {}
    for ahead, e in es.items():
        limits[ahead] = run(e, ps, 9, stop_token_ids=[])[0]
    assert limits[True] == limits[False]
    assert all(len(t) == 9 and r == "length" for t, r in limits[True])


def test_context_limit_ends_rows_as_step_by_step(model):
    es = engines(model, max_batch=2, max_context=20)
    ps = prompts((14, 11), seed=2)
    ref = run(es[False], ps, 30, stop_token_ids=[])[0]
    assert run(es[True], ps, 30, stop_token_ids=[])[0] == ref
    assert [len(t) for t, _ in ref] == [20 - 14 + 1, 20 - 11 + 1] and {r for _, r in ref} == {"length"}


def test_length_limits_of_one_and_two_tokens(model):
    es = engines(model, max_batch=2)
    ps = prompts((3, 8), seed=3)
    for n in (1, 2, 3):
        assert run(es[True], ps, n, stop_token_ids=[])[0] == run(es[False], ps, n, stop_token_ids=[])[0]


def test_a_sampled_row_turns_the_lookahead_off_for_its_batch(model):
    es = engines(model, max_batch=2)
    ps = prompts((5, 6), seed=4)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=7)]
    got = es[True].generate(ps, 8, sampling=params, stop_token_ids=[])
    ref = es[False].generate(ps, 8, sampling=params, stop_token_ids=[])
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]


def test_a_conversation_holds_what_its_slot_holds(model):
    """A queued step past a stop token feeds the last token: the slot then holds one position more, and the next
    turn (which prefills only what is new after the held prefix) must still give the step-by-step tokens."""
    es = engines(model, max_batch=1)
    first, second = prompts((6,), seed=5)[0], None
    free = es[False].generate([first], 10, stop_token_ids=[])[0].token_ids
    stop = free[3]
    turns = {}
    for ahead, e in es.items():
        conv = Conversation.open(e)
        a = e.generate([first], 10, stop_token_ids=[stop], conversation=conv)[0]
        second = first + a.token_ids + [stop, 5, 6, 7]
        b = e.generate([second], 6, stop_token_ids=[], conversation=conv)[0]
        turns[ahead] = (a.token_ids, a.finish_reason, b.token_ids, conv.held)
        assert conv.held == (second + b.token_ids)[:len(conv.held)]
        assert e.lengths[conv.slot] >= len(conv.held)
        conv.close(e)
    assert turns[True][:3] == turns[False][:3] and turns[True][1] == "stop"


def test_decode_queue_chain_matches_decode_step(model):
    es = engines(model, max_batch=2)
    ps = prompts((4, 9), seed=6)
    seqs = {}
    for ahead, e in es.items():
        slots = [e.allocate_slot() for _ in ps]
        first = [int(e.prefill(s, p).argmax()) for s, p in zip(slots, ps)]
        toks, rows = first, []
        if ahead:
            step = e.decode_queue(slots, first)
            for _ in range(5):
                nxt = e.decode_queue(slots)  # fed on the device, queued before the last step's tokens are read
                rows.append(step.tokens())
                assert step.lengths == [e.lengths[s] - 1 for s in slots]
                step = nxt
            rows.append(step.tokens())
        else:
            for _ in range(6):
                toks = e.decode_step(slots, toks).argmax(-1).tolist()
                rows.append(toks)
        seqs[ahead] = (rows, [e.lengths[s] for s in slots], e.stats.decode_tokens, e.stats.decode_steps)
        assert e.stats.decode_s > 0
    assert seqs[True] == seqs[False]


def test_decode_queue_refuses_to_feed_what_it_cannot(model):
    e = engines(model, max_batch=2)[True]
    a, b = e.allocate_slot(), e.allocate_slot()
    e.prefill(a, [1, 2, 3])
    e.prefill(b, [4, 5])
    with pytest.raises(ValueError, match="continues the step queued just before"):
        e.decode_queue([a, b])  # nothing queued yet
    e.decode_queue([a, b], [7, 8]).tokens()
    assert e.can_feed([a, b]) and not e.can_feed([b, a]) and not e.can_feed([a])
    e.decode_step([a], [9])  # another step in between: the chain is broken
    assert not e.can_feed([a, b])
    e.decode_queue([a, b], [7, 8])
    e.prefill(b, [6])  # so is a prefill
    assert not e.can_feed([a, b])
    e.decode_queue([a, b], [7, 8])
    assert e.can_feed([a, b])
    e.lengths[b] -= 1  # a slot's length rewritten in between (a conversation keeping part of its held prefix)
    assert not e.can_feed([a, b])
    with pytest.raises(ValueError, match="2 tokens for 1 slots"):
        e.decode_queue([a], [1, 2])
    e.lengths[a] = e.max_context
    with pytest.raises(ValueError, match="max_context"):
        e.decode_queue([a], [1])
