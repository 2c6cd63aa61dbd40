"""Prefix caching across requests (hybrid.runtime.prefix_cache): a slot given back keeps its tokens' K/V, and a later
prompt sharing a long enough prefix with it prefills only the rest, with the tokens and logits of a fresh engine.

Float64 models: a reused prefix and a prefill from scratch run different matmul shapes, which in float32 may
round differently and flip a random router's near-ties; in float64 any difference is a cache bug. Covered: the same
prompt again, a conversation resent whole, half a prefix, prompts diverging at the last token, a shared prefix too
short to reuse, more prefixes than slots (LRU), batches with a common prefix (Engine.generate, and the server's
batched, chunked prefill), gpt-oss's sliding window and sinks, DeepSeek-V3's latent cache, decode ahead stopping a
row early (eager here; the GPU's graph replays queue the same steps), an interrupted request, a closed
conversation, and the off switch."""

from __future__ import annotations

import pytest
import torch

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine, SamplingParams
from hybrid.runtime.batching import Batcher, Sequence
from hybrid.runtime.config import RuntimeConfig
from hybrid.runtime.generation import Conversation
from hybrid.runtime.prefix_cache import BLOCK, MIN_REUSE, PrefixCache, common_prefix
from hybrid.runtime.steps import EngineSteps

GREEDY = SamplingParams(temperature=0)
CONTEXT = 128


def build(raw: dict, seed: int):
    cfg = family_for(raw).parse_config(raw)
    return init_random_(build_empty(cfg, "cpu", torch.float64), seed=seed, std=0.1)


@pytest.fixture(scope="module")
def model():
    return build(hf_config("demo", layers=2), seed=5)


TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# gpt-oss: sliding layers (window 4, shorter than every reused prefix) around a full one, attention sinks
GPT_OSS = dict(TINY, model_type="gpt_oss", num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=4,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"], attention_bias=True,
               rope_theta=150000.0)
# DeepSeek-V3: Multi-head Latent Attention (one latent per token in the cache), a dense first layer
DEEPSEEK = dict(TINY, model_type="deepseek_v3", n_routed_experts=8, moe_intermediate_size=32, intermediate_size=96,
                n_shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, num_key_value_heads=4, rope_theta=10000.0)


def new_engine(model, max_batch=2, **config):
    return Engine(model, None, config=RuntimeConfig(max_batch=max_batch, max_context=CONTEXT, eager=True, **config))


def ids(n: int, seed: int, vocab: int = 250) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def recorded(engine) -> list[torch.Tensor]:
    """Every logits tensor engine.prefill and engine.decode_step return from now on, cloned (instance attributes
    shadow the methods)."""
    got = []
    for name in ("prefill", "decode_step"):
        def wrapped(*args, _real=getattr(engine, name), **kw):
            out = _real(*args, **kw)
            got.append(out.clone())
            return out

        setattr(engine, name, wrapped)
    return got


def generate(engine, prompts, n=5, stop=()):
    """-> (token ids per prompt, prompt tokens prefilled by the call, prompt tokens it reused from the cache)."""
    p0, r0 = engine.stats.prefill_tokens, engine.stats.prefix_tokens_reused
    out = engine.generate(prompts, max_new_tokens=n, sampling=GREEDY, stop_token_ids=list(stop))
    return [c.token_ids for c in out], engine.stats.prefill_tokens - p0, engine.stats.prefix_tokens_reused - r0


def assert_as_fresh(model, engine, prompt, n=5, atol=1e-10):
    """`prompt` on `engine` (whatever its cache holds) gives a fresh engine's tokens and logits, step by step.
    -> the prompt tokens it prefilled."""
    got = recorded(engine)
    tokens, prefilled, _ = generate(engine, [prompt], n)
    fresh = new_engine(model)
    ref = recorded(fresh)
    assert tokens == generate(fresh, [prompt], n)[0]
    assert len(got) == len(ref) == n
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    return prefilled


# --- the index ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7])
def test_common_prefix_finds_the_first_difference_across_blocks(at):
    a = list(range(3 * BLOCK))
    b = list(a)
    b[at] = -1
    assert common_prefix(a, b) == common_prefix(b, a) == at
    assert common_prefix(a, a[: at + 1]) == at + 1  # one list ends first
    assert common_prefix(a, []) == 0 and common_prefix(a, list(a)) == len(a)


