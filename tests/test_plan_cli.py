"""`hybrid plan` and `generate --plan` on a tiny checkpoint (CPU)."""

import json
import shutil
from pathlib import Path

import pytest

from hybrid.cli import build_parser, main

PROFILE = "ktransformers-paper-amx"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_models import demo_shaped_checkpoint

    return demo_shaped_checkpoint(tmp_path_factory.mktemp("pc") / "ckpt", seed=4)


def plan_json(capsys, *argv):
    assert main(["plan", "--profile", PROFILE, "--reserve", "0", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_schema(ckpt, capsys):
    out = plan_json(capsys, "--model", str(ckpt), "--gpu-budget", "16MiB", "--cpu-budget", "1GiB",
                    "--max-context", "64", "--numa-threads", "2,2", "--staging-slots", "4", "--ship-chunk", "8")
    for key in ("gpu_bytes", "gpu_budget_bytes", "cpu_bytes", "cpu_budget_bytes"):
        assert isinstance(out[key], int) and out[key] > 0
    assert out["gpu_budget_bytes"] == 16 * 2**20 and out["cpu_budget_bytes"] == 2**30
    assert out["gpu_bytes"] <= out["gpu_budget_bytes"] and out["cpu_bytes"] <= out["cpu_budget_bytes"]
    assert [x["layer"] for x in out["layers"]] == [0, 1]
    assert all(isinstance(e, int) for x in out["layers"] for e in x["resident_experts"])
    # two nodes: staging holds raw packed bytes besides the dense chunk, 4 slots x 8 experts x 2 x 192 KiB
    g = out["memory"]["gpu"]
    assert g["staging"] == 12 * 2**20
    n = sum(len(x["resident_experts"]) for x in out["layers"])
    assert 0 < n < 32 and n == (out["gpu_budget_bytes"] - out["gpu_bytes"] + n * g["per_resident_expert"]) // g["per_resident_expert"]
    assert out["predicted_decode_tokens_per_s"] > 0 and out["predicted_prefill_tokens_per_s"] > 0
    assert [n["threads"] for n in out["numa"]] == [2, 2]
    assert out["gpu_bytes"] == sum(g[k] for k in ("non_expert", "kv_cache", "staging", "graph_buffers",
                                                  "prefill_activations", "reserve",
                                                  "resident_experts"))


def test_budget_units(ckpt, capsys):
    a = plan_json(capsys, "--model", str(ckpt), "--gpu-budget", "2GiB", "--cpu-budget", "1000MB", "--max-context", "64")
    b = plan_json(capsys, "--model", str(ckpt), "--gpu-budget", str(2**31), "--cpu-budget", "1000000000",
                  "--max-context", "64")
    assert a == b and a["cpu_budget_bytes"] == 10**9


def test_plan_for_a_preset_without_checkpoint(capsys):
    out = plan_json(capsys, "--preset", "qwen3-235b-a22b", "--gpu-budget", "80GiB", "--cpu-budget", "500GiB",
                    "--max-context", "8192", "--numa-threads", "16")
    assert out["model"]["num_experts"] == 128 and len(out["layers"]) == 94
    per = out["memory"]["gpu"]["per_resident_expert"]
    assert per == 3 * 4096 * 1536 * 2  # 36 MiB
    n = sum(len(x["resident_experts"]) for x in out["layers"])
    assert out["gpu_budget_bytes"] - per < out["gpu_bytes"] <= out["gpu_budget_bytes"]  # no room for one more
    assert {len(x["resident_experts"]) for x in out["layers"]} <= {n // 94, n // 94 + 1}  # uniform: even spread


def test_plan_reads_no_weights(ckpt, tmp_path, capsys):
    only_config = tmp_path / "cfg_only"
    only_config.mkdir()
    shutil.copy(ckpt / "config.json", only_config / "config.json")
    out = plan_json(capsys, "--model", str(only_config), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB")
    assert out["model"]["num_experts"] == 16


@pytest.mark.parametrize("argv, needles", [
    (["--gpu-budget", "1MiB", "--cpu-budget", "1GiB"], ["--gpu-budget 1.0 MiB is too small", "the GPU needs",
                                                        "reserve 1.00 GiB", "raise --gpu-budget to at least"]),
    (["--gpu-budget", "2GiB", "--cpu-budget", "1MB"], ["--cpu-budget", "DRAM needs", "raise --cpu-budget to at least"]),
    (["--gpu-budget", "lots", "--cpu-budget", "1GiB"], ["cannot read 'lots' as a size"]),
    (["--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--max-context", "1"], ["--max-context must be at least 2"]),
    (["--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--stats", "/nonexistent.json"], ["--stats: no such file"]),
    (["--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--numa-threads", "2,x"], ["--numa-threads"]),
])
def test_impossible_or_bad_settings_exit_2(ckpt, capsys, argv, needles):
    assert main(["plan", "--model", str(ckpt), "--profile", PROFILE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid plan: error:") and err.count("\n") == 1
    for n in needles:
        assert n in err


def test_generate_fails_before_loading(ckpt, capsys, monkeypatch, tmp_path):
    import hybrid.models
    import hybrid.offload.build

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(hybrid.offload.build, "load_hybrid", boom)
    monkeypatch.setattr(hybrid.models, "load_model", boom)
    # the budget check itself (a machine without CUDA makes no residents, so the CLI drops --gpu-budget there)
    import torch

    from hybrid.errors import UsageError
    from hybrid.loading.check import check_placement
    from hybrid.offload.config import HybridConfig

    with pytest.raises(UsageError, match="below the non-expert weights and KV cache"):
        check_placement(str(ckpt), HybridConfig(gpu_budget=1024), 4096, 1, torch.bfloat16)
    if torch.cuda.is_available():
        assert main(["generate", "--model", str(ckpt), "--gpu-budget", "1KiB", "-n", "2"]) == 2
        assert "below the non-expert weights and KV cache" in capsys.readouterr().err
    # a plan made for another model shape
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_experts"] = 8
    (other / "config.json").write_text(json.dumps(cfg))
    plan_file = tmp_path / "other.json"
    assert main(["plan", "--model", str(other), "--profile", PROFILE, "--gpu-budget", "2GiB", "--cpu-budget", "1GiB",
                 "--out", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--plan", str(plan_file), "-n", "2"]) == 2
    assert "was made for another model" in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpt), "--plan", str(plan_file), "--gpu-experts", "2"]) == 2
    assert "not both" in capsys.readouterr().err


def test_generate_with_a_plan(ckpt, tmp_path, capsys):
    from hybrid.loading.session import open_session
    from placement.plan_file import load_plan

    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--model", str(ckpt), "--profile", PROFILE, "--gpu-budget", "8MiB", "--cpu-budget", "1GiB",
                 "--max-context", "64", "--cpu-dtype", "int8", "--reserve", "0", "--staging-slots", "2",
                 "--out", str(plan_file)]) == 0
    capsys.readouterr()
    p = load_plan(plan_file)
    counts = [len(lp.resident_experts) for lp in p.layers]
    # staging: 2 slots x 8 experts x (192 KiB dense + 100 KiB raw int8 bytes) = 4.56 MiB; fixed 6.09 MiB, of
    # which the CPU lane's device output buffers are (2 x 64 + 2 x 512) rows x 256 x 2 B = 0.56 MiB; a prefill
    # pass of the 64-token context: 64 x 7,232 B per token (6 x 256 hidden values and the 3 x 512 dense MLP's, bf16;
    # the fp32 merge and router logits) + 128 expert rows (K x chunk / E = 2 a token) x 2,816 B = 0.785 MiB;
    # (8 MiB - 6.09 MiB - 0.785 MiB) / 0.1875 MiB per resident expert = 6
    assert p.memory["gpu"]["prefill_activations"] == 64 * 7232 + 128 * 2816
    assert sum(counts) == 6
    args = build_parser().parse_args(["generate", "--model", str(ckpt), "--plan", str(plan_file),
                                      "--max-context", "64", "--profile", PROFILE])
    s = open_session(args, log=lambda m: None)
    assert s.offload.cpu_dtype == "int8"  # from the plan
    assert s.offload.ship_lane.n_slots == p.settings["staging_slots"] == 2  # from the plan
    assert s.offload.ship_lane.chunk == p.settings["ship_chunk"]  # the lane ships the chunk the plan priced
    for layer in s.offload.layers:  # without CUDA no resident copies are made (hybrid.loading.check)
        want = sorted(p.resident_of(layer.layer)) if s.device.type == "cuda" else []
        assert sorted(layer.resident_ids.tolist()) == want
    rc = main(["generate", "--model", str(ckpt), "--plan", str(plan_file), "--max-context", "64", "-n", "3", "--json",
               "--profile", PROFILE])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["generated_token_ids"]) == 3
    assert main(["generate", "--model", str(ckpt), "--plan", str(plan_file), "--cpu-dtype", "bf16"]) == 2
    assert "differs from the plan" in capsys.readouterr().err
    # a plan that chose another chunk: the lane and the scheduler's pricing both take it
    raw = json.loads(plan_file.read_text())
    raw["settings"]["ship_chunk"] = 3
    plan3 = tmp_path / "plan3.json"
    plan3.write_text(json.dumps(raw))
    box = Path(__file__).parent.parent / "bench/results/h200/profile_qwen3-235b-a22b.json"  # a chunk cost
    s3 = open_session(build_parser().parse_args(["generate", "--model", str(ckpt), "--plan", str(plan3),
                                                 "--max-context", "64", "--profile", str(box)]), log=lambda m: None)
    sched = s3.offload.scheduler
    assert s3.offload.ship_lane.chunk == 3 and sched.chunk_share == pytest.approx(sched.hw.ship_chunk_overhead / 3)
    assert sched.hw.ship_chunk_overhead > 0  # else the share could not tell the chunk


def test_generate_replace_online_runs(ckpt, capsys):
    rc = main(["generate", "--model", str(ckpt), "--gpu-experts", "2", "--replace", "online", "-n", "3", "--json",
               "--max-context", "64", "--profile", PROFILE])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["generated_token_ids"]) == 3


def test_serve_and_chat_accept_a_plan(ckpt, tmp_path, capsys):
    from hybrid.server.adapter import load_runtime
    from placement.plan_file import load_plan

    plan_file = tmp_path / "plan.json"
    assert main(["plan", "--model", str(ckpt), "--profile", PROFILE, "--gpu-budget", "8MiB", "--cpu-budget", "1GiB",
                 "--max-context", "64", "--reserve", "0", "--out", str(plan_file)]) == 0
    capsys.readouterr()
    p = load_plan(plan_file)
    args = build_parser().parse_args(["serve", "--model", str(ckpt), "--plan", str(plan_file), "--max-context", "64",
                                      "--max-batch", "1", "--profile", PROFILE])
    runtime, _ = load_runtime(args, log=lambda m: None)
    layers = [l.moe.experts for l in runtime.engine.model.layers]
    cuda = runtime.engine.model.device.type == "cuda"
    assert [sorted(x.resident_ids.tolist()) for x in layers] == [sorted(p.resident_of(x.layer)) if cuda else []
                                                                  for x in layers]
    assert build_parser().parse_args(["chat", "--plan", str(plan_file)]).plan == str(plan_file)


def test_default_cpu_dtype_is_the_most_precise_that_fits_the_dram_budget(ckpt, capsys):
    """No --cpu-dtype: bf16 where every expert fits --cpu-budget, else int8, else int4 (said on stderr, kept in the
    plan for `generate --plan`); a named dtype that does not fit is refused as before."""
    base = ["--model", str(ckpt), "--gpu-budget", "16MiB", "--max-context", "64"]
    need = {d: plan_json(capsys, *base, "--cpu-budget", "64GiB", "--cpu-dtype", d)["cpu_bytes"]
            for d in ("bf16", "int8", "int4")}
    assert need["bf16"] > need["int8"] > need["int4"]
    for budget, want in ((need["bf16"], "bf16"), (need["bf16"] - 1, "int8"), (need["int8"] - 1, "int4")):
        assert main(["plan", "--profile", PROFILE, "--reserve", "0", "--json", *base, "--cpu-budget", str(budget)]) == 0
        captured = capsys.readouterr()
        out, err = json.loads(captured.out), captured.err
        assert out["settings"]["cpu_dtype"] == want and out["cpu_bytes"] == need[want]
        assert (f"note: CPU dtype {want}" in err) == (want != "bf16")
    assert main(["plan", "--profile", PROFILE, "--reserve", "0", *base, "--cpu-budget", str(need["bf16"] - 1),
                 "--cpu-dtype", "bf16"]) == 2
    assert "DRAM needs" in capsys.readouterr().err
    assert main(["plan", "--profile", PROFILE, "--reserve", "0", *base, "--cpu-budget", str(need["int4"] - 1)]) == 2
    assert "packed as bf16" in capsys.readouterr().err  # none fits: the default's error
