"""On a machine without a GPU every output says what is real there. generate / chat status lines and
--json name torch on the CPU as the 'GPU' side (no VRAM, no shipped-to-GPU claims), /metrics labels the
cold-expert series and exposes hybrid_device_info, `hybrid plan` marks its prediction as the profile's GPU
(hypothetical without CUDA) and refuses a profile without GPU figures in one line, `bench plan` prints no
-99% error and writes no NaN."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid.cli import main
from hybrid.server.metrics import Metrics

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA prints")


@cpu_only
def test_generate_hybrid_status_line_cpu_only(capsys):
    assert main(["generate", "--gpu-experts", "4", "-n", "2"]) == 0
    err = capsys.readouterr().err
    status = [l for l in err.splitlines() if l.startswith("hybrid:")]
    assert status, err
    text = "\n".join(status)
    assert "VRAM" not in text.replace("no VRAM", "") and "torch on the CPU" in text and "no PCIe" in text
    assert "ktransformers-paper-amx's GPU and link figures (not this machine's)" in text


@cpu_only
def test_generate_json_names_the_gpu_role_cpu_only(capsys):
    assert main(["generate", "--gpu-experts", "4", "-n", "2", "--json"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["gpu_role"] == "torch-on-cpu" and "torch on the CPU" in res["cpu_only_note"]
    h = res["hybrid"]
    # no CUDA: no resident copies (they would be second copies in DRAM), and the log says so
    assert h["resident_experts_per_layer"] == [0] * len(h["resident_experts_per_layer"])
    assert "makes no resident experts here" in cap.err
    assert h["resident_memory"].startswith("dram") and "no pcie" in h["ship_lane"]
    assert "VRAM" not in cap.err.replace("no VRAM", "")
    assert main(["generate", "-n", "1", "--json"]) == 0  # no hybrid layer: the role, no hybrid block
    res = json.loads(capsys.readouterr().out)
    assert res["gpu_role"] == "torch-on-cpu" and "hybrid" not in res


@cpu_only
def test_chat_status_lines_cpu_only(capsys, monkeypatch):
    lines = iter(["hi", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    assert main(["chat", "--gpu-experts", "4", "-n", "2"]) == 0
    err = capsys.readouterr().err
    assert "chat ready (CPU-only: no CUDA device, the model runs as torch on the CPU)" in err
    assert "VRAM" not in err.replace("no VRAM", "") and "'resident' (torch on the CPU)" in err


def test_metrics_device_info_and_cpu_only_labels():
    split = {0: (3, 1)}
    cpu = Metrics(expert_split=lambda: split, device="cpu").render({})
    assert 'hybrid_device_info{device="cpu",gpu_role="torch-on-cpu"} 1' in cpu
    assert 'hybrid_cold_experts_total{layer="0",lane="shipped",device="cpu"} 1' in cpu
    assert 'hybrid_cold_expert_cpu_share{layer="0",device="cpu"} 0.75' in cpu
    assert "shipped to the GPU" not in cpu and "no GPU on this run" in cpu
    gpu = Metrics(expert_split=lambda: split, device="cuda").render({})  # a GPU run keeps its series as they were
    assert 'hybrid_device_info{device="cuda",gpu_role="cuda"} 1' in gpu
    assert 'hybrid_cold_experts_total{layer="0",lane="shipped"} 1' in gpu and 'device="cpu"' not in gpu
    assert "hybrid_device_info" not in Metrics(expert_split=lambda: split).render({})  # device unknown


def test_server_runtime_reports_its_device():
    from hybrid.server.adapter import Runtime

    class Eng:
        device = torch.device("cpu")

    rt = Runtime.__new__(Runtime)
    rt.engine = Eng()
    assert rt.device_type == "cpu"


def test_plan_prediction_names_its_profile_and_is_hypothetical_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--reserve", "0",
                 "--profile", "ktransformers-paper-amx"]) == 0
    out = capsys.readouterr().out
    assert "predicted on a hypothetical GPU: decode" in out
    assert "HYPOTHETICAL: this machine has no CUDA device" in out and "profile ktransformers-paper-amx's" in out
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--reserve", "0",
                 "--profile", "ktransformers-paper-amx", "--json"]) == 0
    basis = json.loads(capsys.readouterr().out)["prediction_basis"]
    assert basis["hypothetical"] and basis["profile"] == "ktransformers-paper-amx" and not basis["cuda_device_here"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # with a GPU: the profile's figures, said so
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--reserve", "0",
                 "--profile", "ktransformers-paper-amx"]) == 0
    out = capsys.readouterr().out
    assert "\npredicted: decode" in out and "assumes profile ktransformers-paper-amx's (built-in) GPU figures" in out


def test_plan_takes_a_profile_without_gpu_figures_and_says_what_it_borrows(tmp_path, capsys):
    import dataclasses

    from placement.hardware import BUILTIN_PROFILES

    hw = dataclasses.replace(BUILTIN_PROFILES["ktransformers-paper-amx"], name="cpu-box", gpu_flops=None,
                             hbm_bw=None, link_bw=None, alpha=None, source="calibrated")
    path = hw.save(tmp_path / "cpu.json")
    assert main(["plan", "--gpu-budget", "2GiB", "--cpu-budget", "4GiB", "--profile", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "cpu-box" in err and "ktransformers-paper-amx" in err  # whose GPU figures are borrowed
    assert "profile cpu-box+ktransformers-paper-amx" in out and "CPU calibrated without a GPU" in out


def test_plan_eval_cpu_only_reports_no_error_figures(tmp_path, monkeypatch, capsys):
    """CPU-only: no predicted-vs-measured errors (they compare the profile's GPU with torch on the CPU), and
    a shift run with fewer than 2 windows reports None, not NaN (strict JSON)."""
    from bench import plan_eval
    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = hf_config("demo")
    cfg.update(vocab_size=128, num_hidden_layers=2, eos_token_id=None, pad_token_id=None)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=2, std=0.1)
    assert plan_eval.main(["--model", str(ckpt), "--steps", "2", "--window", "8", "--max-context", "32", "--prompt",
                           "4", "--profile-tokens", "32", "--reserve", "0", "--cpu-isa", "ref", "--device", "cpu",
                           "--budgets", "20MiB", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    import re

    assert "-99%" not in out and "-100%" not in out and not re.search(r"\bnan\b", out, re.I)
    assert "CPU-only: no CUDA device" in out and "n/a (CPU-only)" in out

    def no_constants(name):
        raise AssertionError(f"{name} in plan_eval.json")

    res = json.loads((tmp_path / "out" / "plan_eval.json").read_text(), parse_constant=no_constants)
    assert res["comparable"] is False
    for b in res["budgets"]:
        assert b["error"] is None and b["prefill_error"] is None and b["error_on_seen_routing"] is None
        assert b["measured_decode_tokens_per_s"] > 0 and b["predicted_decode_tokens_per_s"] > 0
    assert res["shift"]["second_half_online_vs_static"] is None


def test_plan_eval_rel_error():
    from bench.plan_eval import finite, rel_error

    assert rel_error(50.0, 100.0, True) == -0.5
    assert rel_error(50.0, 100.0, False) is None and rel_error(1.0, 0.0, True) is None
    assert rel_error(float("nan"), 1.0, True) is None
    assert finite({"a": [float("nan"), 1.0], "b": float("inf")}) == {"a": [None, 1.0], "b": None}
