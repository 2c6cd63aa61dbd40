"""A model this machine's DRAM cannot hold is refused before anything is loaded, in one line that names the need,
the memory available and what to change (hybrid.loading.dram); without CUDA no resident copies are made."""

from __future__ import annotations

import argparse
import json

import pytest

from hybrid.cli import main
from hybrid.errors import TooLarge
from hybrid.loading import dram

GIB = 2**30


def preset_cfg(name: str = "qwen3-30b-a3b", layers: int = 8):
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config

    raw = hf_config(name, layers=layers)
    return family_for(raw).parse_config(raw)


def session(*argv):
    from hybrid.loading.parse import add_model_arguments, session_config_from_args

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    return session_config_from_args(p.parse_args(["--device", "cpu", *argv]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hybrid.runtime.demo import build_tokenizer
    from loader_cases import write_tiny

    path = write_tiny(tmp_path_factory.mktemp("dram") / "m")
    build_tokenizer(path, vocab_size=300)
    return path


def test_the_cpu_upcast_model_is_counted_whole():
    """The README's 8-layer Qwen3-30B-A3B cut in fp32 on the CPU: every weight in 4 bytes, ~22 GiB."""
    cfg = preset_cfg()
    need = dict(dram.model_dram(cfg, True, 4, None, 4096, 1).parts)
    counts = cfg.param_counts()
    assert need["experts (32-bit floats)"] == counts["experts"] * 4
    assert need["non-expert weights"] >= counts["non_expert"] * 4
    assert need["KV cache"] == 4097 * cfg.kv_values_per_token * 4
    assert sum(need.values()) > 22 * GIB
    from placement.memory import MemorySettings, breakdown

    hybrid = dict(dram.model_dram(cfg, True, 4, "int8", 4096, 1).parts)
    assert hybrid["experts (int8)"] == breakdown(cfg, MemorySettings(cpu_dtype="int8")).dram_experts_all
    assert hybrid["loading"] == 3 * cfg.num_experts * cfg.hidden_size * cfg.expert_intermediate_size * 4  # one fp32 layer
    on_gpu = dict(dram.model_dram(cfg, False, 2, "bf16", 4096, 1).parts)  # with CUDA: the GPU's share is VRAM
    assert on_gpu["non-expert weights"] == on_gpu["KV cache"] == on_gpu["ship-lane staging"] == 0
    assert dict(dram.model_dram(cfg, False, 2, None, 4096, 1).parts)["experts (16-bit floats)"] == 0


def test_refusal_names_need_available_and_the_dtype_that_fits():
    from hybrid.loading.check import check_dram

    cfg = preset_cfg()
    with pytest.raises(TooLarge) as exc:
        check_dram(cfg, session(), available=(12 * GIB, "MemAvailable"))
    msg = str(exc.value)
    assert "needs about 22.67 GiB of DRAM (non-expert weights 2.89 GiB" in msg and "12.00 GiB available (MemAvailable)" in msg
    assert "use --cpu-dtype int8 (experts packed for the CPU executor: about 11.14 GiB)" in msg  # bf16 (14.4) does not fit
    assert "fewer layers" in msg and "--max-context" not in msg
    with pytest.raises(TooLarge, match="use a lower --max-context"):  # a KV cache that is most of the need
        check_dram(cfg, session("--cpu-dtype", "int4", "--max-context", "200000"), available=(9 * GIB, "x"))
    check_dram(cfg, session("--cpu-dtype", "int8"), available=(12 * GIB, "MemAvailable"))  # fits: nothing raised


def test_generate_refuses_before_loading_in_one_line(tiny, monkeypatch, capsys):
    import hybrid.models
    import hybrid.offload.build

    def loaded(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(hybrid.models, "load_model", loaded)
    monkeypatch.setattr(hybrid.offload.build, "load_hybrid", loaded)
    monkeypatch.setattr(dram, "available_dram", lambda: (64 * 2**20, "its cgroup's memory limit"))
    for extra in ([], ["--cpu-dtype", "int8"]):
        assert main(["generate", "--model", str(tiny), "-n", "1", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hybrid generate: error: the model (2 layers, no CUDA device")
        assert "of DRAM (" in err[0] and "64.0 MiB available (its cgroup's memory limit)" in err[0]


def test_bench_defaults_refused_in_one_line(monkeypatch, capsys):
    """`python -m bench.generate` with no arguments is 48 fp32 layers on the CPU: refused before it is built."""
    from bench import generate
    from bench.entry import run_main

    def built(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(generate, "build_empty", built)
    monkeypatch.setattr(dram, "available_dram", lambda: (24 * GIB, "MemAvailable"))
    assert run_main(lambda: generate.main(["--device", "cpu"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x 48 layers in float32 on cpu needs about" in err[0] and "--layers" in err[0]


def test_available_is_the_lower_of_meminfo_and_the_cgroup(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert dram.meminfo_available(tmp_path / "meminfo") == 2048 * 1024
    v2 = tmp_path / "v2"
    (v2 / "svc" / "job").mkdir(parents=True)
    (v2 / "svc" / "memory.max").write_text("1000000\n")  # the parent's limit is the tighter one
    (v2 / "svc" / "memory.current").write_text("700000\n")
    (v2 / "svc" / "memory.stat").write_text("anon 500000\ninactive_file 100000\n")
    (v2 / "svc" / "job" / "memory.max").write_text("max\n")
    (v2 / "svc" / "job" / "memory.current").write_text("600000\n")
    (tmp_path / "cg2").write_text("0::/svc/job\n")
    assert dram.cgroup_headroom(tmp_path / "cg2", v2) == 1000000 - (700000 - 100000)
    v1 = tmp_path / "v1" / "memory" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("5000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000000\n")
    (v1.parent / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: no limit
    (v1.parent / "memory.usage_in_bytes").write_text("1\n")
    (tmp_path / "cg1").write_text("4:memory:/box\n1:cpu:/\n")
    assert dram.cgroup_headroom(tmp_path / "cg1", tmp_path / "v1") == 4000000
    (tmp_path / "cg0").write_text("1:cpu:/\n")
    assert dram.cgroup_headroom(tmp_path / "cg0", v2) is None
    monkeypatch.setattr(dram, "meminfo_available", lambda: 8 * GIB)
    monkeypatch.setattr(dram, "cgroup_headroom", lambda: 3 * GIB)
    assert dram.available_dram() == (3 * GIB, "its cgroup's memory limit")
    monkeypatch.setattr(dram, "cgroup_headroom", lambda: None)
    assert dram.available_dram() == (8 * GIB, "MemAvailable")


def test_no_resident_copies_without_cuda(tiny, capsys):
    """--gpu-budget / --gpu-experts make no resident experts without CUDA (they would be second copies in DRAM),
    and the log says so."""
    assert main(["generate", "--model", str(tiny), "-n", "1", "--json", "--gpu-budget", "24GiB",
                 "--profile", "ktransformers-paper-amx"]) == 0
    out, err = capsys.readouterr()
    h = json.loads(out)["hybrid"]
    assert h["resident_experts_per_layer"] == [0, 0] and h["resident_bytes"] == 0
    assert "hybrid: no CUDA device: --gpu-budget makes no resident experts here" in err
    from hybrid.loading.check import without_cpu_residents

    lines = []
    config = without_cpu_residents(session("--gpu-experts", "3"), lines.append)
    assert config.hybrid.gpu_experts == 0 and "--gpu-experts 3 makes no resident experts" in lines[0]
    assert without_cpu_residents(session("--cpu-dtype", "int8"), lines.append).hybrid.cpu_dtype == "int8"
    assert len(lines) == 1  # nothing asked to be resident: nothing said


def test_e2e_bench_makes_no_resident_copies_without_cuda(tmp_path, monkeypatch, capsys):
    """bench.hybrid_e2e's default is a quarter of the experts resident: without CUDA none (second copies in DRAM),
    and a model too large for DRAM is one line before it is built."""
    import torch

    from bench import hybrid_e2e
    from bench.entry import run_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hybrid_e2e, "timed", lambda fn, dev: (fn(), 0.01)[1])
    monkeypatch.setattr(hybrid_e2e, "CPU_ONLY_DEFAULTS",
                        {"prefill": [8], "decode_batch": [1], "steps": 1, "strategies": ["cpu"]})
    argv = ["--preset", "demo", "--layers", "1", "--profile", "ktransformers-paper-amx", "--isa", "ref",
            "--out", str(tmp_path)]
    assert hybrid_e2e.main(argv) == 0
    res = json.loads((tmp_path / "hybrid_e2e_demo.json").read_text())
    assert res["memory"]["vram_resident_bytes"] == 0 and res["resident"] == 0
    assert "no resident experts (no CUDA device" in res["header"]
    monkeypatch.setattr(dram, "available_dram", lambda: (2 * GIB, "MemAvailable"))
    monkeypatch.setattr(hybrid_e2e, "build_empty", lambda *a, **k: pytest.fail("the model was built"))
    capsys.readouterr()
    assert run_main(lambda: hybrid_e2e.main(["--profile", "ktransformers-paper-amx", "--out", str(tmp_path)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "qwen3-30b-a3b x 8 layers (bf16 experts) needs about" in err[0] and "--layers" in err[0]


def test_experts_read_in_place_stage_no_layer():
    """Where the compiled packer converts the experts from the memory-mapped checkpoint, the loading part is the
    largest tensor (the fp32 embedding), not a layer's float stack."""
    cfg = preset_cfg()
    staged = dict(dram.model_dram(cfg, True, 4, "int4", 4096, 1).parts)
    in_place = dict(dram.model_dram(cfg, True, 4, "int4", 4096, 1, views=True).parts)
    D, F, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    assert staged["loading"] == 3 * E * D * F * 4
    assert in_place["loading"] == cfg.vocab_size * D * 4 < staged["loading"]
    assert {k: v for k, v in in_place.items() if k != "loading"} == {k: v for k, v in staged.items() if k != "loading"}


def test_reads_in_place_follows_the_packer(tiny):
    from cpu_kernels import _native
    from hybrid.loading.check import reads_in_place

    compiled = _native.has_packer(_native.resolve_isa(None))
    assert reads_in_place(session("--model", str(tiny), "--cpu-dtype", "int8"), "int8") is compiled
    import dataclasses

    plain = session("--model", str(tiny), "--cpu-dtype", "int8")
    ref = dataclasses.replace(plain, hybrid=dataclasses.replace(plain.hybrid, cpu_isa="ref"))
    assert not reads_in_place(ref, "int8")  # the PyTorch reference packer stages each layer
    assert not reads_in_place(session("--model", str(tiny), "--cpu-dtype", "mxfp4"), "mxfp4")  # staged as published
    assert not reads_in_place(session("--cpu-dtype", "int8"), "int8")  # no checkpoint named


def test_fp32_weights_on_the_cpu_suggest_bf16_compute():
    """DeepSeek-V3's first five layers on a CPU machine: halving the fp32 non-expert weights is what makes it fit,
    so the refusal offers bf16 compute, with its total."""
    from hybrid.loading.check import check_dram

    cfg = preset_cfg("deepseek-v3", layers=5)
    fp32 = dram.model_dram(cfg, True, 4, "int4", 4096, 1)
    bf16 = dram.model_dram(cfg, True, 2, "int4", 4096, 1)
    between = (fp32.total + bf16.total) // 2
    with pytest.raises(TooLarge) as exc:
        check_dram(cfg, session("--cpu-dtype", "int4"), available=(between, "MemAvailable"))
    assert f"use --dtype bf16 (the non-expert weights, {dram.gib(dict(fp32.parts)['non-expert weights'])} in fp32 on " \
           f"the CPU, halved: about {dram.gib(bf16.total)} in all)" in str(exc.value)
    with pytest.raises(TooLarge) as exc:  # bf16 does not fit either: not offered
        check_dram(cfg, session("--cpu-dtype", "int4"), available=(bf16.total - 1, "MemAvailable"))
    assert "--dtype bf16" not in str(exc.value)
    check_dram(cfg, session("--cpu-dtype", "int4", "--dtype", "bf16"), available=(bf16.total, "MemAvailable"))
