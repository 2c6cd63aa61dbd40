"""The GPU dtype of each non-expert part (placement.gpu_dtypes) and the plans it makes possible: the flagship
models on consumer cards (DeepSeek-V3 / Kimi-K2 / GLM-4.5 at 24 GiB, Qwen3-235B and gpt-oss-120b at 16 GiB, all
at 32K context), auto's ladder and order, and the plan file / CLI carrying the choice."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybrid.cli import main
from hybrid.models.families import family_for
from hybrid.models.presets import published_config
from placement.errors import UsageError
from placement.gpu_dtypes import LADDERS, RESIDENT_SHARE, checkpoint_kind, choose, uniform
from placement.memory import GPU_PARTS, MemorySettings, breakdown

GiB = 2**30
CONSUMER = [  # preset, card, DRAM, CPU dtype
    ("deepseek-v3", 24, 512, "int4"), ("glm-4.5", 24, 512, "int4"), ("kimi-k2", 24, 768, "int4"),
    ("qwen3-235b-a22b", 16, 512, "int4"), ("gpt-oss-120b", 16, 512, None),
]


def preset(name):
    raw = published_config(name)
    return family_for(raw).parse_config(raw), raw


@pytest.mark.parametrize("name,card,dram,cpu_dtype", CONSUMER)
def test_flagships_plan_on_consumer_cards_at_32k(name, card, dram, cpu_dtype, capsys):
    argv = ["plan", "--preset", name, "--gpu-budget", f"{card}GiB", "--cpu-budget", f"{dram}GiB",
            "--max-context", "32768", "--profile", "ktransformers-paper-amx", "--json"]
    assert main(argv + (["--cpu-dtype", cpu_dtype] if cpu_dtype else [])) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["gpu_bytes"] <= card * GiB
    assert p["settings"]["max_context"] == 32768
    gpu = p["memory"]["gpu"]
    parts = gpu["non_expert_parts"]
    assert set(parts) == set(GPU_PARTS) | {"other"}
    assert 0 <= gpu["non_expert"] - sum(parts.values()) < 0.05 * gpu["non_expert"]  # + fp32 router, expert biases
    if name == "deepseek-v3":
        assert gpu["non_expert"] <= 12 * GiB  # with room for resident experts
        assert p["settings"]["gpu_dtypes"]["attention"] in ("fp8", "int4")


def test_without_quantized_weights_deepseek_does_not_fit_24gib(capsys):
    argv = ["plan", "--preset", "deepseek-v3", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB", "--max-context",
            "32768", "--cpu-dtype", "int4", "--gpu-dtype", "bf16", "--profile", "ktransformers-paper-amx"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is too small" in err and "--gpu-dtype int4" in err and err.count("\n") == 1


@pytest.mark.parametrize("context", [8192, 32768])
def test_auto_keeps_room_for_residents_and_steps_largest_first(context):
    from placement.memory import fit_prefill_chunk

    cfg, raw = preset("deepseek-v3")
    s = MemorySettings(max_context=context, cpu_dtype="int4")
    s = replace(s, prefill_chunk=fit_prefill_chunk(cfg, s, 24 * GiB))  # the pass `hybrid plan` fits to the card
    dtypes = choose(cfg, s, 24 * GiB, "auto", checkpoint_kind(raw))
    mem = breakdown(cfg, replace(s, gpu_dtypes=dtypes))
    assert mem.gpu_fixed <= (1 - RESIDENT_SHARE) * 24 * GiB and mem.non_expert <= 12 * GiB
    # the most precise: undoing any one step would not leave the room
    ladder = LADDERS["fp8"]
    for part in GPU_PARTS:
        i = ladder.index(dtypes[part])
        if i > 0:
            up = {**dtypes, part: ladder[i - 1]}
            assert breakdown(cfg, replace(s, gpu_dtypes=up)).gpu_fixed > (1 - RESIDENT_SHARE) * 24 * GiB, part
    assert dtypes["attention"] == "int4"  # the largest part is the first stepped down, and the furthest


def test_auto_without_the_quarter_keeps_the_most_precise_point_that_fits():
    """64K: the KV cache leaves no quarter of the card whatever the dtypes, so auto keeps the most precise point
    that fits the card at all."""
    from placement.memory import fit_prefill_chunk

    cfg, raw = preset("deepseek-v3")
    s = MemorySettings(max_context=65536, cpu_dtype="int4")
    s = replace(s, prefill_chunk=fit_prefill_chunk(cfg, s, 24 * GiB))
    dtypes = choose(cfg, s, 24 * GiB, "auto", checkpoint_kind(raw))
    mem = breakdown(cfg, replace(s, gpu_dtypes=dtypes))
    bottom = breakdown(cfg, replace(s, gpu_dtypes={p: "int4" for p in GPU_PARTS}))
    assert bottom.gpu_fixed > (1 - RESIDENT_SHARE) * 24 * GiB  # the quarter is out of reach
    assert (1 - RESIDENT_SHARE) * 24 * GiB < mem.gpu_fixed <= 24 * GiB
    assert set(dtypes.values()) != {"int4"}  # some part kept more precision than the bottom
    for part in GPU_PARTS:  # and one step up on any part would not fit the card
        i = LADDERS["fp8"].index(dtypes[part])
        if i > 0:
            up = {**dtypes, part: LADDERS["fp8"][i - 1]}
            assert breakdown(cfg, replace(s, gpu_dtypes=up)).gpu_fixed > 24 * GiB, part


def test_auto_without_budget_and_explicit_choices():
    cfg, raw = preset("deepseek-v3")
    s = MemorySettings()
    assert set(choose(cfg, s, None, "auto", "fp8").values()) == {"bf16"}  # nothing asks for fewer bytes
    assert set(choose(cfg, s, 1 * GiB, "int8").values()) == {"int8"}
    assert checkpoint_kind(raw) == "fp8" and checkpoint_kind(published_config("glm-4.5")) == "bf16"
    # a budget nothing fits: the bottom of the ladder (the refusal is check_budgets')
    assert set(choose(cfg, s, 1 * GiB, "auto", "bf16").values()) == {"int4"}


def test_quantized_parts_cut_the_predicted_decode_read():
    """The planner's decode step reads the parts in their GPU dtypes (fewer bytes, shorter predicted step)."""
    from placement.hardware import BUILTIN_PROFILES
    from placement.planner import PlanSettings, plan

    cfg, _ = preset("qwen3-235b-a22b")
    hw = BUILTIN_PROFILES["ktransformers-paper-amx"]
    plans = {}
    for kind in ("bf16", "int4"):
        s = MemorySettings(max_context=4096, cpu_dtype="int4", gpu_dtypes={p: kind for p in GPU_PARTS})
        plans[kind] = plan(cfg, None, hw, PlanSettings(gpu_budget=24 * GiB, cpu_budget=512 * GiB, memory=s))
    assert plans["int4"].memory["gpu"]["non_expert"] < 0.3 * plans["bf16"].memory["gpu"]["non_expert"]
    assert plans["int4"].settings["gpu_dtypes"] == {**{p: "int4" for p in GPU_PARTS}, "experts": "bf16"}
    # the same residents would cost less time per step; with the freed VRAM holding more of them, less still
    assert plans["int4"].predicted_decode_tokens_per_s > plans["bf16"].predicted_decode_tokens_per_s


