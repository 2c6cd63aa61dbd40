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


def test_fixed_cost_fit_recovers_a_line_and_needs_two_sizes():
    # 40 us per call plus bytes at 100 GB/s, with +-1 us alternating noise, for two dtypes and one variant
    rows = [dict(dtype=d, variant="fused", bytes=n * 9e6 * k, median_s=40e-6 + n * 9e6 * k / 100e9 + (-1) ** n * 1e-6)
            for d, k in (("bf16", 1.0), ("int8", 0.5)) for n in (1, 2, 4, 8, 16)]
    fits = {f["dtype"]: f for f in decode_probe.fit_fixed_cost(rows)}
    assert set(fits) == {"bf16", "int8"}
    for f in fits.values():
        assert abs(f["fixed_s"] - 40e-6) < 2e-6 and abs(f["stream_gbps"] - 100) < 2 and f["calls"] == 5
        assert 0 < f["rms_resid_s"] < 1.5e-6
    one_size = [dict(r, bytes=9e6) for r in rows if r["dtype"] == "bf16"]
    assert decode_probe.fit_fixed_cost(one_size) == []


def test_decode_probe_fit_is_written(tmp_path):
    out = tmp_path / "p.json"
    assert decode_probe.main(["--shape", "tiny", "--experts", "16", "--dtypes", "int8", "--cases", "1x1,1x4,1x8",
                              "--variants", "fused", "--iters", "3", "--threads", "2", "--fit", "--out", str(out)]) == 0
    fits = json.loads(out.read_text())["fits"]
    assert [(f["dtype"], f["variant"], f["calls"]) for f in fits] == [("int8", "fused", 3)]


def test_decode_probe_pool_is_past_the_llc_for_the_smallest_dtype():
    D, F = decode_probe.SHAPES["qwen3-30b-a3b"]
    llc = 300 << 20  # the GPU box's L3
    from cpu_kernels.dtypes import CPU_DTYPES

    for dtypes in (["int4"], ["bf16", "int8", "int4"], ["bf16"], ["int8", "bf16"], ["q4_k", "q8_0"], ["int4-natural"]):
        pool = decode_probe.pool_size(dtypes, D, F, llc)
        per = 3 * D * F * min(CPU_DTYPES[d.split("-")[0]].bytes_per_weight(k=D) for d in dtypes)
        assert pool % 64 == 0 and pool >= 128 and pool * per >= 4 * llc
        assert pool == 128 or (pool - 64) * per < 4 * llc  # the smallest such multiple of 64
    assert decode_probe.pool_size(["int4"], D, F, 300 << 20) > decode_probe.pool_size(["bf16"], D, F, 300 << 20)
    assert decode_probe.pool_size(["q4_k"], D, F, 300 << 20) > decode_probe.pool_size(["q8_0"], D, F, 300 << 20)
    assert decode_probe.pool_size(["bf16"], D, F, 0) == 128  # no LLC known: the old default


def test_decode_probe_variant_overrides():
    assert decode_probe.variant_knobs("fused") == decode_probe.VARIANTS["fused"]
    k = decode_probe.variant_knobs("fused+task_rows=512+task_min=1")
    assert k == dict(decode_probe.VARIANTS["fused"], task_rows=512, task_min=1)
    assert decode_probe.variant_knobs("small-tasks+task_min=1")["task_min"] == 1
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


def test_decode_probe_rounds_alternate_and_summarize(tmp_path):
    assert decode_probe.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # a drift of +1 GB/s per timed call: forward-backward rounds give every variant the same mean position
    rows, t = [], 0
    for order in decode_probe.round_orders(["a", "b"], 4):
        for v in order:
            rows.append(dict(dtype="int4", case="1x8", variant=v, gbps=100.0 + t))
            t += 1
    summ = decode_probe.summarize_rounds(rows, ["a", "b"])
    assert [(m["variant"], m["rounds"]) for m in summ] == [("a", 4), ("b", 4)]
    a, b = summ
    assert (a["min_gbps"], a["max_gbps"], b["min_gbps"], b["max_gbps"]) == (100.0, 107.0, 101.0, 106.0)
    assert a["median_gbps"] == b["median_gbps"] == 103.5 and a["vs_first"] == b["vs_first"] == 1.0
    out = tmp_path / "p.json"
    assert decode_probe.main(["--shape", "tiny", "--experts", "16", "--dtypes", "int8", "--cases", "1x4",
                              "--variants", "fused,fused+tail_split=1", "--rounds", "3", "--iters", "2", "--threads", "2",
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["variant"], r["round"]) for r in res["rows"]] == [
        ("fused", 0), ("fused+tail_split=1", 0), ("fused+tail_split=1", 1), ("fused", 1), ("fused", 2), ("fused+tail_split=1", 2)]
    assert [m["rounds"] for m in res["summary"]] == [3, 3] and res["summary"][0]["vs_first"] == 1.0
    for bad in (["--rounds", "0"], ["--variants", "fused,fused"]):
        with pytest.raises(SystemExit):
            decode_probe.main(["--shape", "tiny", "--experts", "16", "--dtypes", "int8", "--cases", "1x4", *bad])


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


