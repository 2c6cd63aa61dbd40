"""Constrained decoding's masks (hybrid.runtime.sampling.BatchSampler): computed in the background as soon as a
token is consumed, kept as llguidance's packed int32 bitmask and unpacked on the logits' device.

Against the one-bool-per-token mask (llguidance's compute_bitmask unpacked with numpy, masked row by row): the
same tokens blocked at every step of a real JSON-schema grammar over a small byte-level BPE vocabulary, for
tokenizer vocabularies that are and are not a multiple of 32 and logits as wide as the vocabulary, wider inside
the last packed word and wider past it; the same for a matcher that is stopped or in error. A failing background
computation raises where the mask is waited for, every time; the first mask is computed while the caller goes
on; a batch of constrained rows beside unconstrained ones samples the tokens each gets alone; the server
scheduler's stop ends the mask threads.
"""

from __future__ import annotations

import json
import threading

import llguidance
import numpy as np
import pytest
import torch
from tiny_models import json_bpe_tokenizer

from hybrid.runtime.sampling import BatchSampler, SamplingParams, allowed_tokens, bit_values, fill_mask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TEXT = '{"name":"ada","age":36}'  # compact JSON that follows SCHEMA
LLMatcher = llguidance.LLMatcher  # the real one (a test below replaces llguidance's)
# on CUDA the packed masks are pinned and copied without blocking: the same tokens must come out
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA (GPU box)")])]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer of 300 tokens (not a multiple of 32) and its EOS id."""
    tok = json_bpe_tokenizer()
    assert tok.get_vocab_size() == 300
    return tok, tok.token_to_id("<eos>")


def ll_tokenizer(bpe, n_vocab: int):
    tok, eos = bpe
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=[eos])


def grammar() -> str:
    return LLMatcher.grammar_from_json_schema(SCHEMA)


