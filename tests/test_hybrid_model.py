"""A whole model with hybrid MoE layers: greedy tokens identical across strategies and resident counts."""

import json

import pytest
import torch

import cpu_kernels
from hybrid.cli import main
from hybrid.errors import UsageError
from hybrid.models import load_model
from hybrid.models.presets import hf_config
from hybrid.models.writer import write_random_checkpoint
from hybrid.loading.parse import parse_bytes
from hybrid.loading.place import budget_count, most_routed, place_resident
from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig
from hybrid.runtime.engine import Engine
from hybrid.runtime.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 64], [9] * 12]
CALIB = list(range(3, 200, 3))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = hf_config("demo")
    cfg.update(vocab_size=256, num_hidden_layers=3, eos_token_id=None, pad_token_id=None)
    # std 0.1: large enough that routing and logits are far from ties, so greedy tokens are a sharp test
    return write_random_checkpoint(tmp_path_factory.mktemp("hy") / "ckpt", cfg, seed=3, std=0.1)


def greedy(model, n=12):
    eng = Engine(model, None, max_batch=4, max_context=64, eager=True)
    outs = eng.generate(PROMPTS, max_new_tokens=n, sampling=SamplingParams(temperature=0), stop_token_ids=[])
    return [o.token_ids for o in outs], eng


def hybrid_model(ckpt, schedule, n_resident, isa="ref", cpu_dtype="bf16"):
    hcfg = HybridConfig(gpu_experts=n_resident, schedule=schedule, cpu_isa=isa, cpu_dtype=cpu_dtype,
                        profile="ktransformers-paper-amx")
    model, off = load_hybrid(ckpt, "cpu", torch.float32, hcfg, progress=False)
    eng = Engine(model, None, max_batch=1, max_context=256, eager=True)
    slot = eng.allocate_slot()
    place_resident(model, off, hcfg, lambda t: eng.prefill(slot, t), CALIB, fixed_vram_bytes=0)
    return model, off


@pytest.fixture(scope="module")
def reference_tokens(ckpt):
    return greedy(load_model(ckpt, device="cpu", dtype=torch.float32, progress=False))[0]


@pytest.mark.parametrize("schedule", ["cost", "cpu", "ship", "threshold:8"])
@pytest.mark.parametrize("n_resident", [0, 3, 16])
def test_greedy_identical_across_strategies(ckpt, reference_tokens, schedule, n_resident):
    model, off = hybrid_model(ckpt, schedule, n_resident)
    tokens, _ = greedy(model)
    assert tokens == reference_tokens
    assert all(len(layer.resident_ids) == n_resident for layer in off.layers)


def test_resident_experts_are_the_most_routed(ckpt):
    model, off = hybrid_model(ckpt, "cost", 4)
    for layer in off.layers:
        counts = layer.stats.routed
        res = set(layer.resident_ids.tolist())
        assert min(counts[list(res)]) >= max(counts[[e for e in range(len(counts)) if e not in res]])


def test_lanes_used_in_a_whole_model(ckpt):
    _, off = hybrid_model(ckpt, "ship", 2)
    model = off.layers[0]
    assert model.stats.shipped_experts > 0
    _, off = hybrid_model(ckpt, "cpu", 2)
    assert off.layers[0].stats.cpu_experts > 0 and off.layers[0].stats.shipped_experts == 0


@pytest.mark.parametrize("isa", [i for i in cpu_kernels.available_isas() if i != "ref"])
def test_compiled_kernels_close_to_reference(ckpt, isa):
    ref = load_model(ckpt, device="cpu", dtype=torch.float32, progress=False)
    model, _ = hybrid_model(ckpt, "cost", 2, isa=isa)
    ids = torch.tensor([PROMPTS[0]])
    pos = torch.arange(len(PROMPTS[0]))[None]
    a = Engine(ref, None, max_batch=1, max_context=32, eager=True).forward(ids, pos, torch.tensor([0]))
    b = Engine(model, None, max_batch=1, max_context=32, eager=True).forward(ids, pos, torch.tensor([0]))
    rel = ((a - b).abs().max() / a.abs().max()).item()
    assert rel < 2e-2  # bf16 activations inside the compiled kernels


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("24000MB") == 24_000_000_000
    assert parse_bytes("1024") == 1024
    assert parse_bytes("1.5 KiB") == 1536
    for bad in ("", "lots", "-5GB", "12XB"):
        with pytest.raises(UsageError):
            parse_bytes(bad)