def _vs_main(tmp_path, monkeypatch, cases, hybrid_row=None, layers=12, experts=128, extra=(), llama_tok_s=None):
    """vs_llamacpp.main with both runs stubbed: the calls it makes, and the table it writes."""
    calls = []

    def llama(binary, gguf, placement, threads, reps):
        calls.append(("llama", gguf, placement))
        return dict(tok_s=(llama_tok_s or {}).get(gguf, 10.0), stddev=0.5, cmd="")

    def hybrid(args, cpu_dtype, placement, extra_env=None):
        calls.append(("hybrid", cpu_dtype, placement))
        return dict(hybrid_row or {}, tok_s=20.0)

    monkeypatch.setattr(vs_llamacpp, "run_llama", llama)
    monkeypatch.setattr(vs_llamacpp, "run_hybrid", hybrid)
    monkeypatch.setattr(vs_llamacpp, "plot", lambda rows, path: None)
    out = tmp_path / "vs"
    assert vs_llamacpp.main(["--llama-bench", "llama-bench", "--gguf-bf16", "b.gguf", "--profile", "p", "--layers",
                             str(layers), "--experts", str(experts), "--cases", cases, "--out", str(out),
                             *extra]) == 0
    return calls, (out / "vs_llamacpp.md").read_text().splitlines()


def test_vs_llamacpp_quarter_keeps_a_quarter_of_the_experts_in_vram_on_both_sides(tmp_path, monkeypatch):
    calls, _ = _vs_main(tmp_path, monkeypatch, "bf16,quarter")
    # 12 layers: llama.cpp keeps the experts of the last 3 (a quarter) in VRAM, so the first 9 go to the CPU;
    # hybrid keeps 32 of each layer's 128 experts resident
    assert calls == [("llama", "b.gguf", ["-ot", "exps=CPU"]), ("hybrid", "bf16", ["--resident", "0"]),
                     ("llama", "b.gguf", ["-ncmoe", "9"]), ("hybrid", "bf16", ["--resident", "32"])]


def test_vs_llamacpp_int4_runs_every_4bit_gguf_and_takes_the_fastest_as_yardstick(tmp_path, monkeypatch):
    calls, lines = _vs_main(tmp_path, monkeypatch, "int4", extra=["--gguf-q4", "q4_0.gguf", "q4_k_m.gguf"],
                            llama_tok_s={"q4_0.gguf": 8.0, "q4_k_m.gguf": 5.0})
    assert calls == [("llama", "q4_0.gguf", ["-ot", "exps=CPU"]), ("llama", "q4_k_m.gguf", ["-ot", "exps=CPU"]),
                     ("hybrid", "int4", ["--resident", "0"])]
    assert any(l.startswith("| int4 | 8.0 ± 0.5 | 20.0 | 2.50x |") for l in lines)
    assert "int4: llama.cpp q4_0.gguf 8.0 ± 0.5, q4_k_m.gguf 5.0 ± 0.5 tok/s; the ratio is against q4_0.gguf" in lines
    calls, lines = _vs_main(tmp_path, monkeypatch, "int4")  # no 4-bit GGUF: ours alone
    assert calls == [("hybrid", "int4", ["--resident", "0"])] and any(l.startswith("| int4 | - | 20.0 | - |") for l in lines)


