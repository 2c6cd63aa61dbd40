"""The OpenAI server's request limits at their edges: a prompt one token short of the context and one at it,
max_tokens exactly the room left, the last token id of the vocabulary, the most choices, seed and stop strings
allowed, a histogram value on a bucket's bound, the tokens/s window, a batched prefill that exactly fills a slot."""

from __future__ import annotations

import pytest

from hybrid.runtime import Engine
from hybrid.server import metrics as metrics_mod
from hybrid.server import routes
from hybrid.server.adapter import Runtime
from hybrid.server.errors import ApiError
from hybrid.server.metrics import Histogram, Metrics
from hybrid.server.schemas import MAX_SEED, MAX_STOP_STRINGS, parse_request
from hybrid.server.testing import FakeTokenizer, fake_runtime


def completion(**body):
    return parse_request({"prompt": "x", **body}, chat=False, max_choices=4)


def test_prompt_length_against_the_context():
    ctx = 16
    assert routes._max_tokens(completion(), ctx - 1, ctx) == 1  # one token of room is room
    with pytest.raises(ApiError) as e:
        routes._max_tokens(completion(), ctx, ctx)  # a full context leaves no room for a completion
    assert e.value.code == "context_length_exceeded"


def test_max_tokens_may_use_exactly_the_room_left():
    ctx, n = 16, 10
    assert routes._max_tokens(completion(max_tokens=ctx - n), n, ctx) == ctx - n
    with pytest.raises(ApiError) as e:
        routes._max_tokens(completion(max_tokens=ctx - n + 1), n, ctx)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_token_ids_up_to_the_last_of_the_vocabulary():
    rt = fake_runtime()
    V = rt.vocab_size
    assert routes._tokenize(rt, completion(prompt=[0, V - 1])) == [[0, V - 1]]
    with pytest.raises(ApiError, match=f"token id {V} is outside the vocabulary"):
        routes._tokenize(rt, completion(prompt=[0, V]))


def test_the_largest_allowed_n_seed_and_stop_list():
    assert parse_request({"prompt": "x", "n": 4}, chat=False, max_choices=4).n == 4
    with pytest.raises(ApiError) as e:
        parse_request({"prompt": "x", "n": 5}, chat=False, max_choices=4)
    assert e.value.param == "n"
    assert completion(seed=MAX_SEED).sampling.seed == MAX_SEED
    with pytest.raises(ApiError):
        completion(seed=MAX_SEED + 1)
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert completion(stop=stops).sampling.stop == tuple(stops)
    with pytest.raises(ApiError, match="at most"):
        completion(stop=stops + ["one more"])


def test_histogram_counts_a_value_on_a_bound_in_that_bucket():
    h = Histogram(buckets=(0.5, 1.0, 2.0))
    h.observe(1.0)  # Prometheus buckets are "le": less than or equal
    assert h.counts[:3] == [0, 1, 1]


def test_tokens_per_s_forgets_tokens_older_than_its_window(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: now[0])
    m = Metrics()
    m.generated(50)
    now[0] += metrics_mod.TOKENS_PER_S_WINDOW_S / 2
    m.generated(10)
    now[0] += metrics_mod.TOKENS_PER_S_WINDOW_S / 2 + 1.0  # the first 50 are now past the window, the 10 not
    assert m.tokens_per_s() == pytest.approx(10 / metrics_mod.TOKENS_PER_S_WINDOW_S)


def test_batched_prefill_may_fill_a_slot_exactly(demo_model_1layer):
    rt = Runtime(Engine(demo_model_1layer, max_batch=2, max_context=8), FakeTokenizer(), batch_prefill="on")
    a, b = rt.engine.allocate_slot(), rt.engine.allocate_slot()
    logits = rt.prefill([a, b], [list(range(8)), list(range(3))])  # slot a: exactly max_context tokens
    assert logits.shape[0] == 2 and rt.engine.lengths[a] == 8 and rt.engine.lengths[b] == 3
    with pytest.raises(ValueError, match="exceed max_context"):
        rt.prefill([a, b], [[1], [2]])  # one more token for slot a
    assert rt.engine.lengths[a] == 8 and rt.engine.lengths[b] == 3  # nothing advanced on the failure
