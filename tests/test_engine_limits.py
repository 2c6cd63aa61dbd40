"""The engine's limits at their edges (hybrid.runtime.engine): a prompt that exactly fills the context, the last
decodable position, a slot id one past the batch, and a KV cache exactly the size of the free memory."""

from __future__ import annotations

import pytest
import torch

from hybrid.errors import TooLarge
from hybrid.runtime import Engine
from hybrid.runtime import engine as engine_mod


@pytest.fixture(scope="module")
def model(demo_model_1layer):
    return demo_model_1layer


def test_a_prompt_may_fill_the_context_and_not_one_token_more(model):
    e = Engine(model, max_batch=1, max_context=8)
    s = e.allocate_slot()
    e.prefill(s, list(range(8)))  # exactly max_context tokens
    assert e.lengths[s] == 8
    e.free_slot(s)
    s = e.allocate_slot()
    e.prefill(s, list(range(5)))
    with pytest.raises(ValueError, match="exceed max_context"):
        e.prefill(s, list(range(4)))  # 5 + 4 > 8
    e.prefill(s, list(range(3)))  # 5 + 3 == 8 still fits
    assert e.lengths[s] == 8


def test_decode_writes_the_last_position_and_refuses_the_next(model):
    e = Engine(model, max_batch=1, max_context=8)
    s = e.allocate_slot()
    e.prefill(s, list(range(7)))  # positions 0..6; position 7 is the last one the cache holds
    logits = e.decode_step([s], [1])
    assert logits.shape[0] == 1 and e.lengths[s] == 8
    with pytest.raises(ValueError, match="reached max_context"):
        e.decode_step([s], [1])


def test_a_slot_id_past_the_batch_is_not_allocated(model):
    e = Engine(model, max_batch=2, max_context=8)
    for bad in (2, -1):
        with pytest.raises(ValueError, match="not allocated"):
            e.free_slot(bad)
    assert e.free_slots == 2


def test_kv_cache_exactly_the_free_memory_fits(model, monkeypatch):
    """The check refuses only a cache larger than the free memory (the CPU's available memory, faked here)."""
    import psutil

    cfg = model.cfg
    need = engine_mod.kv_cache_bytes(cfg, 2, 64, torch.float32)
    fake = type("Mem", (), {})()
    fake.available = need
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    engine_mod.check_kv_cache_fits(cfg, 2, 64, torch.float32, "cpu")  # exactly fits
    fake.available = need - 1
    with pytest.raises(TooLarge, match="--max-context 64 x --max-batch 2"):
        engine_mod.check_kv_cache_fits(cfg, 2, 64, torch.float32, "cpu")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_long_prompt_prefilled_in_passes_is_the_whole_prompt(family, tmp_path):
    """RuntimeConfig.prefill_chunk: a prompt longer than the pass runs in passes appended to its slot (grouped-query,
    MLA and sliding-window attention over what the earlier passes cached); the last token's logits, the lengths and
    the next decode step are the whole prompt's."""
    from tiny_models import make_checkpoint

    from hybrid.models import load_model
    from hybrid.runtime.config import RuntimeConfig

    make_checkpoint(family, tmp_path, bf16_values=True)
    m = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    prompt = [3, 17, 42, 99, 5, 250, 7, 64, 11, 23, 5, 77, 140]
    out = {}
    for chunk in (8192, 4, 5):
        e = Engine(m, config=RuntimeConfig(max_batch=1, max_context=32, eager=True, prefill_chunk=chunk))
        calls = []
        m.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[1]))
        s = e.allocate_slot()
        last = e.prefill(s, prompt)
        step = e.decode_step([s], [9])[0]
        m._forward_pre_hooks.clear()
        out[chunk] = (last, step, e.lengths[s], calls)
    whole = out[8192]
    assert whole[3] == [len(prompt), 1]
    for chunk in (4, 5):
        last, step, length, calls = out[chunk]
        assert calls[:-1] == [min(chunk, len(prompt) - a) for a in range(0, len(prompt), chunk)]  # passes, then decode
        assert length == whole[2] == len(prompt) + 1
        torch.testing.assert_close(last, whole[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step, whole[1], rtol=1e-5, atol=1e-5)


def test_prefill_chunk_is_checked():
    from hybrid.runtime.config import RuntimeConfig

    with pytest.raises(ValueError, match="prefill-chunk"):
        RuntimeConfig(prefill_chunk=0)


def test_mla_passes_over_the_cache_attend_expanded_and_decode_steps_absorbed(tmp_path, monkeypatch):
    """A later prefill pass reads the cache: past ABSORB_MAX_T tokens it builds keys and values per head (the latent
    form's H x T x L mask and scores would be 1+ GB at 2,048 x 4K); a decode step attends in latent space."""
    from tiny_models import make_checkpoint

    from hybrid.models import load_model
    from hybrid.models import mla
    from hybrid.runtime.config import RuntimeConfig

    make_checkpoint("deepseek_v3", tmp_path, bf16_values=True)
    m = load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    seen = []
    for name in ("_expanded", "_absorbed"):
        real = getattr(mla.MLAttention, name)
        monkeypatch.setattr(mla.MLAttention, name, lambda self, q_nope, *a, _r=real, _n=name:
                            seen.append((_n, q_nope.shape[1])) or _r(self, q_nope, *a))
    n = mla.ABSORB_MAX_T + 4
    for chunk, second in ((n, "_expanded"), (mla.ABSORB_MAX_T, "_absorbed")):
        seen.clear()
        e = Engine(m, config=RuntimeConfig(max_batch=1, max_context=64, eager=True, prefill_chunk=chunk))
        s = e.allocate_slot()
        e.prefill(s, list(range(3, 3 + 2 * chunk)))
        e.decode_step([s], [5])
        per_layer = len(seen) // 3
        assert [x for x, _ in seen[::per_layer]] == ["_expanded", second, "_absorbed"]
        assert [t for _, t in seen[::per_layer]] == [chunk, chunk, 1]