def test_the_index_takes_the_longest_prefix_else_an_empty_slot_else_the_least_recently_used():
    c = PrefixCache(min_reuse=4)
    c.store(0, [1, 2, 3, 4, 5, 6])
    c.store(1, [1, 2, 3, 4, 9])
    assert c.choose([0, 1, 2], [1, 2, 3, 4, 5, 6, 7]) == (0, 6)
    assert c.choose([1, 2], [1, 2, 3, 4, 5, 6, 7]) == (1, 4)  # slot 0 is taken: the next best
    assert c.choose([0, 1], [1, 2, 3, 4, 5, 6]) == (0, 5)  # the whole prompt never: its last token is prefilled
    assert c.choose([0, 1, 2, 3], [1, 2, 3, 7]) == (3, 0)  # 3 shared < min_reuse: an empty slot, the last free
    assert c.choose([0, 1], [8, 8, 8, 8, 8]) == (0, 0)  # none empty: the least recently used
    c.store(0, [1, 2, 3, 4, 5, 6])  # slot 0 given back again: slot 1 is now the older one
    assert c.choose([0, 1], [8, 8, 8, 8, 8]) == (1, 0)
    c.store(1, [])  # nothing held: forgotten
    assert c.entries.keys() == {0}


# --- one engine, prompt after prompt ------------------------------------------------------------------------


def test_the_same_prompt_again_prefills_only_its_last_token(model):
    eng = new_engine(model)
    prompt = ids(40, seed=1)
    assert generate(eng, [prompt])[1:] == (40, 0)
    assert assert_as_fresh(model, eng, prompt) == 1
    st = eng.stats
    assert (st.prefix_lookups, st.prefix_hits, st.prefix_tokens_reused) == (2, 1, 39)
    assert st.prefix_hit_rate == 0.5 and eng.free_slots == 2


def test_a_conversation_resent_whole_prefills_only_what_is_new(model):
    eng = new_engine(model)
    turn1 = ids(40, seed=2)
    out = generate(eng, [turn1])[0][0]
    turn2 = turn1 + out + [7, 8, 9]
    # held: the prompt and the 4 generated tokens fed back (the 5th never was: its position holds nothing)
    assert assert_as_fresh(model, eng, turn2) == len(turn2) - (40 + 4)


def test_a_prompt_sharing_half_its_prefix_prefills_the_other_half(model):
    eng = new_engine(model)
    first = ids(40, seed=3)
    generate(eng, [first])
    assert assert_as_fresh(model, eng, first[:20] + ids(20, seed=4)) == 20


def test_prompts_diverging_at_the_last_token(model):
    eng = new_engine(model, max_batch=1)
    prompt = ids(30, seed=5)
    generate(eng, [prompt])
    assert assert_as_fresh(model, eng, prompt[:-1] + [(prompt[-1] + 1) % 250]) == 1
    assert assert_as_fresh(model, eng, prompt[:-1]) == 1  # a prompt the cached one extends


def test_a_shared_prefix_shorter_than_min_reuse_is_prefilled_whole(model):
    eng = new_engine(model, max_batch=1)
    prompt = ids(30, seed=6)
    generate(eng, [prompt])
    other = prompt[: MIN_REUSE - 1] + ids(10, seed=7)
    assert generate(eng, [other])[1:] == (len(other), 0)


def test_more_prefixes_than_slots_overwrite_the_least_recently_used(model):
    eng = new_engine(model, max_batch=2)
    a, b, c = (ids(24, seed=s) for s in (10, 11, 12))
    reused, scratch = [], new_engine(model, max_batch=1, prefix_cache=False)
    for prompt in (a, b, a + [1], c, a + [2], b + [3]):
        tokens, _, n = generate(eng, [prompt], n=2)
        reused.append(n)
        assert tokens == generate(scratch, [prompt], n=2)[0]
    # a, b fill both slots; a again hits; c overwrites b (a was used since); a hits again; b was overwritten
    assert reused == [0, 0, 24, 0, 24, 0]


def test_a_batch_with_a_common_prefix(model):
    eng = new_engine(model, max_batch=3)
    system = ids(32, seed=13)
    first = [system + ids(4, seed=s) for s in (14, 15, 16)]
    second = [system + ids(6, seed=s) for s in (17, 18, 19)]
    fresh = new_engine(model, max_batch=3, prefix_cache=False)
    tokens, _, reused = generate(eng, first)
    assert tokens == generate(fresh, first)[0] and reused == 0  # nothing cached yet
    tokens, prefilled, reused = generate(eng, second)
    assert tokens == generate(fresh, second)[0]
    assert (prefilled, reused) == (3 * 6, 3 * 32)  # each slot now holds the common prefix


