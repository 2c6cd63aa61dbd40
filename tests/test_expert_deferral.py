"""Expert deferral (opt-in, --defer-experts N): each token's N lowest-ranked routed experts of a hybrid layer are
computed from that layer's input and added to the next hybrid layer's output; the last hybrid layer defers
nothing. Checked against a hand-written decoder loop over the plain model, for every schedule and resident
count, and for the effect it has (it changes the logits; with N = 0 nothing changes)."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.errors import UsageError
from hybrid.models import load_model
from hybrid.models.presets import hf_config
from hybrid.models.writer import write_random_checkpoint
from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig
from hybrid.runtime.kv_cache import StaticKVCache

IDS = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = hf_config("demo")
    cfg.update(vocab_size=256, num_hidden_layers=4, eos_token_id=None, pad_token_id=None)
    return write_random_checkpoint(tmp_path_factory.mktemp("defer") / "ckpt", cfg, seed=5, std=0.1)


def forward(model, ids=IDS):
    cache = StaticKVCache.for_model(model, 1, 32)
    return model(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), cache).float()


@torch.no_grad()
def deferred_reference(model, d: int, ids=IDS) -> torch.Tensor:
    """The plain model's decoder loop with deferral written out (the definition the runtime must meet)."""
    B, T = ids.shape
    pos, slots = torch.arange(T)[None], torch.tensor([0])
    cache = StaticKVCache.for_model(model, 1, 32)
    h = F.embedding(ids, model.embed)
    cos, sin = model.rotary(pos, h.dtype)
    masks, pending = {}, None
    moe_layers = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
    for i, layer in enumerate(model.layers):
        h = h + layer.attn(layer.attn_norm(h), cos, sin, pos, slots, cache, None, False, masks)
        x = layer.mlp_norm(h).view(B * T, -1)
        if layer.moe is None:
            h = h + layer.mlp(x).view(B, T, -1)
            continue
        tid, tw = layer.moe.route(x)
        K = tid.shape[1]
        dd = 0 if i == moe_layers[-1] else d
        out = layer.moe.experts(x, tid[:, :K - dd], tw[:, :K - dd])
        if pending is not None:
            out = out + pending
        pending = layer.moe.experts(x, tid[:, K - dd:], tw[:, K - dd:]) if dd else None
        h = h + out.view(B, T, -1)
    return F.linear(model.norm(h), model.embed if model.lm_head is None else model.lm_head).float()


@pytest.mark.parametrize("schedule,resident", [("cpu", 0), ("cost", 3), ("ship", 2), ("threshold:4", 5)])
def test_deferral_matches_the_written_out_definition(ckpt, schedule, resident):
    plain = load_model(ckpt, device="cpu", dtype=torch.float32, progress=False)
    want = deferred_reference(plain, 2)
    assert (want - forward(plain)).abs().max() > 1e-3  # deferral changes the model's output
    hcfg = HybridConfig(gpu_experts=resident, schedule=schedule, cpu_isa="ref", defer_experts=2,
                        profile="ktransformers-paper-amx")
    model, off = load_hybrid(ckpt, "cpu", torch.float32, hcfg, progress=False)
    for _ in range(2):  # a second step starts clean (nothing pending from the first)
        got = forward(model)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert off.pending is None


def test_no_deferral_is_the_plain_model(ckpt):
    plain = load_model(ckpt, device="cpu", dtype=torch.float32, progress=False)
    model, _ = load_hybrid(ckpt, "cpu", torch.float32, HybridConfig(gpu_experts=2, schedule="cpu", cpu_isa="ref",
                                                                    profile="ktransformers-paper-amx"), progress=False)
    torch.testing.assert_close(forward(model), forward(plain), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(deferred_reference(plain, 0), forward(plain), rtol=1e-5, atol=1e-5)


def test_bad_deferral_settings_are_refused(ckpt):
    k = hf_config("demo")["num_experts_per_tok"]
    with pytest.raises(UsageError, match="below the model's experts per token"):
        load_hybrid(ckpt, "cpu", torch.float32, HybridConfig(gpu_experts=0, defer_experts=k), progress=False)
    with pytest.raises(UsageError, match=">= 0"):
        HybridConfig(defer_experts=-1)
    with pytest.raises(UsageError, match="cannot be combined"):
        HybridConfig(defer_experts=1, replace="online")


def test_quality_bench_reports_tokens_and_perplexity(ckpt, tmp_path):
    import json

    from bench.quality import main

    out = tmp_path / "d.json"
    assert main(["--model", str(ckpt), "--settings", "defer:1,cpu:int4:64", "--new", "6", "--prompts", "2",
                 "--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["ref", "defer:1", "cpu:int4:64"]
    assert rows[0]["same_tokens"] == 1.0 and all(0.0 <= r["same_tokens"] <= 1.0 for r in rows)
    assert all(r["perplexity"] > 1.0 for r in rows)
    assert rows[1]["perplexity"] != rows[0]["perplexity"]  # deferral changes the math


def test_quality_bench_keeps_the_other_settings_when_one_fails(ckpt, tmp_path, monkeypatch):
    import json

    import bench.quality as quality

    real = quality.run

    def run(model, device, setting, *args):
        if setting.get("defer"):
            raise RuntimeError("boom")
        return real(model, device, setting, *args)

    monkeypatch.setattr(quality, "run", run)
    out = tmp_path / "q.json"
    assert quality.main(["--model", str(ckpt), "--settings", "defer:1,cpu:int8", "--new", "4", "--prompts", "2",
                         "--device", "cpu", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["ref", "defer:1", "cpu:int8"]
    assert rows[1]["error"] == "RuntimeError: boom" and rows[2]["perplexity"] > 1.0
