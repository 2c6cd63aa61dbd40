"""Launch-count reductions of the decode step (each kernel is a node of the decode graph, whose per-layer floor
is launch-bound on the GPU): q/k/v from one GEMM over fused weights, and the KV-cache write index computed
once per step. Both must compute exactly what the unfused code computes."""

import torch
import torch.nn.functional as F

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime.kv_cache import StaticKVCache


def tiny_model(seed=0):
    raw = hf_config("demo")
    raw.update(num_hidden_layers=2, attention_bias=True)
    cfg = family_for(raw).parse_config(raw)
    model = build_empty(cfg, torch.device("cpu"), torch.float32)
    return init_random_(model, seed=seed)


def test_fused_qkv_matches_three_gemms_and_shares_the_weights():
    model = tiny_model()
    attn = model.layers[0].attn
    x = torch.randn(2, 3, model.cfg.hidden_size)
    want = tuple(F.linear(x, m.weight, m.bias) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    got = attn._qkv(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    w, b, _ = attn._fused
    assert attn.q_proj.weight.data_ptr() == w.data_ptr()  # views of one block: memory not doubled
    assert attn.v_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert b is not None and attn.k_proj.bias.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    # a weight replaced after fusing is seen: the block is built again from the parameters
    attn.k_proj.weight.data = torch.randn_like(attn.k_proj.weight)
    got = attn._qkv(x)
    torch.testing.assert_close(got[1], F.linear(x, attn.k_proj.weight, attn.k_proj.bias), rtol=0, atol=1e-6)


def test_write_index_shared_by_a_step_matches_per_layer_index():
    cache_a = StaticKVCache(2, 3, 8, num_kv_heads=2, head_dim=4)
    cache_b = StaticKVCache(2, 3, 8, num_kv_heads=2, head_dim=4)
    slots = torch.tensor([2, 0])
    positions = torch.tensor([[0, 1, -1], [5, 6, 7]])
    step = {}
    for layer in range(2):
        k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
        cache_a.write(layer, slots, positions, k, v)
        cache_b.write(layer, slots, positions, k, v, step=step)
        assert "kv_flat" in step
    for name in ("k", "v"):
        assert torch.equal(cache_a.buffers[name], cache_b.buffers[name])
    assert cache_a.k.abs().sum() > 0


def test_model_forward_unchanged_by_the_fusions():
    """Two forwards of the same model (the first fuses) and an unfused copy give the same logits."""
    a, b = tiny_model(1), tiny_model(1)
    ids = torch.tensor([[5, 17, 99, 3]])
    pos = torch.arange(4)[None]
    slots = torch.tensor([0])
    outs = []
    for model, fuse in ((a, True), (b, False)):
        if not fuse:
            for layer in model.layers:
                layer.attn._qkv = lambda x, at=layer.attn: (at.q_proj(x), at.k_proj(x), at.v_proj(x))
        cache = StaticKVCache.for_model(model, 1, 16)
        outs.append(model(ids, pos, slots, cache).clone())
    assert a.layers[0].attn._fused is not None
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
