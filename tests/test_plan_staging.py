"""The ship lane's staging sized by what it saves (placement.planner.choose_staging): `hybrid plan` picks it, the
plan file carries it, and the runtime reads it from a plan or, under --gpu-budget without one, makes the same
choice."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybrid.cli import build_parser, main
from hybrid.errors import UsageError
from hybrid.models.families import family_for
from hybrid.models.presets import published_config
from placement.hardware import BUILTIN_PROFILES
from placement.planner import STAGING_SLOTS, STAGING_TOLERANCE, price_staging

GiB = 2**30
PROFILE = "ktransformers-paper-amx"  # no per-chunk launch cost: chunk size alone never pays
DSV3 = ["--preset", "deepseek-v3", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB", "--cpu-dtype", "int4",
        "--max-context", "32768", "--numa-threads", "16"]
QWEN30 = ["--preset", "qwen3-30b-a3b", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB", "--max-context", "32768",
          "--numa-threads", "16"]
# one DeepSeek-V3 expert: dense bf16 3 x 7168 x 2048 x 2 B, and its int4 bytes (group 128: fp32 scale per 128)
DSV3_DENSE = 3 * 7168 * 2048 * 2
DSV3_RAW = 3 * (7168 * 2048 // 2 + 7168 * 2048 // 128 * 4)


def plan_json(capsys, *argv, profile=PROFILE):
    assert main(["plan", "--profile", str(profile), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def residents(p) -> int:
    return sum(len(x["resident_experts"]) for x in p["layers"])


@pytest.fixture(scope="module")
def chunky(tmp_path_factory):
    """The built-in profile with a per-chunk launch cost like the GPU box's calibration (about 0.5 ms): a chunk of
    several experts then pays, as far as the prediction says."""
    path = tmp_path_factory.mktemp("prof") / "chunky.json"
    replace(BUILTIN_PROFILES[PROFILE], name="chunky", ship_chunk_overhead=4.8e-4).save(path)
    return path


@pytest.fixture(scope="module")
def dsv3_plans(tmp_path_factory):
    """(chosen, forced 4 x 8) DeepSeek-V3 plans at 24 GiB and 32K, as JSON, and the chosen one's text report."""
    import contextlib
    import io

    out = {}
    for key, extra in (("chosen", []), ("forced", ["--staging-slots", "4", "--ship-chunk", "8"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["plan", "--profile", PROFILE, "--json", *DSV3, *extra]) == 0
        out[key] = json.loads(buf.getvalue())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--profile", PROFILE, *DSV3]) == 0
    out["text"] = buf.getvalue()
    return out


def test_deepseek_at_24gib_trades_staging_for_residents(dsv3_plans):
    chosen, forced = dsv3_plans["chosen"], dsv3_plans["forced"]
    assert (forced["settings"]["staging_slots"], forced["settings"]["ship_chunk"]) == (4, 8)
    assert forced["memory"]["gpu"]["staging"] == 4 * 8 * (DSV3_DENSE + DSV3_RAW)  # 3.32 GiB
    # no per-chunk cost in the profile: the smallest staging predicts the fastest prefill (most residents)
    assert (chosen["settings"]["staging_slots"], chosen["settings"]["ship_chunk"]) == (STAGING_SLOTS, 1) == (2, 1)
    assert chosen["memory"]["gpu"]["staging"] == 2 * 1 * (DSV3_DENSE + DSV3_RAW)  # 212.6 MiB
    freed = forced["memory"]["gpu"]["staging"] - chosen["memory"]["gpu"]["staging"]
    per = chosen["memory"]["gpu"]["per_resident_expert"]
    assert residents(chosen) > residents(forced)
    assert residents(chosen) - residents(forced) <= freed // per + 1  # the freed bytes, and no more
    assert chosen["gpu_bytes"] <= 24 * GiB
    assert chosen["settings"]["gpu_dtypes"] == forced["settings"]["gpu_dtypes"]  # chosen before the staging
    assert chosen["predicted_decode_tokens_per_s"] >= forced["predicted_decode_tokens_per_s"]
    assert chosen["predicted_prefill_tokens_per_s"] >= forced["predicted_prefill_tokens_per_s"] * (1 - STAGING_TOLERANCE)
    line = next(x for x in dsv3_plans["text"].splitlines() if x.startswith("GPU  "))
    assert "staging 212.6 MiB (2 slots x 1 expert)," in line


def qwen30_cfg():
    raw = published_config("qwen3-30b-a3b")
    return family_for(raw).parse_config(raw)


def test_qwen3_30b_keeps_a_larger_chunk_where_launches_cost(chunky, capsys):
    """With a per-chunk launch cost the model prices chunk 1 more than 2% above the fastest, and 2 within it: the
    plan takes 2; 8's extra staging (and its larger expert groups' prefill activations) buys no prefill."""
    from placement.hardware import load_profile
    from placement.memory import MemorySettings

    p = plan_json(capsys, *QWEN30, profile=chunky)
    slots, chunk = p["settings"]["staging_slots"], p["settings"]["ship_chunk"]
    assert (slots, chunk) == (2, 2)
    mem = MemorySettings(max_context=32768, node_threads=(16,), gpu_dtypes=p["settings"]["gpu_dtypes"],
                         prefill_chunk=p["settings"]["prefill_chunk"])
    priced = price_staging(qwen30_cfg(), None, load_profile(chunky), mem, 24 * GiB)
    assert [c.chunk for c in priced] == [1, 2, 4, 8] and all(c.slots == 2 for c in priced)
    best = min(c.prefill_s for c in priced)
    by_chunk = {c.chunk: c for c in priced}
    assert by_chunk[1].prefill_s > best * (1 + STAGING_TOLERANCE)
    assert by_chunk[2].prefill_s <= best * (1 + STAGING_TOLERANCE)
    assert by_chunk[8].prefill_s <= best * (1 + STAGING_TOLERANCE)
    assert residents(p) == by_chunk[2].residents > by_chunk[8].residents
    # without the launch cost the same model takes chunk 1
    assert plan_json(capsys, *QWEN30)["settings"]["ship_chunk"] == 1


@pytest.mark.parametrize("extra, want", [(["--staging-slots", "3"], (3, 8)), (["--ship-chunk", "2"], (4, 2)),
                                         (["--staging-slots", "1", "--ship-chunk", "5"], (1, 5))])
def test_a_given_staging_is_kept(extra, want, capsys):
    p = plan_json(capsys, *DSV3, *extra)
    assert (p["settings"]["staging_slots"], p["settings"]["ship_chunk"]) == want
    assert p["memory"]["gpu"]["staging"] == want[0] * want[1] * (DSV3_DENSE + DSV3_RAW)


@pytest.mark.parametrize("argv, needle", [
    (["--ship-chunk", "0"], "--ship-chunk must be at least 1 expert, got 0"),
    (["--ship-chunk", "-2"], "--ship-chunk must be at least 1 expert, got -2"),
    (["--ship-chunk", "two"], "argument --ship-chunk: invalid int value"),
    (["--staging-slots", "0"], "--staging-slots must be at least 1, got 0"),
])
def test_bad_staging_is_one_line_exit_2(argv, needle, capsys):
    try:
        rc = main(["plan", "--preset", "demo", "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--profile", PROFILE,
                   *argv])
    except SystemExit as exc:  # argparse's own refusal (one line: hybrid.cli's parser)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid plan: error:") and err.count("\n") == 1 and needle in err


@pytest.fixture
def qwen_plan_file(tmp_path, chunky, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(chunky), *QWEN30, "--out", str(path)]) == 0
    capsys.readouterr()
    return path


def test_plan_file_round_trips_ship_chunk(qwen_plan_file, capsys):
    from placement.plan_file import Plan, load_plan

    p = load_plan(qwen_plan_file)
    assert (p.settings["staging_slots"], p.settings["ship_chunk"]) == (2, 2)
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))) == p
    data = json.loads(qwen_plan_file.read_text())
    for bad in ("2", 0, 1.5, True):
        data["settings"]["ship_chunk"] = bad
        qwen_plan_file.write_text(json.dumps(data))
        with pytest.raises(UsageError, match="settings.ship_chunk must be a positive integer"):
            load_plan(qwen_plan_file)
    assert main(["generate", "--plan", str(qwen_plan_file), "-n", "1"]) == 2  # refused in one line, nothing loaded
    err = capsys.readouterr().err
    assert "settings.ship_chunk" in err and err.count("\n") == 1


