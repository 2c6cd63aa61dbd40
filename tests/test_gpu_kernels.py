"""The fused decode kernels (hybrid.gpu_kernels) against the unfused torch chain they replace. Without CUDA
they run in Triton's interpreter on CPU tensors (tests/conftest.py selects it); on the GPU box the same tests
run compiled, on CUDA tensors (the `cuda` cases, marked gpu). Ragged shapes: non-power-of-two head dims,
partial rotary, one to twelve query heads per K/V head, padding rows, sliding windows, sinks, contexts over
several 256-position chunks; and whole models decoding through the fused path against the unfused one.

Where a bf16 value is rounded, the interpreter truncates (Triton 3.6's numpy cast) where the GPU rounds to
nearest even, so bf16 results are compared exactly on CUDA and within one bf16 step on the interpreter."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test]); install it")

from hybrid.gpu_kernels.attention import SPLIT, decode_attention, qk_rope_write  # noqa: E402
from hybrid.gpu_kernels.norm import add_rms_norm  # noqa: E402
from hybrid.models.layers import folded_causal_mask, sink_attention  # noqa: E402
from hybrid.models.rope import apply_rotary  # noqa: E402
from hybrid.runtime.kv_cache import StaticKVCache  # noqa: E402

DEVICES = ([pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA (GPU box)")])]
           + (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []))


def close(a, b, dtype, device, exact_on_cuda=False):
    """fp32: 1e-5; bf16: exact on CUDA where asked, else a couple of bf16 steps (roundings in another order)."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    elif exact_on_cuda and device == "cuda":
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,D,dtype", [(1, 2048, torch.float32), (5, 96, torch.float32), (3, 200, torch.bfloat16),
                                          (2, 2880, torch.bfloat16)])
def test_add_rms_norm_matches_the_unfused_pair(rows, D, dtype, device):
    g = torch.Generator().manual_seed(rows * D)
    h = torch.randn(rows, 1, D, generator=g).to(dtype)
    delta = torch.randn(rows, 1, D, generator=g)  # fp32 delta, as a lane's output may be
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)
    s, y = (t.cpu() for t in add_rms_norm(h.to(device), delta.to(device), w.to(device), 1e-6))
    ref_s = (h.float() + delta).to(dtype)
    assert s.shape == h.shape and s.dtype == dtype
    close(s, ref_s, dtype, device, exact_on_cuda=True)
    close(y, rms(s, w, 1e-6), dtype, device)


def unfused_qk(qkv, cos, sin, qw, kw, eps, clip, H, Hkv, hd):
    """The model's unfused order: split, clip, per-head norm, rotary over q and k."""
    B = qkv.shape[0]
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    if clip is not None:
        q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
    q, k, v = q.view(B, 1, H, hd), k.view(B, 1, Hkv, hd), v.view(B, 1, Hkv, hd)
    if qw is not None:
        q, k = rms(q, qw, eps), rms(k, kw, eps)
    qk = apply_rotary(torch.cat((q, k), dim=2), cos[:, None], sin[:, None])
    return qk[:, :, :H], qk[:, :, H:], v


CASES = [  # H, Hkv, hd, rd, norm, clip
    (8, 2, 16, 16, True, None),
    (6, 3, 24, 12, True, None),  # GLM: partial rotary, head dim not a power of two
    (4, 4, 32, 32, False, 0.5),  # OLMoE-style clip, no head norm, one query head per K/V head
    (12, 1, 64, 64, False, None),  # MQA: twelve query heads on one K/V head
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H,Hkv,hd,rd,norm,clip", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rope_write_matches_norm_rotary_and_cache_write(H, Hkv, hd, rd, norm, clip, dtype, device):
    g = torch.Generator().manual_seed(H * hd + rd)
    B, S, C = 4, 5, 40
    qkv = torch.randn(B, (H + 2 * Hkv) * hd, generator=g).to(dtype)
    ang = torch.rand(B, rd // 2, generator=g) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
    qw = (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.2 * torch.randn(hd, generator=g)).to(dtype) if norm else None
    slots = torch.tensor([3, 0, 4, 1])
    positions = torch.tensor([7, 0, -1, 39])  # row 2 is padding: it writes the spare column C
    fused = StaticKVCache(1, S, C, Hkv, hd, dtype=dtype, device=device)
    ref = StaticKVCache(1, S, C, Hkv, hd, dtype=dtype)
    for c in (fused, ref):
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(1)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(2)))
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    q = qk_rope_write(on(qkv), on(cos), on(sin), on(qw), on(kw), 1e-6, clip, fused.k[0], fused.v[0], on(slots),
                      on(positions), H, Hkv).cpu()
    rq, rk, rv = unfused_qk(qkv, cos, sin, qw, kw, 1e-6, clip, H, Hkv, hd)
    ref.write(0, slots, positions[:, None], rk, rv)
    close(q, rq[:, 0], dtype, device)
    close(fused.k.cpu(), ref.k, dtype, device)
    assert torch.equal(fused.v.cpu(), ref.v)  # v is only copied (and clipped)


