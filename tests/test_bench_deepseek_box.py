"""bench.deepseek_box end to end at a tiny size (the GPU-box run is one 10-minute call: a typo must fail here)."""

import json

from bench import deepseek_box
from tiny_models import deepseek_raw


def test_deepseek_box_writes_loads_and_measures_a_tiny_checkpoint(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(deepseek_raw()))
    ckpt, out = tmp_path / "ck", tmp_path / "out"
    argv = ["--ckpt", str(ckpt), "--config", str(cfg), "--cpu-dtype", "int8", "--prefill", "16",
            "--decode-batch", "1", "--steps", "2", "--strategies", "cpu", "--out", str(out),
            "--profile", "bench/results/h200/profile_qwen3-235b-a22b.json"]
    assert deepseek_box.main(argv) == 0
    res = json.loads((out / "deepseek_box_int8.json").read_text())
    assert res["checkpoint_written"]["written"] and res["checkpoint_written"]["disk_bytes"] > 0
    load = res["load"]
    assert load["dram_expert_bytes"] > 0 and load["rss_peak"] >= load["rss_after"]
    assert 0 < load["anon_after"] <= load["anon_peak"] <= load["rss_peak"]
    r = res["results"][0]
    assert r["strategy"] == "cpu" and r["prefill_16_tok_s"] > 0 and r["decode_b1_tok_s"] > 0
    # a second run reuses the checkpoint instead of writing it again
    assert deepseek_box.main(argv) == 0
    assert json.loads((out / "deepseek_box_int8.json").read_text())["checkpoint_written"] == {"written": False}