def bool_blocked(matcher, width: int) -> torch.Tensor:
    """bool [width], True where the grammar forbids the token: the bitmask read one bool per token, ids past the
    tokenizer's vocabulary blocked (the reference the packed path must equal)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.zeros(width, dtype=bool)
    n = min(width, bits.size)
    allowed[:n] = bits[:n].astype(bool)
    return ~torch.from_numpy(allowed)


def bool_shaped(x: torch.Tensor, matcher) -> torch.Tensor:
    """One row x [V] masked by the reference: float64, -inf where bool_blocked."""
    return x.to(torch.float64).masked_fill(bool_blocked(matcher, x.shape[-1]), float("-inf"))


def forcing(token: int, width: int, device="cpu") -> torch.Tensor:
    """Logits [1, width] that make `token` the argmax (random elsewhere, so other tokens are masked too)."""
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(token))
    x[0, token] = 1000.0
    return x.to(device)


# --- (a) the packed path blocks what the bool path blocks -------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_vocab, width", [(300, 300), (300, 310), (300, 333), (320, 320), (320, 352)])
def test_packed_masks_block_exactly_the_tokens_the_bool_mask_blocks(bpe, n_vocab, width, device):
    """Walk a JSON-schema grammar through TEXT and its EOS: at each step the sampler's shaped row equals the bool
    reference (padding columns past the vocabulary at -inf), and the forced token is the one chosen."""
    tok, eos = bpe
    bs = BatchSampler(width, device)
    bs.grammar_tokenizer = lambda: ll_tokenizer(bpe, n_vocab)
    s = bs.open(SamplingParams(grammar=grammar()))
    path = tok.encode(TEXT).ids + [eos]
    for t in path:
        x = forcing(t, width, device)
        y = bs.shape(x, [s]).cpu()  # waits for the background mask; the matcher is idle until the next consume
        want = bool_shaped(x[0].cpu(), s.matcher)
        assert torch.equal(y[0], want)
        assert torch.isinf(y[0, n_vocab:]).all() and bool(torch.isfinite(y[0, t]))
        assert bs.sample(x, [s]) == [t]
    assert s.matcher.is_stopped()
    x = torch.randn(1, width, generator=torch.Generator().manual_seed(7))
    assert torch.equal(bs.shape(x.to(device), [s])[0].cpu(), bool_shaped(x[0], s.matcher))  # stopped: as the bool path
    bs.shutdown()


def test_stopped_and_failed_matchers_give_the_bool_masks(bpe):
    """fill_mask + allowed_tokens against the bool reference for a matcher fresh, stopped (grammar complete) and in
    error (a token outside the grammar consumed), over a vocabulary of 300 and logits 333 wide."""
    tok, eos = bpe
    vocab = ll_tokenizer(bpe, 300)
    words = (vocab.vocab_size + 31) // 32
    values = bit_values("cpu")
    fresh = LLMatcher(vocab, grammar())
    stopped = LLMatcher(vocab, grammar())
    assert stopped.consume_tokens(tok.encode(TEXT).ids) and stopped.is_accepting()
    ended = stopped.deep_copy()
    assert ended.consume_token(eos) and ended.is_stopped()
    failed = LLMatcher(vocab, grammar())
    assert not failed.consume_token(tok.encode("plain").ids[0]) and failed.is_error()
    for m in (fresh, stopped, ended, failed):
        bits = fill_mask(m, torch.full((words,), -1, dtype=torch.int32))
        assert torch.equal(~allowed_tokens(bits[None], 333, values)[0], bool_blocked(m, 333))
        assert torch.equal(~allowed_tokens(bits[None], 300, values)[0], bool_blocked(m, 300))


def test_allowed_tokens_reads_every_bit_of_a_word():
    """Bit i of word w is token 32 w + i, the sign bit included; columns past the words are not allowed."""
    bits = torch.tensor([[1 | (1 << 5), -(1 << 31)], [0, -1]], dtype=torch.int32)
    allowed = allowed_tokens(bits, 70, bit_values("cpu"))
    assert allowed.shape == (2, 70)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 5, 63]
    assert torch.nonzero(allowed[1]).flatten().tolist() == list(range(32, 64))
    assert torch.equal(allowed_tokens(bits, 40, bit_values("cpu")), allowed[:, :40])


# --- (b) the background computation ------------------------------------------------------------------------------
class Wrapped:
    """An LLMatcher whose mask computation can be made to fail or wait (every other call goes to the real one)."""

    fail = False
    gate: threading.Event | None = None
    threads: list[threading.Thread] = []  # where each mask was computed

    def __init__(self, vocab, grammar):
        self.real = LLMatcher(vocab, grammar)

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        Wrapped.threads.append(threading.current_thread())
        if Wrapped.gate is not None:
            assert Wrapped.gate.wait(30)
        if Wrapped.fail:
            raise RuntimeError("mask computation failed")
        return self.real.unsafe_compute_mask_ptr(ptr, nbytes)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def wrapped(monkeypatch):
    monkeypatch.setattr(llguidance, "LLMatcher", Wrapped)
    monkeypatch.setattr(Wrapped, "fail", False)
    monkeypatch.setattr(Wrapped, "gate", None)
    monkeypatch.setattr(Wrapped, "threads", [])
    return Wrapped


def test_an_error_of_the_background_mask_raises_at_every_wait(bpe, wrapped):
    """A failed mask is never a row sampled unmasked: the batch raises, so does each retry of the row, and its
    batch mate samples alone."""
    bs = BatchSampler(320, "cpu", rows=2)
    bs.grammar_tokenizer = lambda: ll_tokenizer(bpe, 300)
    wrapped.fail = True
    bad = bs.open(SamplingParams(grammar=grammar()))
    free = bs.open(SamplingParams(presence_penalty=0.5))
    logits = torch.randn(2, 320, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="mask computation failed"):
            bs.sample(logits, [bad, free])
        with pytest.raises(RuntimeError, match="mask computation failed"):
            bs.sample(logits[:1], [bad])
    assert bad.n_sampled == free.n_sampled == 0
    assert bs.sample(logits[1:], [free]) == [int(logits[1].argmax())]
    bs.shutdown()


def test_the_first_mask_is_computed_while_the_caller_goes_on(bpe, wrapped):
    """open() returns while the first mask is still being computed on the sampler's own thread; sampling waits for
    it. Each consumed token starts the next mask there too; shutdown ends the threads, and a later grammar starts
    new ones."""
    tok, eos = bpe
    bs = BatchSampler(300, "cpu")
    bs.grammar_tokenizer = lambda: ll_tokenizer(bpe, 300)
    wrapped.gate = threading.Event()
    s = bs.open(SamplingParams(grammar=grammar()))
    assert not s.next_mask.done()  # held at the gate: nothing waited for it
    wrapped.gate.set()
    first = tok.encode(TEXT).ids[0]
    assert bs.sample(forcing(first, 300), [s]) == [first]
    s.next_mask.result()
    assert len(wrapped.threads) == 2 and all(t.name.startswith("hybrid-grammar") for t in wrapped.threads)
    bs.close(s)
    bs.shutdown()
    assert not any(t.is_alive() for t in wrapped.threads)
    again = bs.open(SamplingParams(grammar=grammar()))
    assert bs.sample(forcing(first, 300), [again]) == [first]
    bs.shutdown()


# --- (c) batched rows sample what they sample alone ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_constrained_and_free_rows_batched_sample_what_each_samples_alone(bpe, device):
    """Three constrained rows (greedy; seeded temperature with top_p; logit bias, a penalty and min_tokens) between
    two free ones (greedy; penalized), over logits wider than the vocabulary: the batch's tokens equal each row
    sampled alone by its own sampler, step after step, and the constrained texts follow the schema."""
    tok, eos = bpe
    width = 333
    params = [SamplingParams(),
              SamplingParams(grammar=grammar()),
              SamplingParams(temperature=0.9, top_p=0.95, seed=11, grammar=grammar()),
              SamplingParams(frequency_penalty=0.5),
              SamplingParams(logit_bias=((5, 2.0),), presence_penalty=0.3, min_tokens=2, grammar=grammar())]
    batched, alone = BatchSampler(width, device, rows=2), BatchSampler(width, device, rows=2)
    vocab = ll_tokenizer(bpe, 300)
    batched.grammar_tokenizer = alone.grammar_tokenizer = lambda: vocab
    rows = [batched.open(p, end_ids=[eos]) for p in params]
    solo = [alone.open(p, end_ids=[eos]) for p in params]
    out = [[] for _ in params]
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        live = [i for i in range(len(params)) if not (out[i] and out[i][-1] == eos)]
        if all(params[i].grammar is None for i in live):
            break
        logits = (torch.randn(len(live), width, generator=g) * 3).to(device)
        got = batched.sample(logits, [rows[i] for i in live])
        want = [alone.sample(logits[k : k + 1], [solo[i]])[0] for k, i in enumerate(live)]
        assert got == want
        for i, t in zip(live, got):
            out[i].append(t)
    for i in (1, 2, 4):
        assert out[i][-1] == eos and all(t < 300 for t in out[i])
        obj = json.loads(tok.decode(out[i][:-1]))
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    assert any(t >= 300 for t in out[0])  # the free rows are not masked: their argmax reaches the padding columns
    batched.shutdown()
    alone.shutdown()


def test_stopping_the_server_scheduler_ends_the_mask_threads():
    """The scheduler's stop ends the threads its runtime's sampler computes masks on (once the engine is done)."""
    from hybrid.server.metrics import Metrics
    from hybrid.server.scheduler import Scheduler
    from hybrid.server.testing import fake_runtime

    rt = fake_runtime()
    sched = Scheduler(rt, Metrics(), max_queue=4, prefill_chunk=16)
    before = set(threading.enumerate())
    s = rt.open_sampler(SamplingParams(grammar=LLMatcher.grammar_from_regex("[0-9]+")), [1, 2], None, [0])
    s.next_mask.result()
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("hybrid-grammar")]
    assert started
    sched.start()
    sched.stop()
    assert not any(t.is_alive() for t in started)
