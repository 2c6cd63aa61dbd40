"""`hybrid cost`, `hybrid calibrate`, `hybrid bench crossover` from the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_cost_json_schema(capsys):
    out = run_json(capsys, "cost", "--profile", "ktransformers-paper-avx512", "--experts", "8",
                   "--tokens", "1,128", "--json")
    assert isinstance(out["knee_tokens"], float)
    assert out["crossover_tokens"] == 72 and isinstance(out["crossover_tokens"], int)
    assert set(out["t_cpu_ms"]) == {"1", "128"} and set(out["t_gpu_ms"]) == {"1", "128"}
    assert out["t_cpu_ms"]["1"] == pytest.approx(1.458, abs=0.005)
    assert out["t_cpu_ms"]["128"] == pytest.approx(22.2, abs=0.05)
    assert out["t_gpu_ms"]["1"] == pytest.approx(12.5, abs=0.05)
    assert out["winner"] == {"1": "cpu", "128": "gpu"}


def test_cost_amx_crossover_and_overrides(capsys):
    out = run_json(capsys, "cost", "--profile", "ktransformers-paper-amx", "--json", "--tokens", "1")
    assert out["crossover_tokens"] == 689
    # the same box priced with explicit flags gives the same answer
    out2 = run_json(capsys, "cost", "--cpu-flops", "21.3e12", "--dram-bw", "220e9", "--gpu-flops", "156e12",
                    "--hbm-bw", "778e9", "--link-bw", "25e9", "--alpha", "5e-6", "--json", "--tokens", "1")
    assert out2["crossover_tokens"] == 689 and out2["knee_tokens"] == pytest.approx(out["knee_tokens"])


def test_cost_explicit_shape(capsys):
    out = run_json(capsys, "cost", "--profile", "ktransformers-paper-avx512", "--expert-params", "18874368",
                   "--hidden", "4096", "--bytes-per-weight", "2", "--act-bytes", "2", "--json", "--tokens", "1")
    assert out["crossover_tokens"] == 72 and out["expert_params"] == 18874368


def test_cost_no_crossover_is_null(capsys):
    out = run_json(capsys, "cost", "--profile", "ktransformers-paper-avx512", "--gpu-flops", "1e9", "--json",
                   "--tokens", "1")
    assert out["crossover_tokens"] is None


def test_cost_active_json(capsys):
    out = run_json(capsys, "cost", "active", "--experts", "128", "--topk", "8", "--tokens", "1",
                   "--expert-bytes", "37748736", "--json")
    assert out["expected_active_experts"] == pytest.approx(8.0)
    assert out["expected_weight_bytes"] == pytest.approx(8 * 37748736)


def test_cost_text_output(capsys):
    assert main(["cost", "--profile", "ktransformers-paper-avx512", "--tokens", "71,72"]) == 0
    text = capsys.readouterr().out
    assert "GPU wins from 72 tokens/expert (71 -> 72)" in text


@pytest.mark.parametrize("argv, message", [
    (["cost", "--dram-bw", "0"], "dram_bw"),
    (["cost", "--link-bw", "-5"], "link_bw"),
    (["cost", "--shape", "nope"], "unknown expert shape"),
    (["cost", "--profile", "nope"], "unknown profile"),
    (["cost", "--tokens", "1,x"], "--tokens"),
    (["cost", "--tokens", "0"], "--tokens"),
    (["cost", "--tokens", ""], "--tokens"),
    (["cost", "--experts", "0"], "--experts"),
    (["cost", "active", "--experts", "8", "--topk", "9", "--tokens", "4"], "--topk"),
    (["cost", "--cpu-kernel", "sse"], "sse"),
])
def test_bad_input_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_profile_file(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text('{"name": "x",')
    assert main(["cost", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and err.count("\n") == 1


def test_argparse_errors_exit_2_one_line():
    # unknown option / non-numeric float: argparse's own errors, through the real console entry point
    for argv in (["cost", "--dram-bw", "fast"], ["cost", "--bogus"]):
        proc = subprocess.run([sys.executable, "-m", "hybrid", *argv], capture_output=True, text=True)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_calibrate_cpu_only_writes_profile(tmp_path, capsys):
    out = tmp_path / "prof.json"
    rc = main(["calibrate", "--quick", "--hidden", "256", "--intermediate", "128", "--experts", "2",
               "--backends", "torch", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    # bytes/s: any machine reads more than 100 MB/s and less than 10 TB/s (catches a GB/s-vs-B/s slip)
    assert 1e8 < data["dram_bw"] < 1e13 and data["cpu_flops"]["torch"] > 0
    assert [p[0] for p in data["cpu_curves"]["torch"]] == [1, 4, 16, 64]
    text = capsys.readouterr().out
    assert "B_D" in text and "C_C" in text
    if data["gpu_flops"] is None:
        assert "no CUDA" in text


def test_bench_crossover_cpu_only(tmp_path, capsys):
    rc = main(["bench", "crossover", "--hidden", "256", "--intermediate", "128", "--experts", "2",
               "--tokens", "1,4", "--backend", "torch", "--reps", "1", "--out", str(tmp_path), "--tag", "t",
               "--profile", "ktransformers-paper-avx512"])
    assert rc == 0
    res = json.loads((tmp_path / "crossover_t.json").read_text())
    assert res["tokens"] == [1, 4] and all(t > 0 for t in res["measured_t_cpu_ms"])
    assert (tmp_path / "crossover_t.png").stat().st_size > 0
    assert res["predicted_crossover_tokens"] is not None  # the shape's own crossover on the paper box


def test_cost_layer_json(capsys):
    out = run_json(capsys, "cost", "layer", "--profile", "ktransformers-paper-amx", "--tokens", "1,512",
                   "--skew", "zipf1.0", "--resident", "8", "--json")
    assert [b["tokens"] for b in out["batches"]] == [1, 512]
    big = out["batches"][1]
    assert big["cpu"]["shipped"] == 0 and big["ship"]["cpu"] == 0
    # cost never predicts worse than the fixed strategies it chooses among
    assert big["cost"]["ms"] <= min(big[s]["ms"] for s in ("cpu", "ship", "threshold:32")) + 1e-9


def test_cost_layer_bad_skew(capsys):
    assert main(["cost", "layer", "--profile", "ktransformers-paper-amx", "--skew", "pareto"]) == 2
    assert "skew" in capsys.readouterr().err


def test_expected_histogram():
    from placement.layer_model import expected_histogram

    h = expected_histogram(128, 8, 3, "uniform")
    assert h.sum() == 24 and h.max() == 1  # 24 distinct experts with one token each
    z = expected_histogram(128, 8, 1000, "zipf1.5")
    assert z.sum() == 8000 and z.max() <= 1000 and z[0] >= z[-1]


def bench_module(name, *argv):
    """`python -m bench.<name> ARGV...` from the checkout's root, where bench/ lives (it is not installed)."""
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *argv], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300)


def test_bench_modules_run_from_the_checkout(tmp_path):
    r = bench_module("layer_sweep", "--help")
    assert r.returncode == 0
    assert "--strategies" in r.stdout
    assert bench_module("layer_sweep", "--bogus").returncode == 2
    r = bench_module("layer_sweep", "--profile", "ktransformers-paper-amx", "--tokens", "1,8", "--skews", "uniform",
                     "--strategies", "cost,cpu", "--reps", "1", "--out", str(tmp_path))
    assert r.returncode == 0 and (tmp_path / "layer_sweep_qwen3-30b-a3b.json").exists()