def test_vs_llamacpp_rounds_alternate_the_order_and_report_each_sides_median_run(tmp_path, monkeypatch):
    """--rounds 3 over two cases: the order reversed every other round, each side's median run reported whole (its
    roofline figures with it), the ratio of the medians, every round listed under the table."""
    speeds = {"llama": iter([10.0, 30.0, 20.0, 12.0, 11.0, 13.0]), "hybrid": iter([40.0, 41.0, 45.0, 50.0, 35.0, 60.0])}
    calls = []

    def llama(binary, gguf, placement, threads, reps):
        calls.append(("llama", placement[0]))
        return dict(tok_s=next(speeds["llama"]), stddev=0.5, cmd="")

    def hybrid(args, cpu_dtype, placement):
        calls.append(("hybrid", placement[0]))
        t = next(speeds["hybrid"])
        return dict(tok_s=t, b1_of_roofline=t / 100)

    monkeypatch.setattr(vs_llamacpp, "run_llama", llama)
    monkeypatch.setattr(vs_llamacpp, "run_hybrid", hybrid)
    monkeypatch.setattr(vs_llamacpp, "plot", lambda rows, path: None)
    out = tmp_path / "vs"
    assert vs_llamacpp.main(["--llama-bench", "b", "--gguf-bf16", "b.gguf", "--profile", "p", "--cases",
                             "bf16,quarter", "--rounds", "3", "--out", str(out)]) == 0
    order = [c[1] for c in calls if c[0] == "llama"]  # bf16 runs -ot, the quarter -ncmoe
    assert order == ["-ot", "-ncmoe", "-ncmoe", "-ot", "-ot", "-ncmoe"]
    bf16, quarter = json.loads((out / "vs_llamacpp.json").read_text())["rows"]
    # bf16 ran rounds 1, 4 (reversed round 2 ran it last), 5: llama 10, 12, 11 -> 11; hybrid 40, 50, 35 -> 40
    assert bf16["llama"]["tok_s"] == 11.0 and bf16["hybrid"] == dict(tok_s=40.0, b1_of_roofline=0.4)
    assert bf16["ratio"] == 40.0 / 11.0 and [r["hybrid"] for r in bf16["rounds"]] == [40.0, 50.0, 35.0]
    assert quarter["llama"]["tok_s"] == 20.0 and quarter["hybrid"]["tok_s"] == 45.0
    lines = (out / "vs_llamacpp.md").read_text().splitlines()
    assert "bf16 rounds (hybrid / llama.cpp tok/s): 40.0 / 10.0, 50.0 / 12.0, 35.0 / 11.0" in lines


def test_vs_llamacpp_quarter_layers_is_llama_cpps_layout_on_both_sides(tmp_path, monkeypatch):
    """quarter-layers (asked for, not a default case): the same -ncmoe 9 for llama.cpp, and ours keeps every expert of
    the last 3 of 12 layers resident instead of 32 per layer."""
    calls, lines = _vs_main(tmp_path, monkeypatch, "quarter-layers")
    assert calls == [("llama", "b.gguf", ["-ncmoe", "9"]), ("hybrid", "bf16", ["--resident-layers", "3"])]
    assert any(l.startswith("| quarter-layers | 10.0 ± 0.5 | 20.0 | 2.00x |") for l in lines)
    assert "quarter-layers" not in vs_llamacpp.CASES


