"""A long pass over a long cache attends in blocks (hybrid.models.layers.ATTENTION_BLOCK_BYTES): grouped-query
attention and gpt-oss's sink attention in query blocks, MLA in head groups and query blocks. With a block small
enough to split every pass, a prompt prefilled in passes and the decode steps after it give the logits of the
unsplit run; a decode step is never split; and the memory model prices one block, not the whole context."""

from __future__ import annotations

import pytest
import torch

from hybrid.models import layers, load_model
from hybrid.runtime import Engine
from hybrid.runtime.config import RuntimeConfig


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU box)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _run(model, prompt: list[int], chunk: int) -> list[torch.Tensor]:
    e = Engine(model, config=RuntimeConfig(max_batch=2, max_context=96, eager=True, prefill_chunk=chunk))
    a, b = e.allocate_slot(), e.allocate_slot()
    out = [e.prefill(a, prompt), e.prefill(b, prompt[: len(prompt) // 2])]
    last = [int(out[0].argmax()), int(out[1].argmax())]
    for _ in range(3):  # batch-2 decode at two lengths: the rows' masks differ
        logits = e.decode_step([a, b], last)
        out.append(logits)
        last = [int(x) for x in logits.argmax(-1)]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_blocked_attention_gives_the_unsplit_logits(family, device, tmp_path, monkeypatch):
    """(On CUDA, fp32: SDPA's memory-efficient kernel with masks, MLA's values padded to the keys' width.)"""
    from tiny_models import make_checkpoint

    make_checkpoint(family, tmp_path, bf16_values=True)
    model = load_model(tmp_path, device=device, dtype=torch.float32, progress=False)
    prompt = [(7 * i + 3) % 200 + 2 for i in range(70)]
    whole = _run(model, prompt, chunk=32)  # passes of 32 tokens: the later ones read the cache

    calls = []
    real = layers.query_block
    monkeypatch.setattr(layers, "ATTENTION_BLOCK_BYTES", 4096)
    spy = (lambda T, per, _r=real: calls.append((T, _r(T, per))) or calls[-1][1])
    monkeypatch.setattr(layers, "query_block", spy)
    from hybrid.models import mla

    monkeypatch.setattr(mla, "query_block", spy)
    split = _run(model, prompt, chunk=32)
    assert any(c < T for T, c in calls), "the small block split nothing"
    decode = [c for T, c in calls if T == 1]
    assert all(c == 1 for c in decode), "a decode step was split"
    if family != "deepseek_v3" and device == "cpu":  # (MLA decodes in latent space, and on CUDA grouped-query
        assert decode, "decode steps did not reach the blocks"  # decode runs the fused kernels: both outside them)
    tol = 1e-5 if device == "cpu" else 2e-4  # CUDA: TF32-free fp32, other kernels per block shape
    for w, s in zip(whole, split):
        torch.testing.assert_close(s, w, rtol=tol, atol=tol)


def test_sink_attention_in_place_softmax_matches_the_formula():
    """sink_attention's in-place probabilities against the written-out softmax with one more logit per head."""
    torch.manual_seed(0)
    B, Hkv, rep, T, L, hd = 2, 2, 3, 5, 9, 8
    qg, kc, vc = torch.randn(B, Hkv, rep * T, hd), torch.randn(B, Hkv, L, hd), torch.randn(B, Hkv, L, hd)
    mask = torch.rand(B, 1, rep * T, L) < 0.7
    mask[..., 0] = True
    sinks = torch.randn(Hkv * rep)
    s = (qg @ kc.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~mask, float("-inf")).view(B, Hkv, rep, T, L)
    full = torch.cat((s, sinks.view(1, Hkv, rep, 1, 1).expand(B, Hkv, rep, T, 1)), dim=-1).softmax(-1)[..., :L]
    want = (full.reshape(B, Hkv, rep * T, L) @ vc)
    for chunk in (1, 2 * Hkv * rep * L, 10**9):
        got = layers.sink_attention(qg, kc, vc, mask, sinks, 0.3, rep, chunk_values=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_memory_model_prices_one_block_not_the_whole_context():
    """placement.memory.context_bytes: MLA's expansion and a pass's folded mask stop growing with the context
    once they pass the runtime's block; below it they are the whole tensors."""
    from hybrid.models.families import family_for
    from hybrid.models.presets import published_config
    from placement import memory

    def preset_config(name):
        raw = published_config(name)
        return family_for(raw).parse_config(raw)

    assert memory.ATTENTION_BLOCK_BYTES == layers.ATTENTION_BLOCK_BYTES and memory.SINK_SCORE_BYTES == layers.SINK_SCORE_BYTES
    dsv3, q235 = preset_config("deepseek-v3"), preset_config("qwen3-235b-a22b")
    block = layers.ATTENTION_BLOCK_BYTES
    for cfg in (dsv3, q235):
        at_32k = memory.context_bytes(cfg, 2048, 32768, 2)
        at_128k = memory.context_bytes(cfg, 2048, 131072, 2)
        assert at_32k <= 2 * block and at_128k <= 2 * block
    # a small pass over a short context: the whole mask (rep x T x L, bool and bf16)
    rep = q235.num_heads // q235.num_kv_heads
    assert memory.context_bytes(q235, 16, 64, 2) == rep * 16 * 64 * 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [None, 4096])
def test_mla_passes_over_the_cache_attend_aligned_to_the_last_key_as_the_mask_does(device, block, tmp_path,
                                                                                    monkeypatch):
    """A prompt's later prefill passes (Engine.prefill: rows end at the last key) attend in MLA's expanded form with a
    causal bias aligned to the last key (no mask built; flash kernels on CUDA): the logits of the masked form, in one
    call and in head groups and query blocks (each block's keys cut at its last query)."""
    from tiny_models import make_checkpoint

    from hybrid.models import mla

    make_checkpoint("deepseek_v3", tmp_path, bf16_values=True)
    model = load_model(tmp_path, device=device, dtype=torch.float32, progress=False)
    for layer in model.layers:
        layer.attn.mode = "expanded"  # every pass over the cache, short ones too
    if block is not None:
        monkeypatch.setattr(layers, "ATTENTION_BLOCK_BYTES", block)
    prompt = [(5 * i + 1) % 200 + 2 for i in range(70)]
    biases = []
    real = mla.causal_lower_right
    monkeypatch.setattr(mla, "causal_lower_right", lambda t, n: biases.append((t, n)) or real(t, n))
    aligned = _run(model, prompt, chunk=24)
    assert biases and all(n >= t for t, n in biases)
    if block is not None:
        assert any(n < 48 for t, n in biases if t < 24), "no block's keys were cut"
    monkeypatch.setattr(mla, "TAIL", "not this step's key")  # the masked form
    del biases[:]
    masked = _run(model, prompt, chunk=24)
    assert not biases
    tol = 1e-5 if device == "cpu" else 2e-4
    for a, m in zip(aligned, masked):
        torch.testing.assert_close(a, m, rtol=tol, atol=tol)