def test_the_servers_batched_chunked_prefill_reuses_prefixes(model):
    """The server's loop: several prompts in one padded prefill pass, chunks of at most `prefill_chunk` tokens, each
    row continuing from its own reused length; a reused prefix ends a chunk early so later chunks keep their fixed
    boundaries."""
    eng = new_engine(model, max_batch=3)
    system = ids(30, seed=20)
    prompts = [system + ids(n, seed=s) for n, s in ((8, 21), (20, 22), (3, 23))]

    def serve(engine, ps):
        loop = Batcher(EngineSteps(engine, None, batch_prefill=True), prefill_chunk=16, isolate_errors=True)
        chunks = []
        real = loop.steps.prefill
        loop.steps.prefill = lambda slots, cs: chunks.append([len(c) for c in cs]) or real(slots, cs)
        seqs = [Sequence(p, 4, GREEDY, stop_ids=frozenset()) for p in ps]
        loop.submit(seqs)
        loop.run()
        return [s.token_ids for s in seqs], chunks

    first, _ = serve(eng, [system + [1, 2]])
    assert first == generate(new_engine(model), [system + [1, 2]], n=4)[0]
    before = eng.stats.prefill_tokens
    tokens, chunks = serve(eng, prompts)
    assert tokens == generate(new_engine(model, max_batch=3), prompts, n=4)[0]
    # the first prompt continues from the 30 shared tokens, its first chunk up to position 32; the second starts
    # empty; the third waits for room in a pass, by when the first has given back its slot, holding the prefix
    assert chunks[0] == [2] and sum(map(sum, chunks)) == eng.stats.prefill_tokens - before == 8 + 50 + 3
    assert eng.stats.prefix_tokens_reused == 30 + 30


# gpt-oss's sink attention computes its scores in float32 even in a float64 model, so a position's K/V depends in
# float32's last bits on how many rows its pass had (a prefill from scratch whose first pass is 24 tokens long instead
# of 20 differs as much); a wrong cache entry is off by orders of magnitude more
@pytest.mark.parametrize("raw, atol", [(GPT_OSS, 1e-5), (DEEPSEEK, 1e-10)], ids=["gpt_oss", "deepseek_v3"])
def test_sliding_window_sinks_and_latent_caches_reuse_exactly(raw, atol):
    tiny = build(raw, seed=7)
    eng = new_engine(tiny)
    turn1 = ids(24, seed=30)
    out = generate(eng, [turn1])[0][0]
    turn2 = turn1 + out + [3, 4]
    assert assert_as_fresh(tiny, eng, turn2, atol=atol) == len(turn2) - (24 + 4)
    assert assert_as_fresh(tiny, eng, turn1[:20] + [5, 6, 7], atol=atol) == 3


def test_decode_ahead_past_a_stop_token_leaves_exact_prefixes(model):
    """Queued steps run one past a row's stop token (its slot holds one position more than the row accepted); the
    prefixes left behind must still be exactly their tokens'."""
    prompts = [ids(20, seed=40), ids(26, seed=41)]
    plain = generate(new_engine(model, prefix_cache=False), prompts, n=8)[0]
    stop = plain[0][2]  # row 0 stops at its third token, row 1 runs on
    ahead = new_engine(model, decode_ahead=True)
    tokens = generate(ahead, prompts, n=8, stop=[stop])[0]
    assert tokens[0] == plain[0][:2] and tokens[1] == plain[1]
    follow = [p + t + [stop, 9, 9] for p, t in zip(prompts, tokens)]
    got, prefilled, reused = generate(ahead, follow, n=4)
    assert got == generate(new_engine(model, prefix_cache=False), follow, n=4)[0]
    # row 0 kept its prompt and both accepted tokens (not the stop token a queued step wrote past them); row 1, ended
    # by its length, its prompt and the 7 tokens fed back
    assert reused == (20 + 2) + (26 + 7) and prefilled == 3 + 4


def test_an_interrupted_request_leaves_only_what_it_wrote(model):
    eng = new_engine(model, max_batch=1)
    prompt = ids(30, seed=50)
    real, calls = eng.decode_step, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    eng.decode_step = failing
    with pytest.raises(KeyboardInterrupt):
        generate(eng, [prompt], n=8)
    del eng.decode_step
    assert eng.free_slots == 1
    # it had accepted 3 tokens, but only 2 were fed back (the step that would feed the 3rd failed)
    out = generate(new_engine(model), [prompt], n=3)[0][0]
    assert assert_as_fresh(model, eng, prompt + out + [5]) == 2


def test_a_closed_conversation_leaves_its_prefix_cached(model):
    eng = new_engine(model, max_batch=1)
    conv = Conversation.open(eng)
    turn = ids(30, seed=60)
    out = eng.generate([turn], max_new_tokens=3, sampling=GREEDY, stop_token_ids=[], conversation=conv)[0]
    conv.close(eng)
    assert assert_as_fresh(model, eng, turn + out.token_ids + [4]) == 2


def test_the_off_switch_prefills_every_prompt_whole(model):
    eng = new_engine(model, prefix_cache=False)
    assert eng.prefix_cache is None
    prompt = ids(30, seed=70)
    first = generate(eng, [prompt])
    assert generate(eng, [prompt]) == first and first[1:] == (30, 0)
    assert eng.stats.prefix_lookups == 0
    assert [eng.allocate_slot(), eng.allocate_slot()] == [0, 1]  # the engine's slot order as before
