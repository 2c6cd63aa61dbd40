"""Load-time prediction (placement/load_time.py): its arithmetic, the calibration step that measures its figures,
profiles without them, and `hybrid plan`'s line and JSON field. How close the prediction comes to a real load is
a measurement, not a test (timings swing several-fold on a shared machine): bench.load_speed prints both."""

from __future__ import annotations

import json
import sys

import pytest

from hybrid.cli import main
from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from placement.hardware import LOAD_DEFAULTS, HardwareProfile, load_profile
from placement.load_time import CheckpointBytes, config_checkpoint_bytes, file_checkpoint_bytes, predict_load

GPU = dict(gpu_flops=1e14, hbm_bw=1e12, link_bw=25e9, alpha=5e-6)
FIGURES = dict(pack_rates={"bf16": 4e9, "int8": 1e9}, packed_copy_bw=4e9, disk_read_bw=2e9, disk_write_bw=1e9)
LOAD_FIELDS = ("pack_rates", "packed_copy_bw", "disk_read_bw", "disk_write_bw")


def measured(**figures) -> HardwareProfile:
    return HardwareProfile(name="box", cpu_flops={"avx2": 1e12}, dram_bw=5e10, source="calibrated",
                           **GPU, **(figures or FIGURES))


def qwen3_30b():
    from hybrid.models.families import family_for
    from hybrid.models.presets import published_config

    raw = published_config("qwen3-30b-a3b")
    return family_for(raw).parse_config(raw), raw


def test_prediction_arithmetic_on_a_preset():
    """Qwen3-30B-A3B, bf16 checkpoint, int8 experts on one NUMA node, every figure a round number."""
    cfg, raw = qwen3_30b()
    experts = 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) = 28,991,029,248 weights
    # embedding + head 2 x 151936 x 2048; per layer q, k, v, o 2048 x 128 x (32 + 32 + 4 + 4), q/k norms 2 x 128,
    # two RMS norms 2 x 2048, router 128 x 2048; the final norm 2048
    non_expert = 2 * 151936 * 2048 + 48 * (2048 * 128 * 72 + 256 + 4096 + 128 * 2048) + 2048
    assert non_expert == 1_541_093_376
    ckpt = config_checkpoint_bytes(cfg, raw)
    assert ckpt == CheckpointBytes(experts=2 * experts, non_expert=2 * non_expert, source="config")
    # int8 packed: gate and up 768 rows x 2048 + fp32 scale and int32 row sum per row; down 2048 rows x 768 + 8 each
    packed = 48 * 128 * (2 * (768 * 2048 + 768 * 8) + 2048 * 768 + 2048 * 8)
    p = predict_load(cfg, ckpt, packed, "int8", measured())
    assert p.read_s == pytest.approx((2 * experts + 2 * non_expert) / 2e9)  # 30.53 s at 2 GB/s
    assert p.read_s == pytest.approx(30.532, abs=1e-3)
    assert p.convert_s == pytest.approx(57.982, abs=1e-3)  # 2 bytes a weight at 1 GB/s
    assert p.upload_s == pytest.approx(0.1233, abs=1e-4)  # 3.08 GB at 25 GB/s
    assert p.first_s == pytest.approx(30.532 + 57.982 + 0.1233, abs=2e-3)
    assert p.cache_write_s == pytest.approx(29.167, abs=1e-3)  # 29.17 GB packed at 1 GB/s, in the background
    # restart: non-expert 3.08 GB and 29.17 GB packed at the 4 GB/s copy, or from the 2 GB/s disk
    assert p.cached_s == pytest.approx(0.7705 + 0.1233 + 7.2918, abs=2e-3)
    assert p.cached_from_disk_s == pytest.approx(1.5411 + 0.1233 + 14.5836, abs=2e-3)
    assert p.figures.defaults == ()
    line = p.line()
    assert line.startswith("load: first ~88.6 s (read 30.5 s from disk at 2.00 GB/s, convert 58.0 s, upload 0.1 s)")
    assert "from the packed cache ~8.2 s (~16.2 s from disk)" in line and "not measured" not in line


def test_checkpoint_bytes_of_block_fp8_and_mxfp4_configs():
    """Block-FP8 (DeepSeek-V3): experts and attention / shared / dense matrices at 1 byte + a scale per 128 x 128;
    MXFP4 (gpt-oss): experts at 17/32 of a byte."""
    from hybrid.models.families import family_for
    from hybrid.models.presets import published_config

    raw = published_config("deepseek-v3")
    cfg = family_for(raw).parse_config(raw)
    b = config_checkpoint_bytes(cfg, raw)
    fp8 = 1 + 4 / 128**2
    assert b.experts == round(cfg.param_counts()["experts"] * fp8)
    quantized = sum(c * n * k for part in ("attention", "shared", "dense") for n, k, c in cfg.gpu_matrices()[part])
    assert b.non_expert == round(cfg.param_counts()["non_expert"] * 2 - quantized * (2 - fp8))
    raw = published_config("gpt-oss-120b")
    cfg = family_for(raw).parse_config(raw)
    assert config_checkpoint_bytes(cfg, raw).experts == round(cfg.param_counts()["experts"] * 17 / 32)


def test_file_bytes_split_experts_from_the_rest_and_skip_layers_past_the_model():
    index = {"model.embed_tokens.weight": (None, {"data_offsets": [0, 100]}),
             "model.layers.0.mlp.experts.3.down_proj.weight": (None, {"data_offsets": [100, 400]}),
             "model.layers.0.mlp.shared_experts.up_proj.weight": (None, {"data_offsets": [400, 450]}),
             "model.layers.1.mlp.experts.gate_up_proj_blocks": (None, {"data_offsets": [450, 500]}),
             "model.layers.2.mlp.experts.0.up_proj.weight": (None, {"data_offsets": [0, 1000]})}  # an MTP layer
    assert file_checkpoint_bytes(index, num_layers=2) == CheckpointBytes(experts=350, non_expert=150, source="files")