def test_plan_file_gpu_dtypes_reach_generate(tmp_path, capsys, monkeypatch):
    """`generate --plan` loads the parts in the plan's GPU dtypes; a contradicting --gpu-dtype is refused."""
    import hybrid.models

    out = tmp_path / "plan.json"
    assert main(["plan", "--gpu-budget", "8GiB", "--cpu-budget", "8GiB", "--gpu-dtype", "int8",
                 "--profile", "ktransformers-paper-amx", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["gpu_dtypes"]["attention"] == "int8"
    capsys.readouterr()
    assert main(["generate", "--plan", str(out), "--gpu-dtype", "int4", "-n", "1"]) == 2
    assert "differs from the plan's GPU dtypes" in capsys.readouterr().err


def test_resident_experts_take_the_asked_dtype_and_fit_more():
    """--gpu-dtype int8 / int4 holds the resident experts in it too (fp8: int8), auto keeps them bf16; a quantized
    resident's bytes are gate+up [2F, D] and down [D, F] with fp32 scales per 128 inputs, and the plan fits more."""
    from placement.hardware import BUILTIN_PROFILES
    from placement.memory import breakdown, resident_expert_bytes
    from placement.planner import PlanSettings, plan

    cfg, _ = preset("qwen3-235b-a22b")
    s = MemorySettings(max_context=4096, cpu_dtype="int4")
    assert uniform("int4")["experts"] == "int4" and uniform("fp8")["experts"] == "int8"
    assert uniform("bf16")["experts"] == "bf16"
    assert "experts" not in choose(cfg, s, 24 * GiB, "auto")
    D, F = cfg.hidden_size, cfg.expert_intermediate_size
    assert resident_expert_bytes(D, F, "int4") == 2 * F * D // 2 + D * F // 2 + 4 * (2 * F * D // 128 + D * F // 128)
    assert resident_expert_bytes(D, F, "int8") == 3 * D * F + 4 * (2 * F * D // 128 + D * F // 128)
    mems = {k: breakdown(cfg, replace(s, gpu_dtypes={"experts": k})) for k in ("bf16", "int8", "int4")}
    assert mems["bf16"].resident_expert == 3 * D * F * 2
    assert mems["int4"].resident_expert == resident_expert_bytes(D, F, "int4")
    # quantized residents de-quantize at least one whole expert at a time: counted with the graph buffers
    assert mems["int4"].graph_buffers >= mems["bf16"].graph_buffers + 3 * D * F * 2
    hw = BUILTIN_PROFILES["ktransformers-paper-amx"]
    n = {k: sum(len(lp.resident_experts) for lp in plan(cfg, None, hw, PlanSettings(
        gpu_budget=24 * GiB, cpu_budget=512 * GiB, memory=replace(s, gpu_dtypes={"experts": k}))).layers)
        for k in ("bf16", "int4")}
    assert n["int4"] > 3 * n["bf16"] > 0
    with pytest.raises(UsageError, match="resident experts' GPU dtype"):
        MemorySettings(gpu_dtypes={"experts": "fp8"})
