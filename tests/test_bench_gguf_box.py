"""bench.gguf_box on GGUF files of the built-in demo (bench.hf_to_gguf): each file loads in the CPU format its
expert blocks default to, with its blocks kept, and hybrid_e2e's decode and prefill figures come back per file;
the table puts llama.cpp's figures and the ratios beside them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from bench import gguf_box  # noqa: E402
from bench.hf_to_gguf import convert  # noqa: E402
from hybrid.runtime.demo import demo_checkpoint  # noqa: E402


def test_each_file_loads_in_its_own_format_and_is_measured(tmp_path):
    files = [convert(demo_checkpoint(), tmp_path / f"demo-{t}.gguf", t) for t in ("q8_0", "q4_0")]
    out = tmp_path / "out"
    assert gguf_box.main(["--gguf", *map(str, files), "--profile", "ktransformers-paper-amx", "--prefill", "32",
                          "--steps", "2", "--out", str(out)]) == 0
    doc = json.loads((out / "gguf_box.json").read_text())
    q8, q4 = doc["rows"]
    assert (q8["hybrid"]["cpu_dtype"], q8["hybrid"]["int4_group"]) == ("q8_0", None)
    assert (q4["hybrid"]["cpu_dtype"], q4["hybrid"]["int4_group"]) == ("q4_0", None)
    for row, kind in ((q8, "Q8_0"), (q4, "Q4_0")):
        h = row["hybrid"]
        assert set(h["expert_bytes_by_type"]) == {kind} and "llama" not in row
        assert h["strategy"] == "cost"  # the scheduler a user's run gets
        assert "repacked losslessly" in h["experts_kept"] and "de-quantized" not in h["experts_kept"]
        assert h["decode_b1_tok_s"] > 0 and h["prefill_32_tok_s"] > 0 and h["load"]["dram_expert_bytes"] > 0
        split = h["prefill_32_sched"]  # the schedule's split of the prefill: experts a layer on each lane
        assert split["cpu_experts_per_layer"] + split["shipped_experts_per_layer"] > 0, split
    # the executor holds the file's bytes: q8_0 8.5 bits a weight, q4_0 4.5
    assert q8["hybrid"]["load"]["dram_expert_bytes"] == pytest.approx(q4["hybrid"]["load"]["dram_expert_bytes"] * 8.5 / 4.5,
                                                                       rel=0.02)
    assert doc["table"].count("\n") == 3 and "| demo-q8_0.gguf | q8_0 |" in doc["table"]


def test_table_puts_llama_cpp_beside_hybrid():
    row = {"gguf": "f.gguf", "hybrid": {"cpu_dtype": "q4_k", "int4_group": None, "decode_b1_tok_s": 30.0,
                                        "decode_b1_of_roofline": 0.9, "prefill_8192_tok_s": 600.0},
           "llama": {"decode": {"tok_s": 12.0}, "prefill_8192": {"tok_s": 100.0}}}
    text = gguf_box.table([row], [8192])
    assert "| f.gguf | q4_k | 30.0 / 12.0 | 2.50x | 0.90 | 600 / 100 | 6.00x |" in text


def test_a_knob_ab_runs_on_the_loaded_file(tmp_path):
    """--ab hands hybrid_e2e's in-process knob A/B the file's model: both values timed, the result in the row."""
    path = convert(demo_checkpoint(), tmp_path / "demo-q8_0.gguf", "q8_0")
    out = tmp_path / "out"
    assert gguf_box.main(["--gguf", str(path), "--profile", "ktransformers-paper-amx", "--prefill", "16", "--steps",
                          "2", "--ab", "task_min=1/2", "--ab-rounds", "1", "--out", str(out)]) == 0
    ab = json.loads((out / "gguf_box.json").read_text())["rows"][0]["hybrid"]["decode_b1_ab"]
    assert ab["knob"] == "task_min" and ab["values"] == [1, 2]
    assert all(len(ab["tok_s"][v]) == 1 and ab["tok_s"][v][0] > 0 for v in ("1", "2"))