def test_hybrid_e2e_resident_layers_keeps_whole_layers_resident(tmp_path):
    """--resident-layers N: every expert of the last N hybrid layers resident, none elsewhere, so those layers read no
    cold expert; it replaces --resident and is bounded by --layers."""
    from bench import hybrid_e2e

    out = tmp_path / "e2e"
    assert hybrid_e2e.main(["--preset", "demo", "--profile", "ktransformers-paper-amx", "--layers", "2",
                            "--resident-layers", "1", "--strategies", "cpu", "--prefill", "16", "--decode-batch", "1",
                            "--steps", "2", "--out", str(out)]) == 0
    res = json.loads((out / "hybrid_e2e_demo.json").read_text())
    r = res["results"][0]
    import torch

    if torch.cuda.is_available():
        assert res["resident_layers"] == 1 and res["resident"] is None
        assert "every expert of the last 1 of 2 hybrid layers resident" in res["header"]
        # per layer and step: layer 0 routes K experts, all cold; layer 1 routes K, all resident -> means K/2 each
        assert r["decode_b1_cold_experts_per_layer_step"] == r["decode_b1_resident_experts_per_layer_step"] > 0
    else:  # no CUDA, no resident copies (they would be second copies in DRAM): every routed expert is cold
        assert res["resident_layers"] is None and res["resident"] == 0
        assert "no resident experts (no CUDA device" in res["header"]
        assert r["decode_b1_resident_experts_per_layer_step"] == 0 < r["decode_b1_cold_experts_per_layer_step"]
    counts = [5, 9, 1, 9]
    assert [hybrid_e2e.resident_ids(i, 4, counts, 2, 1) for i in range(4)] == [[], [], [], [0, 1, 2, 3]]
    assert [len(hybrid_e2e.resident_ids(i, 4, counts, 2, 0)) for i in range(4)] == [0, 0, 0, 0]
    assert hybrid_e2e.resident_ids(0, 4, counts, 2, None) == [1, 3]  # most routed, ties to the lower id
    for bad in (["--resident-layers", "3"], ["--resident-layers", "1", "--resident", "2"]):
        with pytest.raises(SystemExit):
            hybrid_e2e.main(["--preset", "demo", "--profile", "ktransformers-paper-amx", "--layers", "2", *bad,
                             "--out", str(out)])


def test_vs_llamacpp_table_shows_a_zero_share_as_zero_not_as_missing(tmp_path, monkeypatch):
    # no cold expert read again by the next step (share 0.0) is a measurement; "-" means none was made (None)
    _, lines = _vs_main(tmp_path, monkeypatch, "bf16", dict(b1_of_roofline=0.5, b1_cold_reused_from_last_step=0.0))
    row, = [l for l in lines if l.startswith("| bf16 |")]
    assert row.split(" | ")[1:6] == ["10.0 ± 0.5", "20.0", "2.00x", "50% (-)", "0%"]


def test_decode_timeline_gaps_names_and_the_offload_it_reads():
    """bench.decode_timeline's pieces that run without CUDA: idle time between consecutive kernels by pair (a
    step's host sync left out), kernel names cut to their bare name, and the Offload whose CPU lane it clocks."""
    from types import SimpleNamespace as NS

    from bench import decode_timeline as dt
    from hybrid.offload.overheads import floor_engine

    def ev(name, start, end):
        return NS(name=name, time_range=NS(start=start, end=end))

    kernels = [ev("void at::native::(anonymous namespace)::gemv<float>(int)", 0, 10), ev("router", 12, 20),
               ev("norm", 80, 81), ev("void at::native::(anonymous namespace)::gemv<float>(int)", 500, 510),
               ev("router", 511, 515), ev("norm", 575, 576)]
    gaps = dt.gap_table(kernels, per=2)
    # two layers: gemv -> router 2 and 1 us (median 1.5), router -> norm 60 us twice; norm -> gemv (419 us) is a
    # step's sync and is not counted
    assert gaps == {"gemv -> router": (1.0, 1.5), "router -> norm": (1.0, 60.0)}
    assert dt._short("void at::native::(anonymous namespace)::CatArrayBatchedCopy<int, 4>(x)") == "CatArrayBatchedCopy"
    eng, _, _ = floor_engine(256, layers=1, device="cpu", resident="none")
    off = dt.offload_of(eng)
    assert off is not None and off is eng.model.layers[0].moe.experts.offload
    assert dt.offload_of(NS(model=NS(layers=[NS(moe=None), NS()]))) is None


