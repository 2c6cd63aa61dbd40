"""`python -m bench.hybrid_e2e` without CUDA is bounded: prompt lengths, steps, batches and strategies the user did not
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


def test_e2e_ab_parse_and_refuse():
    """--ab names one knob and two or more distinct integer values."""
    import argparse

    from bench.hybrid_e2e import ab_values

    assert ab_values("tail_split=0/1") == ("tail_split", [0, 1]) and ab_values("pf_rows=16/8/32") == ("pf_rows", [16, 8, 32])
    for bad in ("tail_split=1", "tail_split=1/1", "bogus=0/1", "tail_split", "tail_split=0/x", "env:PATH=0/1",
                "env:HYBRID_ROUTER_NORM=1/1", "env:HYBRID_ROUTER_NORM=1", "env:HYBRID_ROUTER_NORM"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab_values(bad)


def test_e2e_ab_rounds_alternate_on_the_same_tokens(tmp_path, monkeypatch, capsys):
    """Each round runs every value once, forward then backward in turn, over the main measurement's prompts; the
    knob is back at its value afterwards, and the medians and shares come from the runs."""
    from bench import hybrid_e2e
    from cpu_kernels import _native

    from cpu_kernels import available_isas

    compiled = [i for i in available_isas() if i not in ("ref", "torch")]
    if not compiled:
        pytest.skip("no compiled ISA on this machine")
    isa = compiled[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen = []
    real_tune = _native.tune

    def spy(i, name, value):
        if name == "task_min":
            seen.append(value)
        return real_tune(i, name, value)

    monkeypatch.setattr(_native, "tune", spy)
    before = real_tune(isa, "task_min", 2)
    real_tune(isa, "task_min", before)
    assert hybrid_e2e.main(["--preset", "demo", "--layers", "1", "--profile", "ktransformers-paper-amx", "--isa", isa,
                            "--prefill", "24", "--decode-batch", "2", "--steps", "2", "--strategies", "cpu",
                            "--ab", "task_min=1/3", "--ab-rounds", "3", "--out", str(tmp_path)]) == 0
    # set, restore per run: values 1 3 | 3 1 | 1 3, each followed by the restore of the previous value
    assert seen[0::2] == [1, 3, 3, 1, 1, 3] and set(seen[1::2]) == {before}
    assert real_tune(isa, "task_min", before) == before
    row, = json.loads((tmp_path / "hybrid_e2e_demo.json").read_text())["results"]
    ab = row["decode_b2_ab"]
    assert ab["knob"] == "task_min" and ab["values"] == [1, 3] and ab["rounds"] == 3
    for v in ("1", "3"):
        runs = ab["tok_s"][v]
        assert len(runs) == 3 and ab["median_tok_s"][v] == sorted(runs)[1]
        assert ab["of_roofline"][v] == pytest.approx(row["decode_b2_roofline_tok_s"] ** -1 * ab["median_tok_s"][v])
    assert ab["vs_first"]["1"] == 1.0
    assert "# A/B task_min at batch 2, 3 rounds: 1: " in capsys.readouterr().out
