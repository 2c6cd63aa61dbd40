"""`hybrid calibrate` numbers its steps ("step 3/7: ...") from the probes it will run, and counts the
token counts of each CPU curve ("[m 2/4]"), so a newcomer sees how far it is; what it measures is unchanged."""

from __future__ import annotations

import re

import torch

from hybrid.cli import main
from hybrid.commands.calibrate import runtime_probes


def _steps(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"\] step (\d+)/(\d+): ", text)]


def test_calibrate_numbers_its_steps(tmp_path, capsys):
    assert main(["calibrate", "--hidden", "256", "--intermediate", "128", "--experts", "2", "--backends", "torch",
                 "--out", str(tmp_path / "p.json")]) == 0
    text = capsys.readouterr().out
    steps = _steps(text)
    n = steps[0][1]
    assert steps == [(i, n) for i in range(1, n + 1)]  # consecutive, the total known from the start
    assert "step 1/" in text and "DRAM read bandwidth" in text.split("step 1/")[1].splitlines()[0]
    assert [f"[m {i}/4]" in text for i in range(1, 5)] == [True] * 4  # quick: m = 1, 4, 16, 64


def test_calibrate_step_total_covers_the_gpu_probes(monkeypatch):
    """With a GPU the link, HBM/GEMM, fixed-cost and graph-floor probes are steps too (faked here)."""
    from placement import calibrate as cal
    from placement import measure
    from placement.cost_model import ExpertShape

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(measure, "measure_dram_read", lambda n: (1e10, "fake"))
    monkeypatch.setattr(measure, "measure_cpu_curve", lambda shape, b, ms, progress=None, **kw:
                        [progress(f"{b} m={m}") or [m, 1e9] for m in ms])
    monkeypatch.setattr(measure, "measure_link", lambda sizes: {"h2d_alpha": 1e-5, "h2d_bw": 2e10,
                                                                "d2h_alpha": 1e-5, "d2h_bw": 2e10})
    monkeypatch.setattr(measure, "measure_hbm", lambda n: 1e12)
    monkeypatch.setattr(measure, "measure_gpu_flops", lambda shape, m: 1e14)
    import hybrid.offload.overheads as ov

    def fail(*a, **k):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(ov, "measure_overheads", fail)
    monkeypatch.setattr(ov, "measure_graph_layer_floor", fail)
    lines = []
    cal.calibrate(ExpertShape("t", hidden=256, intermediate=128, num_experts=8, topk=2), quick=True,
                  backends=["torch"], dram_bytes=1 << 20, progress=lines.append, probes=runtime_probes())
    steps = [l for l in lines if l.startswith("step ")]
    n = 1 + (len(cal.KNEE_DTYPES) if cal._has_amx() else 0) + 1 + cal.LOAD_STEPS + cal.GPU_STEPS
    assert [s.split(":")[0] for s in steps] == [f"step {i}/{n}" for i in range(1, n + 1)]
    assert steps[-1].startswith(f"step {n}/{n}: latency floor of graph decode")


def test_calibrate_fits_the_profile_from_what_it_measured(monkeypatch):
    """The profile carries the measurements (faked here, every one distinct): the CPU peak is the best point of
    the curve wherever it lies, the link bandwidth the host->device one (weights travel that way), alpha the mean
    of the two directions' (activations go both ways), and the fixed costs as measured."""
    from placement import calibrate as cal
    from placement import measure
    from placement.cost_model import ExpertShape
    import hybrid.offload.overheads as ov

    monkeypatch.setattr(cal, "_has_amx", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(measure, "measure_dram_read", lambda n: (1.5e10, "fake"))
    flops = {1: 1e9, 4: 7e9, 16: 3e9, 64: 2e9}  # peaks at m = 4, not at the last m
    monkeypatch.setattr(measure, "measure_cpu_curve", lambda shape, b, ms, **kw: [[m, flops[m]] for m in ms])
    monkeypatch.setattr(measure, "measure_link", lambda sizes: {"h2d_alpha": 1e-5, "h2d_bw": 2e10,
                                                                "d2h_alpha": 3e-5, "d2h_bw": 5e10})
    monkeypatch.setattr(measure, "measure_hbm", lambda n: 4e12)
    monkeypatch.setattr(measure, "measure_gpu_flops", lambda shape, m: 6e14)
    fixed = dict(layer_overhead=1e-4, cpu_lane_overhead=2e-4, cpu_lane_start=3e-4, ship_chunk_overhead=4e-4,
                 ship_expert_overhead=5e-4)
    monkeypatch.setattr(ov, "measure_overheads", lambda probe: dict(fixed))
    monkeypatch.setattr(ov, "measure_graph_layer_floor", lambda hidden: {"graph_layer_floor": 6e-5})
    prof, raw = cal.calibrate(ExpertShape("t", hidden=256, intermediate=128, num_experts=8, topk=2), quick=True,
                              backends=["torch"], dram_bytes=1 << 20, progress=lambda line: None,
                              probes=runtime_probes())
    assert prof.cpu_flops == {"torch": 7e9} and prof.dram_bw == 1.5e10
    assert (prof.link_bw, prof.hbm_bw, prof.gpu_flops) == (2e10, 4e12, 6e14)
    assert prof.alpha == (1e-5 + 3e-5) / 2
    assert {k: getattr(prof, k) for k in fixed} == fixed and prof.graph_layer_floor == 6e-5