def unfused_attention(q, cache, slots, positions, L, scale, window, sinks):
    """The model's unfused path: cache read of L positions, GQA folded into the query axis, the causal (and
    window) mask, SDPA or sink attention."""
    B, H, hd = q.shape
    Hkv = cache.k.shape[3]
    rep = H // Hkv
    kc, vc = (t.transpose(1, 2) for t in cache.read(0, slots, L))
    qg = q.view(B, 1, Hkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, rep, hd)
    mask = folded_causal_mask(positions[:, None], L, rep, window, {})
    if sinks is None:
        out = F.scaled_dot_product_attention(qg.float(), kc.float(), vc.float(), attn_mask=mask, scale=scale)
    else:
        out = sink_attention(qg.float(), kc.float(), vc.float(), mask, sinks, scale, rep)
    return out.reshape(B, H * hd)


ATTN = [  # H, Hkv, hd, L, window, sinks
    (8, 2, 16, 40, None, False),
    (6, 3, 24, 300, None, True),  # two chunks, sinks, hd not a power of two
    (12, 1, 64, 700, 90, False),  # three chunks, a window narrower than the chunk
    (4, 4, 32, 520, 300, True),  # a window over a chunk boundary, sinks, rep 1
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H,Hkv,hd,L,window,sinks", ATTN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_masked_sdpa_and_sink_attention(H, Hkv, hd, L, window, sinks, dtype, device):
    g = torch.Generator().manual_seed(H * L + hd)
    B, S = 4, 6
    cache = StaticKVCache(1, S, L + 10, Hkv, hd, dtype=dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(B, H, hd, generator=g).to(dtype)
    slots = torch.tensor([5, 2, 0, 3])
    positions = torch.tensor([L - 1, 0, -1, SPLIT + 3 if L > SPLIT + 3 else L // 2])
    sk = torch.randn(H, generator=g).to(dtype) if sinks else None
    scale = hd ** -0.5
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = decode_attention(on(q), on(cache.k[0]), on(cache.v[0]), on(slots), on(positions), L, scale, window,
                           on(sk)).cpu()
    ref = unfused_attention(q, cache, slots, positions, L, scale, window, sk)
    assert out.dtype == dtype
    close(out.float(), ref, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_does_not_depend_on_the_context_bucket(device):
    """Eager decode attends over max position + 1 and captured decode over the bucket: the same values, since
    the chunks' boundaries are fixed and chunks past a row's position contribute exactly nothing."""
    g = torch.Generator().manual_seed(3)
    cache = StaticKVCache(1, 2, 1024, 2, 16, device=device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(2, 4, 16, generator=g).to(device)
    slots, positions = torch.tensor([1, 0], device=device), torch.tensor([300, 40], device=device)
    outs = [decode_attention(q, cache.k[0], cache.v[0], slots, positions, L, 0.25) for L in (301, 512, 1024)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def tiny_greedy(family, tmp_path, extra=None):
    """A tiny random checkpoint of `family` loaded on the CPU -> (a function giving its greedy tokens for two fixed
    prompts, those tokens now, through the unfused chain the CPU runs). Interpreter runs only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs on CPU tensors through Triton's interpreter (machines without CUDA)")
    from hybrid.models import load_model
    from tiny_models import engine_greedy, make_checkpoint

    make_checkpoint(family, tmp_path, seed=3, extra=extra)
    model = load_model(tmp_path, progress=False)
    prompts = [[5, 17, 33, 2, 9, 41, 7], [8, 1, 60]]

    def greedy():
        return engine_greedy(model, prompts, n=6)

    return greedy, greedy()


@pytest.mark.parametrize("family,extra", [("qwen3_moe", None), ("gpt_oss", {"sinks": 1.0}),
                                          ("glm4_moe", {"e_score_correction_bias": 0.3}), ("mixtral", None),
                                          ("olmoe", None), ("deepseek_v3", {"e_score_correction_bias": 0.3})])
def test_models_decode_the_same_through_the_fused_kernels(family, extra, tmp_path, monkeypatch):
    """Greedy tokens and decode logits of tiny random models (fp32, on the CPU through the interpreter) with the
    fused kernels forced on equal the unfused chain's: q/k norm and YaRN (Qwen3), sinks and sliding windows
    (gpt-oss), partial rotary with a 24-dim head and biases (GLM), a window (Mixtral), full-width q/k norm with
    clipping (OLMoE: declines the fused attention, keeps the fused residual norms), DeepSeek-V3's MLA (not fused)
    with its group-limited sigmoid router (fused) and a dense first layer."""
    from hybrid import gpu_kernels
    from hybrid.gpu_kernels import attention

    greedy, want = tiny_greedy(family, tmp_path, extra)
    calls = []
    real = attention.decode_attention
    monkeypatch.setattr(gpu_kernels, "fused_enabled", lambda x: True)
    monkeypatch.setattr(attention, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert greedy() == want
    fused_attention = family not in ("olmoe", "deepseek_v3")
    assert bool(calls) == fused_attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,K,norm,scaling,dtype", [(1, 128, 8, True, 1.0, torch.bfloat16),
                                                     (5, 32, 4, False, 1.0, torch.float32),
                                                     (3, 60, 6, True, 2.5, torch.float32),
                                                     (4, 16, 1, False, 1.0, torch.bfloat16)])
def test_router_topk_matches_select_experts(T, E, K, norm, scaling, dtype, device):
    from hybrid.gpu_kernels.router import router_topk
    from hybrid.models.config import RouterConfig
    from hybrid.models.moe import select_experts

    g = torch.Generator().manual_seed(T * E + K)
    logits = torch.randn(T, E, generator=g).to(dtype)
    ids, w = (t.cpu() for t in router_topk(logits.to(device), K, norm, scaling))
    ref_ids, ref_w = select_experts(logits.float(), RouterConfig(kind="softmax", scaling=scaling), K, norm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # the same experts in the same (descending) order
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_router_gemv_topk_configs_agree(device):
    """Every block configuration in the router's table gives the same experts and weights."""
    from hybrid.gpu_kernels.router import GEMV_CONFIG, RouterScratch, router_gemv_topk

    g = torch.Generator().manual_seed(7)
    T, E, D, K = 3, 60, 2880, 6
    x, w = torch.randn(T, D, generator=g).to(device), (torch.randn(E, D, generator=g) / 50).to(device)
    b = (torch.randn(E, generator=g) * 0.1).to(device)
    want = router_gemv_topk(x, w, b, K, False, 1.0, RouterScratch(E, device), config=GEMV_CONFIG)
    for cfg in [(1, 512, 1), (8, 1024, 2), (16, 2048, 8)]:
        ids, wts = router_gemv_topk(x, w, b, K, False, 1.0, RouterScratch(E, device), config=cfg)
        assert torch.equal(ids, want[0]), cfg
        torch.testing.assert_close(wts, want[1], rtol=1e-5, atol=1e-6)


CUDA_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                               reason="bf16 rounding differs in Triton's interpreter (it truncates)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,D,K,bias,norm,scaling,dtype", [
    (1, 128, 2048, 8, False, True, 1.0, torch.float32),  # Qwen3-30B-A3B's router
    (8, 60, 96, 6, False, True, 2.5, torch.float32),  # E not a multiple of the 4 experts per program
    (3, 32, 2880, 4, True, False, 1.0, torch.float32),  # gpt-oss: bias, D over two 2048 chunks
    pytest.param(2, 128, 2048, 8, False, True, 1.0, torch.bfloat16, marks=CUDA_ONLY),
    pytest.param(5, 32, 2880, 4, True, True, 1.0, torch.bfloat16, marks=CUDA_ONLY),
])
def test_router_gemv_topk_matches_linear_and_select_experts(T, E, D, K, bias, norm, scaling, dtype, device):
    """The router GEMV + top-k kernel gives F.linear's logits' experts, in order, and their weights; with
    `into` it writes the same row, ids and weights to the CPU lane's targets too; its arrival counters are
    back at zero after each launch, so a second launch (a graph replay) with the same scratch agrees."""
    from hybrid.gpu_kernels.router import RouterScratch, router_gemv_supported, router_gemv_topk
    from hybrid.models.config import RouterConfig
    from hybrid.models.moe import select_experts

    g = torch.Generator().manual_seed(T * E + D + K)
    x = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) / D ** 0.5).to(dtype)
    b = (torch.randn(E, generator=g) * 0.1).to(dtype) if bias else None
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    assert router_gemv_supported(dev(x), dev(w))
    scratch = RouterScratch(E, device)
    into = (torch.zeros(T, D, dtype=dtype, device=device), torch.zeros(T, K, dtype=torch.int64, device=device),
            torch.zeros(T, K, dtype=torch.float32, device=device))
    # fp32 sums rounded once to the dtype, as the kernel does (cuBLAS sums in another order: at bf16 a logit
    # now and then lands one step away, which can swap near-tied experts)
    logits = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype).float()
    ref_ids, ref_w = select_experts(logits, RouterConfig(kind="softmax", scaling=scaling), K, norm)
    for launch in range(2):
        ids, wts = (t.cpu() for t in router_gemv_topk(dev(x), dev(w), dev(b), K, norm, scaling, scratch,
                                                      into=into if launch else None))
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids)
        else:  # bf16 logits tie often: the chosen logits must be the K largest, in order (ties: either)
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))
        torch.testing.assert_close(wts, ref_w, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-5)
        assert torch.equal(scratch.cnt.cpu(), torch.zeros_like(scratch.cnt.cpu()))
    px, pi, pw = (t.cpu() for t in into)
    assert torch.equal(px, x) and torch.equal(pi, ids) and torch.equal(pw, wts)
    assert not router_gemv_supported(dev(torch.randn(9, D).to(dtype)), dev(w))  # more rows than decode takes
    assert not router_gemv_supported(dev(x), dev(w.float() if dtype != torch.float32 else w.bfloat16()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,E,K,groups,topk_group,bias,norm,scaling", [
    (1, 256, 8, 8, 4, True, True, 2.5),  # DeepSeek-V3's router shape
    (3, 16, 4, 8, 3, True, True, 1.0),  # groups of two (Kimi-K2 style variant of the tiny tests)
    (5, 64, 6, 1, 1, True, False, 1.0),  # GLM-4.5: one group
    (2, 24, 3, 4, 2, False, True, 1.5),  # no score bias, groups of six (not a power of two)
])
def test_router_sigmoid_topk_matches_select_experts(T, E, K, groups, topk_group, bias, norm, scaling, device):
    from hybrid.gpu_kernels.router import router_sigmoid_topk
    from hybrid.models.config import RouterConfig
    from hybrid.models.moe import select_experts

    g = torch.Generator().manual_seed(T * E + K + groups)
    logits = torch.randn(T, E, generator=g) * 2
    sb = torch.randn(E, generator=g) * 0.3 if bias else None
    cfg = RouterConfig(kind="sigmoid", n_group=groups, topk_group=topk_group, scaling=scaling, score_bias=bias)
    ids, w = (t.cpu() for t in router_sigmoid_topk(logits.to(device), None if sb is None else sb.to(device), K, norm,
                                                   groups, topk_group, scaling))
    ref_ids, ref_w = select_experts(logits, cfg, K, norm, sb)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_fused_kernels_are_chosen_once_and_only_for_cuda(monkeypatch, caplog):
    """CPU tensors never take the fused path; HYBRID_FUSED_DECODE=0 is honoured and logged; =1 without Triton
    is an error, not a silent fallback."""
    import logging

    from cpu_kernels import knobs
    from hybrid import gpu_kernels

    assert not gpu_kernels.fused_enabled(torch.zeros(1))

    class FakeCuda:
        is_cuda = True
        device = "cuda:0"

    monkeypatch.setattr(gpu_kernels, "_STATE", {})
    monkeypatch.setenv(gpu_kernels.ENV, "0")
    knobs.reset()
    with caplog.at_level(logging.INFO, logger="hybrid.gpu_kernels"):
        assert not gpu_kernels.fused_enabled(FakeCuda())
    assert "HYBRID_FUSED_DECODE=0" in caplog.text and gpu_kernels.describe() == "off"
    monkeypatch.setenv(gpu_kernels.ENV, "1")
    knobs.reset()
    assert not gpu_kernels.fused_enabled(FakeCuda())  # decided once: the environment is read at the first call
    monkeypatch.setattr(gpu_kernels, "_STATE", {})
    monkeypatch.setattr(gpu_kernels, "_triton_version", lambda: None)
    with pytest.raises(RuntimeError, match="Triton does not import"):
        gpu_kernels.fused_enabled(FakeCuda())