def test_parse_gives_the_runtime_the_plans_staging(qwen_plan_file):
    from hybrid.loading.parse import hybrid_config_from_args
    from hybrid.offload.config import HybridConfig

    hcfg = hybrid_config_from_args(build_parser().parse_args(["generate", "--plan", str(qwen_plan_file)]))
    assert (hcfg.staging_slots, hcfg.ship_chunk) == (2, 2)
    data = json.loads(qwen_plan_file.read_text())
    data["settings"].update(staging_slots=3, ship_chunk=5)
    qwen_plan_file.write_text(json.dumps(data))
    hcfg = hybrid_config_from_args(build_parser().parse_args(["generate", "--plan", str(qwen_plan_file)]))
    assert (hcfg.staging_slots, hcfg.ship_chunk) == (3, 5)
    del data["settings"]["ship_chunk"]  # a plan written before the planner chose it: the runtime's default
    qwen_plan_file.write_text(json.dumps(data))
    hcfg = hybrid_config_from_args(build_parser().parse_args(["generate", "--plan", str(qwen_plan_file)]))
    assert hcfg.ship_chunk == HybridConfig.ship_chunk == 8
    with pytest.raises(UsageError, match="ship_chunk"):
        HybridConfig(ship_chunk=0)


def test_gpu_budget_without_a_plan_takes_the_plans_choice(chunky, capsys):
    """generate --gpu-budget (no plan) goes through the same steps as open_session: the GPU dtypes at the default
    staging (check_before_load), the profile (with_pricing_profile), then with_ship_staging: the staging equals
    `hybrid plan`'s for the same model, budget, context and profile, and is not the default."""
    import torch

    from hybrid.loading.check import gpu_dtypes_for
    from hybrid.loading.parse import session_config_from_args, with_pricing_profile, with_ship_staging
    from hybrid.offload.config import HybridConfig

    raw = published_config("qwen3-30b-a3b")
    cfg = qwen30_cfg()
    args = build_parser().parse_args(["generate", "--device", "cpu", "--dtype", "bf16", "--gpu-budget", "24GiB",
                                      "--max-context", "32768", "--profile", str(chunky)])
    config = session_config_from_args(args)
    config = replace(config, gpu_dtypes=gpu_dtypes_for(cfg, raw, config))
    config = with_ship_staging(with_pricing_profile(config, log=lambda m: None), cfg)
    assert config.dtype == torch.bfloat16
    h = config.hybrid
    planned = plan_json(capsys, "--preset", "qwen3-30b-a3b", "--gpu-budget", "24GiB", "--cpu-budget", "512GiB",
                        "--max-context", "32768", profile=chunky)["settings"]
    assert (h.staging_slots, h.ship_chunk) == (planned["staging_slots"], planned["ship_chunk"]) == (2, 2)
    assert (h.staging_slots, h.ship_chunk) != (HybridConfig.staging_slots, HybridConfig.ship_chunk)
    # --gpu-experts N has no budget to trade against: the default staging stays
    args = build_parser().parse_args(["generate", "--device", "cpu", "--dtype", "bf16", "--gpu-experts", "4",
                                      "--profile", str(chunky)])
    config = with_ship_staging(with_pricing_profile(session_config_from_args(args), log=lambda m: None), cfg)
    assert (config.hybrid.staging_slots, config.hybrid.ship_chunk) == (4, 8)
