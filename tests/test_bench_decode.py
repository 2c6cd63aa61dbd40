"""Smoke tests of the decode benchmarks on the CPU (their numbers mean nothing here): bench.decode_probe and
bench.vs_llamacpp with a stand-in for the llama-bench binary that prints llama-bench's JSON."""

import json
import stat

import pytest

from bench import decode_probe, vs_llamacpp


def test_decode_probe_writes_rows_per_dtype_case_and_variant(tmp_path):
    out = tmp_path / "p.json"
    assert decode_probe.main(["--shape", "tiny", "--experts", "16", "--dtypes", "bf16,int8", "--cases", "1x8,2x4same",
                              "--variants", "fused,phased", "--iters", "3", "--threads", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ceiling_gbps"] > 0
    assert len(res["rows"]) == 2 * 2 * 2
    for r in res["rows"]:
        assert r["median_s"] > 0 and r["gbps"] > 0
        # the share against the higher of the two ceilings (before and after the cases) is the smaller one
        best = max(res["ceiling_gbps"], res["ceiling_after_gbps"])
        assert abs(r["pct_dram_best"] - 100 * r["gbps"] / best) < 1e-9 and r["pct_dram_best"] <= r["pct_dram"] + 1e-9
    # "2x4same": two tokens on the same 4 experts read 4 distinct experts; "1x8" reads 8
    assert {r["case"]: r["distinct_experts"] for r in res["rows"]} == {"1x8": 8, "2x4same": 4}


def test_decode_probe_pool_is_past_the_llc_for_the_smallest_dtype():
    D, F = decode_probe.SHAPES["qwen3-30b-a3b"]
    llc = 300 << 20  # the GPU box's L3
    for dtypes in (["int4"], ["bf16", "int8", "int4"], ["bf16"], ["int8", "bf16"]):
        pool = decode_probe.pool_size(dtypes, D, F, llc)
        per = 3 * D * F * min(decode_probe.BITS[d] for d in dtypes) / 8
        assert pool % 64 == 0 and pool >= 128 and pool * per >= 4 * llc
        assert pool == 128 or (pool - 64) * per < 4 * llc  # the smallest such multiple of 64
    assert decode_probe.pool_size(["int4"], D, F, 300 << 20) > decode_probe.pool_size(["bf16"], D, F, 300 << 20)
    assert decode_probe.pool_size(["bf16"], D, F, 0) == 128  # no LLC known: the old default


def test_decode_probe_variant_overrides():
    assert decode_probe.variant_knobs("fused") == decode_probe.VARIANTS["fused"]
    k = decode_probe.variant_knobs("fused+task_rows=512+task_min=1")
    assert k == dict(decode_probe.VARIANTS["fused"], task_rows=512, task_min=1)
    assert decode_probe.variant_knobs("small-tasks+pf_first=1")["pf_first"] == 1
    for bad in ("bogus", "fused+nope=1", "fused+task_rows", "fused+task_rows=x"):
        with pytest.raises(ValueError):
            decode_probe.variant_knobs(bad)


def test_decode_probe_runs_an_override_variant(tmp_path):
    out = tmp_path / "p.json"
    assert decode_probe.main(["--shape", "tiny", "--experts", "16", "--dtypes", "int4", "--cases", "2x8",
                              "--variants", "fused,small-tasks,fused+task_rows=512+task_min=1", "--iters", "2",
                              "--threads", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fused", "small-tasks", "fused+task_rows=512+task_min=1"]


def test_vs_llamacpp_table_and_ratio(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho '[{\"avg_ts\": 50.0, \"stddev_ts\": 1.5}]'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "vs"
    assert vs_llamacpp.main(["--llama-bench", str(fake), "--gguf-bf16", "unused.gguf", "--profile",
                             "ktransformers-paper-amx", "--preset", "demo", "--layers", "1", "--experts", "8",
                             "--cases", "bf16", "--steps", "2", "--out", str(out)]) == 0
    res = json.loads((out / "vs_llamacpp.json").read_text())
    row, = res["rows"]
    assert row["llama"]["tok_s"] == 50.0
    assert row["ratio"] == row["hybrid"]["tok_s"] / 50.0 and row["hybrid"]["tok_s"] > 0
    assert row["hybrid"]["b1_cold_experts_per_layer_step"] > 0
    assert row["hybrid"]["b1_llc_roofline_tok_s"] >= row["hybrid"]["b1_roofline_tok_s"] > 0
    assert row["hybrid"]["b1_dram_after_GBps"] > 0 and row["hybrid"]["b1_of_roofline_after"] > 0
    table = (out / "vs_llamacpp.md").read_text()
    assert "| bf16 | 50.0 ± 1.5 |" in table
    h = row["hybrid"]
    assert f"| {h['b1_of_roofline_after'] * 100:.0f}% / {h['b8_of_roofline_after'] * 100:.0f}% |" in table
    assert (out / "vs_llamacpp.png").stat().st_size > 0
