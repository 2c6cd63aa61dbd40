"""Bad command-line input: one line on stderr and exit status 2, never a traceback; values that used to be
accepted silently (more GPU experts than the model has, more threads than cores) are said out loud."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.cli import main
from loader_cases import write_tiny
from test_cli_hermetic import _cpu_only_profile

ENV = dict(os.environ, HYBRID_NO_PROGRESS="1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybrid.runtime.demo import build_tokenizer

    p = write_tiny(tmp_path_factory.mktemp("cli") / "m")
    build_tokenizer(p, vocab_size=300)
    return p


def hybrid(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "hybrid", *args], capture_output=True, text=True,
                          env={**ENV, **os.environ, **(env or {})}, timeout=300, **kw)


def one_line_exit_2(r, needle: str):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, r.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_cpu_threads_zero(tiny):
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--gpu-experts", "1", "--cpu-threads", "0",
                           "--profile", "ktransformers-paper-amx"),
                    "--cpu-threads must be >= 1")


def test_cpu_threads_alone_turns_the_hybrid_path_on(tiny):
    """--cpu-threads and --profile belong to the group 'any of these turns it on': alone they are not dropped."""
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--cpu-threads", "0"),
                    "--cpu-threads must be >= 1")
    import argparse

    from hybrid.loading.parse import add_hybrid_arguments, hybrid_config_from_args

    p = argparse.ArgumentParser()
    add_hybrid_arguments(p)
    assert hybrid_config_from_args(p.parse_args([])) is None
    assert hybrid_config_from_args(p.parse_args(["--cpu-threads", "2"])).cpu_threads == 2
    assert hybrid_config_from_args(p.parse_args(["--profile", "ktransformers-paper-amx"])).profile == "ktransformers-paper-amx"


def test_bogus_isa(tiny):
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--gpu-experts", "1",
                           "--profile", "ktransformers-paper-amx", env={"HYBRID_CPU_ISA": "bogus"}), "HYBRID_CPU_ISA='bogus' is not one of")


def test_bogus_hugepages_policy(tiny):
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--gpu-experts", "1",
                           "--profile", "ktransformers-paper-amx", env={"HYBRID_HUGEPAGES": "yes"}),
                    "HYBRID_HUGEPAGES must be 0 or 1, not 'yes'")


def test_tiny_temperature_generates(tiny, capsys):
    # sampling at temperature 1e-40 is greedy in effect; it must not overflow into a traceback
    assert main(["generate", "--model", str(tiny), "-n", "3", "--temperature", "1e-40", "--seed", "1", "--json"]) == 0
    greedy_sampled = json.loads(capsys.readouterr().out)["generated_token_ids"]
    assert main(["generate", "--model", str(tiny), "-n", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generated_token_ids"] == greedy_sampled
    assert ("vram" in out) == (out["device"].startswith("cuda"))  # the device-memory phases: CUDA runs only


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_bad_temperature_is_one_line(tiny, value):
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--temperature", value), "temperature")


def test_huge_max_context_refused_before_allocating(tiny):
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--max-context", str(10**12)),
                    "the KV cache for --max-context 1000000000000")


def test_calibrate_bogus_backend_before_measuring(tmp_path):
    r = hybrid("calibrate", "--backends", "bogus", "--out", str(tmp_path / "p.json"))
    one_line_exit_2(r, "--backends: bogus not available here")
    assert "DRAM" not in r.stdout  # nothing was measured


def test_calibrate_unwritable_out_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = hybrid("calibrate", "--out", str(blocker / "sub" / "p.json"))  # a folder under a file: never writable
    one_line_exit_2(r, "--out")
    assert "DRAM" not in r.stdout


@pytest.mark.parametrize("flag", ["--stats", "--profile"])
def test_non_utf8_files(tiny, tmp_path, flag):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"kind": "\xff\xfe"}')
    one_line_exit_2(hybrid("plan", "--model", str(tiny), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", flag, str(bad)),
                    "not UTF-8")


def test_non_utf8_prompts(tiny, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"hello \xff world\n")
    one_line_exit_2(hybrid("profile-routing", "--model", str(tiny), "--gpu-experts", "0", "--prompts", str(bad)),
                    "not UTF-8")


@pytest.fixture(scope="module")
def stats(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("st") / "stats.json"
    r = hybrid("profile-routing", "--model", str(tiny), "--gpu-experts", "0", "--decode-tokens", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("count", [1e30, 1e12, 10**13, -3, "7", 2.5])
def test_absurd_stats_counts(tiny, stats, tmp_path, count):
    data = json.loads(json.dumps(stats))
    data["layers"][0]["counts"][0] = count
    f = tmp_path / "s.json"
    f.write_text(json.dumps(data))
    r = hybrid("plan", "--model", str(tiny), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--stats", str(f))
    one_line_exit_2(r, "routing stats")


@pytest.fixture(scope="module")
def plan(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("pl") / "plan.json"
    r = hybrid("plan", "--model", str(tiny), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("edit", [
    lambda p: p["settings"].update(staging_slots="4"),
    lambda p: p["settings"].update(max_context=[1]),
    lambda p: p["settings"].update(cpu_dtype=8),
    lambda p: p["model"].update(num_experts="4"),
    lambda p: p["model"].update(moe_layers="0,1"),
    lambda p: p["layers"][0].update(resident_experts="0"),
    lambda p: p["layers"][0].update(resident_experts=[0.5]),
    lambda p: p.update(layers={"a": 1}),
    lambda p: p.update(memory=[1]),
])
def test_plan_file_fields_of_the_wrong_type(tiny, plan, tmp_path, edit):
    data = json.loads(json.dumps(plan))
    edit(data)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(data))
    one_line_exit_2(hybrid("generate", "--model", str(tiny), "-n", "1", "--plan", str(f)), "plan")


def test_broken_pipe_is_silent():
    # `hybrid cost ... | head -1`: a table far larger than the pipe's buffer, the reader gone after one line
    tokens = ",".join(str(i) for i in range(1, 15001))
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "cost", "--profile", "ktransformers-paper-amx", "--tokens",
                          tokens], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141
    assert first.startswith(b"profile ktransformers-paper-amx")
    assert err == "", err


def test_gpu_experts_above_the_model_is_said(tiny, caplog):
    from hybrid.loading.place import resident_count
    from hybrid.offload.config import HybridConfig
    from hybrid.models import load_model

    model = load_model(tiny, progress=False)
    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        n = resident_count(model, HybridConfig(gpu_experts=999))
    assert n == 4
    assert "--gpu-experts 999 is more than the model's 4 experts per layer" in caplog.text


def test_cpu_threads_above_the_cores_warns(caplog):
    from hybrid.offload.config import HybridConfig

    with caplog.at_level(logging.WARNING, logger="hybrid.offload"):
        HybridConfig(gpu_experts=1, cpu_threads=10_000)
    assert "--cpu-threads 10000 is more than the" in caplog.text


def test_missing_kernels_fall_back_loudly(monkeypatch, caplog):
    from cpu_kernels import _native, knobs

    monkeypatch.delenv("HYBRID_CPU_ISA", raising=False)
    knobs.reset()
    monkeypatch.setattr(_native, "_lib_path", lambda name: None)  # as if `pip install -e .` never compiled them
    _native.why_unavailable.cache_clear()
    _native.default_isa.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=_native.log.name):
            assert _native.default_isa() == "ref"
        warn = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert warn and "falling back to the PyTorch reference" in warn[0].getMessage()
        assert "pip install -e ." in warn[0].getMessage()
    finally:
        monkeypatch.undo()
        _native.why_unavailable.cache_clear()
        _native.default_isa.cache_clear()


@pytest.mark.parametrize("argv,needle", [
    (["bench.make_checkpoint", "--preset", "demo", "--layers", "0", "--out", "OUT"], "--layers"),
    (["bench.quality", "--settings", "cpu:int9"], "unknown setting"),
    (["bench.quality", "--settings", "cpu:int8:64"], "only int4 takes a group size"),
])
def test_bad_bench_arguments_are_one_line(tmp_path, argv, needle):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env={**ENV, **os.environ},
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    one_line_exit_2(r, needle)


def test_cuda_allocator_gets_growable_segments_unless_the_user_set_it(monkeypatch):
    """Every command sets PYTORCH_CUDA_ALLOC_CONF to expandable segments before anything touches CUDA; a value the
    user exported is kept."""
    from hybrid import cli

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["nosuch"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(SystemExit):
        cli.main(["nosuch"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
