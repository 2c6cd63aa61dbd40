"""Prefill in passes (hybrid.runtime.RuntimeConfig.prefill_chunk) and the VRAM of one pass's activations: the memory
model counts them (placement.memory.prefill_activation_bytes), `hybrid plan` fits the pass to --gpu-budget and records
it, the runtime takes the same pass (a plan's, or the fitted one under --gpu-budget; --prefill-chunk as given), the
load-time placement leaves the residents what the plan leaves them, and the MoE layer's GPU lane gathers one expert
group's rows at a time."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.cli import build_parser, main
from hybrid.models.families import family_for
from hybrid.models.presets import published_config
from placement.memory import (PREFILL_CHUNKS, MemorySettings, breakdown, fit_prefill_chunk,
                              prefill_activation_bytes)

GiB = 2**30


def preset(name):
    raw = published_config(name)
    return family_for(raw).parse_config(raw), raw


def test_activations_grow_with_the_pass_and_count_in_the_fixed_part():
    from placement.memory import ATTENTION_BLOCK_BYTES as BLOCK

    cfg, _ = preset("deepseek-v3")
    sizes = [prefill_activation_bytes(cfg, t, 2, 1) for t in (512, 2048, 8192)]
    assert sizes[0] < sizes[1] < sizes[2]
    # DeepSeek-V3, a whole 2,048-token prompt: per token the hidden states and the dense MLP's temporaries (wider
    # than MLA's q and output), the fp32 merge and router logits; one expert's rows; MLA's keys and values expanded
    # per head (kv_b output 128 + 128, k 192, v padded to 192) in head groups of at most the attention block
    D, H = 7168, 128
    per = (2 * (6 * D + 3 * 18432) + 4 * D + 4 * 256) + (2 * (2 * D + 3 * 2048) + 4 * D)
    head = 2048 * (128 + 128 + 2 * 192) * 2  # one head's expansion over 2,048 keys
    assert sizes[1] == 2048 * per + (BLOCK // head) * head
    # a later pass over a 32K cache: one head group's expansion over every key, one query block's mask (bool and
    # its bf16 additive form); neither grows past the block with the context
    later = prefill_activation_bytes(cfg, 2048, 2, 1, 32768)
    head32 = 32768 * (128 + 128 + 2 * 192) * 2
    assert later == 2048 * per + (BLOCK // head32) * head32 + min(2048, BLOCK // (32768 * 3)) * 32768 * 3
    assert prefill_activation_bytes(cfg, 2048, 2, 1, 131072) - 2048 * per <= 2 * BLOCK
    small, big = (breakdown(cfg, MemorySettings(max_context=32768, prefill_chunk=c)) for c in (512, 8192))
    assert big.prefill_activations == prefill_activation_bytes(cfg, 8192, 2, 8, 32768)
    assert small.prefill_activations == prefill_activation_bytes(cfg, 512, 2, 8, 32768)
    assert big.gpu_fixed - small.gpu_fixed == big.prefill_activations - small.prefill_activations > 0
    # a context shorter than the pass: one pass, the whole prompt
    assert breakdown(cfg, MemorySettings(max_context=1024)).prefill_activations == prefill_activation_bytes(cfg, 1024, 2, 8)
    # grouped-query heads folded into the mask of a pass over the cache (H / Hkv x queries x keys): whole while it
    # fits the block, a block's worth of queries past it
    glm, _ = preset("glm-4.5")
    rep = glm.num_heads // glm.num_kv_heads
    assert (prefill_activation_bytes(glm, 64, 2, 1, 4096) - prefill_activation_bytes(glm, 64, 2, 1)
            == rep * 64 * 4096 * 3)
    q = rep * 32768 * 3
    assert (prefill_activation_bytes(glm, 1024, 2, 1, 32768) - prefill_activation_bytes(glm, 1024, 2, 1)
            == (BLOCK // q) * q)


def test_the_pass_is_fitted_to_the_budget():
    from placement.memory import context_bytes, pass_bytes

    cfg, _ = preset("deepseek-v3")
    s = MemorySettings(max_context=32768, ship_chunk=1)
    assert fit_prefill_chunk(cfg, s, None) == s.prefill_chunk == 8192
    fitted = {b: fit_prefill_chunk(cfg, s, b * GiB) for b in (4, 16, 24, 48, 140)}
    assert fitted[24] == 4096 and fitted[140] == 8192 and fitted[4] == PREFILL_CHUNKS[-1]
    assert list(fitted.values()) == sorted(fitted.values())  # never smaller on a bigger card

    def sized(t):  # what the pass's size decides
        return pass_bytes(cfg, t, 2, 1) + context_bytes(cfg, t, 32768, 2) - context_bytes(cfg, 0, 32768, 2)

    assert sized(4096) <= 24 * GiB / 16 < sized(8192)
    assert sized(8192) <= 140 * GiB / 16


def test_plan_records_the_pass_and_prints_its_activations(capsys):
    argv = ["plan", "--preset", "deepseek-v3", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB", "--cpu-dtype", "int4",
            "--max-context", "32768", "--profile", "ktransformers-paper-amx", "--numa-threads", "16"]
    assert main(argv + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["settings"]["prefill_chunk"] == 4096
    cfg, _ = preset("deepseek-v3")
    assert p["memory"]["gpu"]["prefill_activations"] == prefill_activation_bytes(cfg, 4096, 2, p["settings"]["ship_chunk"],
                                                                                  32768)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "prefill activations" in printed and "(passes of 4096 tokens)" in printed
    assert main(argv + ["--json", "--prefill-chunk", "512"]) == 0
    asked = json.loads(capsys.readouterr().out)
    assert asked["settings"]["prefill_chunk"] == 512
    assert sum(len(x["resident_experts"]) for x in asked["layers"]) > sum(len(x["resident_experts"]) for x in p["layers"])


def test_the_runtime_takes_the_fitted_the_planned_or_the_asked_pass(tmp_path, capsys):
    from hybrid.loading.check import with_prefill_chunk
    from hybrid.loading.parse import session_config_from_args
    from placement.plan_file import load_plan

    cfg, _ = preset("deepseek-v3")

    def config(*extra):
        args = build_parser().parse_args(["generate", "--device", "cpu", "--dtype", "bf16", "--max-context", "32768",
                                          *extra])
        return with_prefill_chunk(cfg, session_config_from_args(args))

    assert config("--gpu-budget", "24GiB").runtime.prefill_chunk == 4096
    assert config("--gpu-budget", "140GiB").runtime.prefill_chunk == 8192
    assert config("--gpu-budget", "24GiB", "--prefill-chunk", "300").runtime.prefill_chunk == 300
    assert config("--gpu-experts", "4").runtime.prefill_chunk == 8192  # no budget: the default
    assert config().runtime.prefill_chunk == 8192
    argv = ["plan", "--preset", "deepseek-v3", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB", "--cpu-dtype", "int4",
            "--max-context", "32768", "--profile", "ktransformers-paper-amx", "--numa-threads", "16",
            "--prefill-chunk", "1024", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 0
    capsys.readouterr()
    assert load_plan(tmp_path / "p.json").settings["prefill_chunk"] == 1024
    assert config("--plan", str(tmp_path / "p.json")).runtime.prefill_chunk == 1024
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prefill-chunk", "x"])


class _Rows(TorchDispatchMode):
    """The largest first dimension of any [n, D] tensor made by indexing (the gathered rows)."""

    def __init__(self, D):
        super().__init__()
        self.D, self.most = D, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index.Tensor and out.dim() == 2 and out.shape[1] == self.D:
            self.most = max(self.most, out.shape[0])
        return out


def test_the_gpu_lane_gathers_one_expert_group_at_a_time():
    """A batch whose every assignment runs on the GPU lanes (shipped, or all resident): rows are gathered per group
    of experts (a staging chunk of shipped ones; residents up to T rows a group), never all T x K at once."""
    from test_hybrid_layer import D, E, K, make_layer, routing

    from cpu_kernels.reference import moe_forward
    from hybrid.offload.experts import row_groups

    assert row_groups([3, 3, 3, 10, 0, 1], 6) == [(0, 2), (2, 3), (3, 4), (4, 6)]  # an expert alone may pass the cap
    assert row_groups([], 6) == [] and row_groups([0, 0], 6) == [(0, 2)]
    T = 200
    ids, w = routing(T, seed=5)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    counts = np.bincount(ids.flatten().numpy(), minlength=E)
    for strategy, resident in (("ship", ()), ("cpu", tuple(range(E)))):
        layer, (wg, wu, wd) = make_layer(strategy, resident)
        mode = _Rows(D)
        with mode:
            out = layer(x, ids, w)
        torch.testing.assert_close(out, moe_forward(x, wg, wu, wd, ids, w), atol=2e-5, rtol=1e-4)
        if resident:
            groups = [int(counts[a:b].sum()) for a, b in row_groups(counts, T)]
            assert max(groups) <= max(T, counts.max())
        else:
            chunk = layer.offload.ship_lane.chunk
            groups = [int(counts[i:i + chunk].sum()) for i in range(0, E, chunk)]  # id order = ship order here
        assert 0 < mode.most <= max(groups) < T * K
