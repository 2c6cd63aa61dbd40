"""bench.gpt_oss_box end to end at a tiny size (the GPU-box run is one 10-minute call: a typo must fail here)."""

import json

import pytest

pytest.importorskip("transformers")

from bench import gpt_oss_box  # noqa: E402
from tiny_models import hf_config  # noqa: E402


def test_gpt_oss_box_writes_loads_and_measures_a_tiny_mxfp4_checkpoint(tmp_path):
    raw = hf_config("gpt_oss").to_dict()
    raw.pop("quantization_config", None)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(raw))
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    argv = ["--ckpt", str(ckpt), "--config", str(cfg), "--prefill", "16", "--decode-batch", "1", "--steps", "2",
            "--strategies", "cpu,cost", "--out", str(out), "--profile", "bench/results/h200/profile_qwen3-235b-a22b.json"]
    assert gpt_oss_box.main(argv) == 0  # --cpu-dtype mxfp4 by default
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    res = json.loads((out / "gpt_oss_box_mxfp4.json").read_text())
    assert res["checkpoint_written"]["written"] and res["load"]["dram_expert_bytes"] > 0
    assert [r["strategy"] for r in res["results"]] == ["cpu", "cost"]
    assert all(r["prefill_16_tok_s"] > 0 and r["decode_b1_tok_s"] > 0 for r in res["results"])
    text = (out / "gpt_oss_box_mxfp4.txt").read_text()
    assert "| strategy | prefill_16 tok/s | of bound | decode_b1 tok/s | of roofline |" in text
    assert text.count("\n| c") == 2 and "executor experts" in text
    # a second run, converting to int8, reuses the checkpoint
    assert gpt_oss_box.main(argv + ["--cpu-dtype", "int8", "--strategies", "cpu"]) == 0
    res = json.loads((out / "gpt_oss_box_int8.json").read_text())
    assert res["checkpoint_written"] == {"written": False} and res["results"][0]["decode_b1_tok_s"] > 0
