"""The project's JSON files (profiles, plans, routing statistics): a write that fails leaves the previous file
as it was and says so in one line."""

from __future__ import annotations

import errno
import json
import os

import pytest

from hybrid.errors import UsageError
from placement.json_file import read_json, write_json


def _no_space(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    write_json(path, {"version": 1})
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(UsageError, match="cannot write .*plan.json: No space left on device"):
        write_json(path, {"version": 2, "layers": list(range(1000))})
    assert read_json(path, "--plan") == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_folder_that_cannot_exist_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UsageError, match="cannot write"):
        write_json(tmp_path / "file" / "profile.json", {})


def test_plan_out_on_a_full_disk_keeps_the_previous_plan(tmp_path, monkeypatch, capsys):
    from hybrid.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "qwen3-30b-a3b", "--gpu-budget", "80GiB", "--cpu-budget", "200GiB", "--profile",
            "ktransformers-paper-amx", "--numa-threads", "2", "--out", str(out)]
    assert main(argv) == 0
    before = out.read_text()
    json.loads(before)
    capsys.readouterr()
    monkeypatch.setattr(os, "fsync", _no_space)
    assert main(argv + ["--max-context", "8192"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0]
    assert out.read_text() == before


def test_checkpoint_writer_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A full disk while the shards are written: no checkpoint at the path (or the earlier one, intact), and no
    hidden partial folder left behind."""
    import errno

    import safetensors.torch

    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    raw = hf_config("demo", layers=2)
    out = tmp_path / "ckpt"
    write_random_checkpoint(out, raw, seed=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = safetensors.torch.save_file, []

    def full_disk(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError):
        write_random_checkpoint(out, raw, seed=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    calls.clear()
    with pytest.raises(OSError):
        write_random_checkpoint(tmp_path / "fresh", raw, seed=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    write_random_checkpoint(out, raw, seed=3)  # a finished rewrite replaces the old one whole
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_writer_progress_moves_per_tensor_and_expert(tmp_path, monkeypatch):
    """The writer's bar advances once per tensor and once per MXFP4 expert (an MXFP4 stack takes minutes on a CPU:
    a bar per shard sat still that long), and ends at its total."""
    import tqdm

    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    bars = []
    real = tqdm.tqdm

    class Recorder(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.updates = []
            bars.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    monkeypatch.setattr(tqdm, "tqdm", Recorder)
    raw = hf_config("gpt-oss-120b", layers=1)
    raw.update(hidden_size=64, intermediate_size=64, num_local_experts=4, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, vocab_size=128)
    write_random_checkpoint(tmp_path / "mx", raw, mxfp4=True, progress=True)
    bar = bars[-1]
    assert bar.n == bar.total and sum(bar.updates) == bar.total
    names = json.loads((tmp_path / "mx" / "model.safetensors.index.json").read_text())["weight_map"]
    mx = [n for n in names if n.endswith(("_blocks", "_scales"))]
    assert len(mx) == 4  # gate_up and down, blocks and scales
    assert bar.total == len(names) - len(mx) + 2 * 4  # one step per other tensor, per expert of the two stacks