def test_calibrate_load_step_writes_positive_rates(tmp_path, monkeypatch):
    """calibrate's load step (small sizes): every CPU dtype's pack rate, the packed copy and the disk, all positive,
    in the profile it writes and reads back; its temporary folder is gone after."""
    import torch

    from cpu_kernels.knobs import knobs
    from placement import calibrate as cal
    from placement import measure
    from placement.cost_model import ExpertShape

    monkeypatch.setattr(cal, "_has_amx", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(measure, "measure_dram_read", lambda n: (2e10, "fake"))
    monkeypatch.setattr(measure, "measure_cpu_curve", lambda shape, b, ms, **kw: [[m, 1e9] for m in ms])
    lines = []
    shape = ExpertShape("t", hidden=256, intermediate=128, num_experts=8, topk=2)
    prof, raw = cal.calibrate(shape, quick=True, backends=["torch"], progress=lines.append,
                              load_bytes=(4 << 20, 8 << 20))
    assert set(prof.pack_rates) == set(CPU_DTYPE_NAMES) == set(LOAD_DEFAULTS["pack_rates"])
    assert all(v > 0 for v in prof.pack_rates.values())  # bytes/s (how fast is the benchmarks' question, not a test's)
    assert prof.packed_copy_bw > 0 and prof.disk_read_bw > 0 and prof.disk_write_bw > 0
    assert raw["load"]["pack_rates"] == prof.pack_rates
    assert any(line.startswith("step ") and "load speeds" in line for line in lines)
    assert any("packer bf16" in line for line in lines) and any("disk of" in line for line in lines)
    back = load_profile(prof.save(tmp_path / "p.json"))
    assert {k: getattr(back, k) for k in LOAD_FIELDS} == {k: getattr(prof, k) for k in LOAD_FIELDS}
    assert not list(knobs().cache.glob(".load-probe-*"))
    assert "disk read (cache folder)" in cal.summary(prof)


def test_quick_disk_probe_gives_up_on_a_slow_write(tmp_path):
    from placement.calibrate import measure_disk

    disk, why = measure_disk(tmp_path, 32 << 20, budget_s=0.0)
    assert disk == {} and "--full measures it" in why
    disk, why = measure_disk(tmp_path, 8 << 20)
    assert why is None and disk["disk_read_bw"] > 0 and disk["disk_write_bw"] > 0


def test_load_figures_are_validated():
    from placement.errors import UsageError

    with pytest.raises(UsageError, match="pack_rates\\[int8\\]"):
        measured(pack_rates={"int8": -1.0})
    with pytest.raises(UsageError, match="disk_read_bw"):
        measured(pack_rates={}, disk_read_bw=0)


def plan(capsys, profile, *extra) -> str:
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--gpu-budget", "24GiB", "--cpu-budget", "200GiB",
                 "--cpu-dtype", "int8", "--numa-threads", "1", "--profile", str(profile), *extra]) == 0
    return capsys.readouterr().out


def test_old_profile_without_the_fields_loads_and_plan_says_not_measured(tmp_path, capsys):
    """A profile written before the load step (no load fields) is valid; plan prices with the defaults and says so,
    and says nothing of the kind for a profile that measured them."""
    data = measured().to_json()
    for key in LOAD_FIELDS:
        del data[key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    hw = load_profile(old)
    assert hw.pack_rates == {} and hw.packed_copy_bw is None and hw.disk_read_bw is None
    line = [x for x in plan(capsys, old).splitlines() if x.startswith("load: ")]
    assert len(line) == 1 and "first ~" in line[0] and "from the packed cache ~" in line[0]
    assert "defaults, not measured: disk read, disk write, packed copy, packer (int8)" in line[0]
    new = measured().save(tmp_path / "new.json")
    line = [x for x in plan(capsys, new).splitlines() if x.startswith("load: ")]
    assert len(line) == 1 and "not measured" not in line[0] and "at 2.00 GB/s" in line[0]


def test_plan_json_has_the_load_time(tmp_path, capsys):
    out = json.loads(plan(capsys, measured().save(tmp_path / "p.json"), "--json"))
    lt = out["load_time"]
    assert lt["cpu_dtype"] == "int8" and lt["checkpoint"]["source"] == "config"
    assert lt["packed_bytes"] == out["memory"]["cpu"]["experts"] == 48 * 128 * 4_747_264
    assert lt["first_s"] == pytest.approx(lt["read_s"] + lt["convert_s"] + lt["upload_s"])
    assert 0 < lt["cached_s"] < lt["cached_from_disk_s"] < lt["first_s"] and lt["figures"]["defaults"] == []
    out = json.loads(plan(capsys, "ktransformers-paper-amx", "--json"))
    assert "packer (int8)" in out["load_time"]["figures"]["defaults"]


def test_plan_reads_the_checkpoint_bytes_from_the_headers(tmp_path, capsys):
    """With --model, the bytes are the safetensors data (every file's size less its header), experts apart."""
    from loader_cases import write_tiny

    ckpt = write_tiny(tmp_path / "m")
    assert main(["plan", "--model", str(ckpt), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--json",
                 "--profile", "ktransformers-paper-amx"]) == 0
    b = json.loads(capsys.readouterr().out)["load_time"]["checkpoint"]
    data = sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little") for f in ckpt.glob("*.safetensors"))
    assert b["source"] == "files" and b["experts"] + b["non_expert"] == data
    assert b["experts"] == 2 * 4 * 3 * 32 * 16 * 2  # 2 layers x 4 experts x 3 matrices of 32 x 16 in bf16