def test_vs_llamacpp_summarize_marks_each_target_met_or_not(tmp_path, capsys):
    """--summarize: one row per run, each target's value bold where it holds (a value at the floor holds), '-'
    where the run lacks the case, and the count met of those measured."""
    rows = [dict(case="bf16", ratio=1.25, hybrid=dict(b1_of_roofline=0.84, b8_of_roofline=0.90)),
            dict(case="int8", ratio=1.59, hybrid=dict(b1_of_roofline=0.7, b8_of_roofline=0.85)),
            dict(case="int4", hybrid=dict(b1_of_roofline=0.81, b8_of_roofline=None))]
    f = tmp_path / "vs_llamacpp.json"
    f.write_text(json.dumps(dict(rows=rows)))
    assert vs_llamacpp.main(["--summarize", str(f)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    names = [t[0] for t in vs_llamacpp.TARGETS]
    got = dict(zip(names, cells[1:-1]))
    assert got["bf16 ratio"] == "**1.25x**" and got["bf16 b1"] == "84%" and got["int8 ratio"] == "1.59x"
    assert got["int4 b1"] == "**81%**" and got["bf16 b8"] == "**90%**" and got["int8 b8"] == "**85%**"
    assert got["quarter ratio"] == "-" and got["quarter b8"] == "-" and got["int4 b8"] == "-"
    assert cells[-1] == "4 of 6"
    with pytest.raises(SystemExit):  # a run needs the binary, the GGUF and the profile
        vs_llamacpp.main(["--gguf-bf16", "x.gguf"])


def test_hybrid_e2e_ab_ahead_times_both_ways_and_the_tokens_agree(tmp_path):
    """--ab ahead=0/1: the same greedy steps timed one by one (0) and queued one ahead (1, as generation runs them)
    in one process; both give a rate. The main timings follow the engine (eager here: one by one) and say so."""
    from bench import hybrid_e2e

    out = tmp_path / "e2e"
    assert hybrid_e2e.main(["--preset", "demo", "--profile", "ktransformers-paper-amx", "--layers", "2",
                            "--strategies", "cpu", "--prefill", "16", "--decode-batch", "1,2", "--steps", "3",
                            "--ab", "ahead=0/1", "--ab-rounds", "1", "--out", str(out)]) == 0
    res = json.loads((out / "hybrid_e2e_demo.json").read_text())
    assert res["decode_ahead"] is False and "steps timed one by one" in res["header"]
    for b in (1, 2):
        ab = res["results"][0][f"decode_b{b}_ab"]
        assert ab["knob"] == "ahead" and set(ab["median_tok_s"]) == {"0", "1"}
        assert all(v > 0 for v in ab["median_tok_s"].values())
    with pytest.raises(SystemExit):
        hybrid_e2e.main(["--preset", "demo", "--profile", "ktransformers-paper-amx", "--ab", "ahead=0/2",
                         "--out", str(out)])


def test_decode_steps_ahead_feeds_each_step_the_tokens_of_the_one_before(tmp_path):
    """The queued-ahead timing loop (bench.hybrid_e2e.decode_steps_ahead) feeds the tokens the one-by-one loop feeds
    and counts the same routing per step, on an eager engine that queues ahead."""
    from bench import hybrid_e2e
    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config
    from hybrid.runtime import Engine
    from hybrid.runtime.config import RuntimeConfig
    import torch

    raw = hf_config("demo", layers=2)
    model = init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=0, std=0.1)
    got = {}
    for ahead in (False, True):
        eng = Engine(model, config=RuntimeConfig(max_batch=2, max_context=64, decode_ahead=ahead))
        slots = [eng.allocate_slot() for _ in range(2)]
        first = [int(eng.prefill(s, p).argmax()) for s, p in zip(slots, ([3, 4, 5], [9, 8, 7, 6]))]
        times, fed, nxt, routing = hybrid_e2e.decode_steps(eng, None, slots, first, 4, torch.device("cpu"),
                                                           count=False, ahead=ahead)
        assert len(times) == 4 and all(t > 0 for t in times) and routing == []
        assert fed[0] == first and fed[1:] == nxt[:-1]
        got[ahead] = nxt
    assert got[True] == got[False]


def test_vs_llamacpp_block_format_cases_run_ours_in_llama_cpps_own_values(tmp_path, monkeypatch):
    """q8_0 and q4_k: ours with --cpu-dtype q8_0 / q4_k against the same Q8_0 / 4-bit files as int8 and int4."""
    calls, _ = _vs_main(tmp_path, monkeypatch, "q8_0,q4_k", extra=["--gguf-q8", "q8.gguf", "--gguf-q4",
                                                                    "q4_k_m.gguf"])
    assert calls == [("llama", "q8.gguf", ["-ot", "exps=CPU"]), ("hybrid", "q8_0", ["--resident", "0"]),
                     ("llama", "q4_k_m.gguf", ["-ot", "exps=CPU"]), ("hybrid", "q4_k", ["--resident", "0"])]
