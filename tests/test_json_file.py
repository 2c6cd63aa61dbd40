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
