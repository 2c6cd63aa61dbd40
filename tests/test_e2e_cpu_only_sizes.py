"""Issue 14: `bench e2e` without CUDA is bounded: prompt lengths, steps, batches and strategies the user did not
give are the reduced CPU-only ones, said in the header ('CPU-only: reduced sizes') and in the JSON, which keeps
the keys of a full run (per strategy: prefill_<n>_* and decode_b<b>_*)."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest
import torch


def _args(**given):
    base = dict(prefill=None, decode_batch=None, steps=None, strategies=None)
    return argparse.Namespace(**{**base, **given})


def test_cpu_only_defaults_are_reduced_and_recorded():
    from bench.hybrid_e2e import CPU_ONLY_DEFAULTS, GPU_DEFAULTS, apply_defaults

    a = _args()
    apply_defaults(a, cuda=False)
    assert (a.prefill, a.decode_batch, a.steps, a.strategies) == tuple(CPU_ONLY_DEFAULTS[k] for k in GPU_DEFAULTS)
    assert max(a.prefill) <= 256 and a.steps <= 4 and len(a.strategies) <= 2  # bounded
    assert a.reduced == {"prefill": "128", "decode_batch": "1", "steps": 4, "strategies": "cost,cpu"}
    b = _args(prefill=[64], steps=2)  # what the user gives is kept, and not reported as reduced
    apply_defaults(b, cuda=False)
    assert b.prefill == [64] and b.steps == 2 and "prefill" not in b.reduced and "steps" not in b.reduced
    g = _args()
    apply_defaults(g, cuda=True)
    assert g.prefill == [2048, 8192] and g.strategies == ["cost", "cpu", "ship", "threshold:32"] and g.reduced == {}


def test_e2e_cpu_only_run_says_reduced_and_keeps_keys(tmp_path, monkeypatch, capsys):
    from bench import hybrid_e2e

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = itertools.count()  # every timed call a little shorter than the one before: the median is the middle run

    def shrinking(fn, dev):
        fn()
        return 0.05 - 1e-4 * next(calls)

    monkeypatch.setattr(hybrid_e2e, "timed", shrinking)
    monkeypatch.setattr(hybrid_e2e, "CPU_ONLY_DEFAULTS",  # the demo shape: same code path, smaller numbers
                        {"prefill": [24], "decode_batch": [1], "steps": 2, "strategies": ["cost", "cpu"]})
    assert hybrid_e2e.main(["--preset", "demo", "--layers", "1", "--profile", "ktransformers-paper-amx",
                            "--isa", "ref", "--prefill-repeats", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CPU-only: reduced sizes (prefill 24, decode batch 1, steps 2, strategies cost,cpu" in out
    assert "VRAM" not in out and "torch on the CPU" in out
    res = json.loads((tmp_path / "hybrid_e2e_demo.json").read_text())
    assert res["cpu_only_reduced"]["strategies"] == "cost,cpu" and "CPU-only: reduced sizes" in res["header"]
    assert {"header", "graphs", "preset", "layers", "resident", "cpu_isa", "profile", "memory", "measured",
            "dense_bytes", "results"} <= set(res)
    assert [r["strategy"] for r in res["results"]] == ["cost", "cpu"]
    for row in res["results"]:
        for key in ("bound_tok_s", "of_bound", "all_ship_link_tok_s", "tok_s", "ms", "sched"):
            assert f"prefill_24_{key}" in row
        runs = row["prefill_24_runs_tok_s"]  # --prefill-repeats 3: every run, and their median as the figure
        assert len(runs) == 3 and runs[0] < runs[1] < runs[2]
        assert abs(row["prefill_24_tok_s"] - runs[1]) <= 0.1  # the median, not the first run
        for key in ("tok_s", "ms", "cold_experts_per_layer_step", "resident_experts_per_layer_step", "roofline_tok_s",
                    "of_roofline", "sched", "dram_after_GBps", "of_roofline_after"):
            assert f"decode_b1_{key}" in row
        assert row["decode_b1_dram_after_GBps"] > 0
        # the same bound at the second ceiling: a lower ceiling can only lengthen the bound (raise the share)
        first, after = res["measured"]["dram_bw"] / 1e9, row["decode_b1_dram_after_GBps"]
        share, share_after = row["decode_b1_of_roofline"], row["decode_b1_of_roofline_after"]
        if after < first:
            assert share_after >= share
        elif after > first:
            assert share_after <= share


def test_e2e_knobs_parse_and_refuse():
    """--tune takes knob=value pairs of the executor's run-time knobs; an unknown knob or a non-integer is refused."""
    import argparse

    from bench.hybrid_e2e import knobs

    assert knobs("pf_rows=16,task_min=1") == {"pf_rows": 16, "task_min": 1} and knobs("") == {}
    for bad in ("bogus=1", "pf_rows", "pf_rows=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad knob"):
            knobs(bad)