def test_budget_decides_resident_count(ckpt):
    hcfg = HybridConfig(gpu_budget=10**9, profile="ktransformers-paper-amx", cpu_isa="ref")
    model, off = load_hybrid(ckpt, "cpu", torch.float32, hcfg, progress=False)
    cfg = model.cfg
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4
    fixed = 10**9 - 5 * len(off.layers) * per_expert + 1  # one byte short of 5 per layer
    assert budget_count(model, off, hcfg, fixed) == 5 * len(off.layers) - 1  # experts in all, not per layer
    assert budget_count(model, off, hcfg, 0) == cfg.num_experts * len(off.layers)  # a huge budget holds them all
    with pytest.raises(UsageError, match="below what the model needs"):
        budget_count(model, off, hcfg, 10**9 + 1)
    assert budget_count(model, off, hcfg, 10**9) == 0  # exactly the fixed part: it runs, with no expert resident


def test_a_budget_goes_to_the_most_routed_experts_across_layers(ckpt):
    """Under --gpu-budget the residents are the (layer, expert) pairs the calibration routed most, whatever layer
    they are in: fewer than one per layer still places some, and the counts per layer follow the routing."""
    import numpy as np

    counts = [np.array([0, 9, 1, 9]), np.array([5, 5, 5, 5]), np.array([0, 0, 30, 0])]
    assert most_routed(counts, 1) == [[], [], [2]]
    assert most_routed(counts, 3) == [[1, 3], [], [2]]
    # equal counts: each layer's next-ranked expert in turn (layer 1's four 5s, then layer 0's 1, then the zeros)
    assert most_routed(counts, 7) == [[1, 3], [0, 1, 2, 3], [2]]
    assert sorted(map(len, most_routed(counts, 12))) == [4, 4, 4]

    hcfg = HybridConfig(gpu_budget=10**9, profile="ktransformers-paper-amx", cpu_isa="ref")
    model, off = load_hybrid(ckpt, "cpu", torch.float32, hcfg, progress=False)
    per_expert = 3 * model.cfg.hidden_size * model.cfg.expert_intermediate_size * 4
    n = len(off.layers) - 1  # fewer than one per layer
    eng = Engine(model, None, max_batch=1, max_context=256, eager=True)
    slot = eng.allocate_slot()
    before = [layer.stats.routed.copy() for layer in off.layers]
    placed = place_resident(model, off, hcfg, lambda t: eng.prefill(slot, t), CALIB, 10**9 - n * per_expert)
    assert sum(placed) == n and placed == [len(layer.resident_ids) for layer in off.layers]
    routed = [layer.stats.routed - b for layer, b in zip(off.layers, before)]
    chosen = {(i, e) for i, layer in enumerate(off.layers) for e in layer.resident_ids}
    floor = min(int(routed[i][e]) for i, e in chosen)
    assert all(int(routed[i][e]) <= floor for i in range(len(routed)) for e in range(len(routed[i]))
               if (i, e) not in chosen)


def test_deferral_must_leave_an_expert_per_token(ckpt):
    """--defer-experts N defers each token's N lowest-ranked experts one layer: N = experts per token would defer
    all of them, so it is refused; one fewer loads."""
    from hybrid.models.presets import hf_config as _hf

    top_k = _hf("demo")["num_experts_per_tok"]
    with pytest.raises(UsageError, match="must be below the model's experts per token"):
        load_hybrid(ckpt, "cpu", torch.float32, HybridConfig(defer_experts=top_k, profile="ktransformers-paper-amx",
                                                             cpu_isa="ref"), progress=False)
    model, off = load_hybrid(ckpt, "cpu", torch.float32, HybridConfig(defer_experts=top_k - 1,
                             profile="ktransformers-paper-amx", cpu_isa="ref"), progress=False)
    assert off.defer == top_k - 1


def test_generate_cli_hybrid_json(ckpt, capsys):
    import shutil

    from hybrid.runtime.demo import build_tokenizer

    tok_dir = ckpt.parent / "with_tok"
    if not tok_dir.exists():
        shutil.copytree(ckpt, tok_dir)
        build_tokenizer(tok_dir, vocab_size=256)
    rc = main(["generate", "--model", str(tok_dir), "-n", "4", "--json", "--gpu-experts", "2",
               "--schedule", "cost", "--profile", "ktransformers-paper-amx"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # build_tokenizer prints the Zen
    assert len(out["generated_token_ids"]) == 4
    assert main(["generate", "--model", str(tok_dir), "--schedule", "sometimes"]) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_profile_shape_mismatch_is_reported(caplog):
    from dataclasses import replace

    from hybrid.offload.build import warn_shape_mismatch
    from placement.hardware import BUILTIN_PROFILES
    from placement.cost_model import ExpertShape

    hw = replace(BUILTIN_PROFILES["ktransformers-paper-amx"], cpu_curves={"amx": [[1, 1e11], [64, 1e13]]},
                 machine={"hidden": 4096, "intermediate": 1536})
    assert warn_shape_mismatch(hw, ExpertShape("m", hidden=2048, intermediate=768))
    assert "hybrid calibrate --hidden 2048 --intermediate 768" in caplog.text
    assert not warn_shape_mismatch(hw, ExpertShape("m", hidden=4096, intermediate=1536))
