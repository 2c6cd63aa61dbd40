"""`hybrid --help` and `hybrid <cmd> --help` answer without importing torch (seconds on a small machine), and the
long steps are never silent: progress bars are whole lines in a log, `hybrid profile-routing` counts its prompts,
`hybrid bench crossover` numbers its points and says why a column is empty."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from hybrid.cli import COMMANDS, main

HELP_WITHOUT_TORCH = list(COMMANDS)

PROBE = """
import contextlib, io, json, sys
from hybrid.cli import main
seen = {}
for argv in [["--help"]] + [[c, "--help"] for c in sys.argv[1:]]:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    seen[" ".join(argv)] = sorted(m for m in ("torch", "numba", "hybrid.runtime") if m in sys.modules)
print(json.dumps(seen))
"""


def test_help_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", PROBE, *HELP_WITHOUT_TORCH], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen.pop("--help") == []  # the top level: not even numba
    # hybrid.runtime's package imports its modules lazily, so its config (the flags' defaults) comes without torch
    assert {k: v for k, v in seen.items() if "torch" in v} == {}
    assert len(seen) == len(HELP_WITHOUT_TORCH)


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)
    assert "price one expert on the CPU path vs the ship-weights path" in out  # cost's docstring summary
    with pytest.raises(SystemExit):
        main(["bogus"])  # a mistyped command is told the choices, which the summaries alone provide
    assert "invalid choice: 'bogus' (choose from 'cost', 'generate'" in capsys.readouterr().err


def test_max_context_default_is_the_runtime_one():
    from hybrid.loading.parse import MAX_CONTEXT_DEFAULT
    from hybrid.runtime.config import RuntimeConfig

    assert MAX_CONTEXT_DEFAULT == RuntimeConfig.max_context


def test_line_bar_writes_whole_lines():
    import time

    from hybrid.loading.progress import LineBar, line_bars_when_redirected, progress_bar

    out = io.StringIO()
    bar = progress_bar(total=20, desc="packing", file=out, mininterval=0)
    assert isinstance(bar, LineBar)
    for _ in range(20):
        time.sleep(0.001)
        bar.update(1)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert lines[0].startswith("packing:   0% 0/20") and lines[-1].startswith("packing: 100% 20/20")
    assert 2 <= len(lines) <= 12 and len(set(lines)) == len(lines)  # at most one a tenth, the last once
    import tqdm

    before = tqdm.tqdm
    with line_bars_when_redirected():  # pytest's stderr is not a terminal
        assert tqdm.tqdm is LineBar
    assert tqdm.tqdm is before


def test_profile_routing_counts_its_prompts(tmp_path, capsys):
    from hybrid.runtime.demo import build_tokenizer
    from loader_cases import write_tiny

    model = write_tiny(tmp_path / "m")
    build_tokenizer(model, vocab_size=300)
    capsys.readouterr()
    assert main(["profile-routing", "--model", str(model), "--gpu-experts", "0", "--decode-tokens", "1",
                 "--profile", "ktransformers-paper-amx", "--out", str(tmp_path / "s.json")]) == 0
    err = capsys.readouterr().err
    assert "profiling routing:   0% 0/10" in err and "profiling routing: 100% 10/10" in err


def test_crossover_numbers_its_points_and_says_why_columns_are_empty(monkeypatch, capsys):
    from hybrid.commands import bench

    class Progress:
        step = None

        def __call__(self, line):
            self.line = line

    table, progress = io.StringIO(), Progress()
    log = bench.sweep_log(progress, [1, 64, 4096], table)
    log("# header")
    assert progress.step == "point m=1 (1/3)"  # what the heartbeat names while the first point runs
    log("  m=    1  T_C     1.000 ms")
    assert progress.line.endswith("[1/3]") and progress.step == "point m=64 (2/3)"
    assert "[1/3]" not in table.getvalue()  # the table file keeps the sweep's own lines
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    bench.say_cpu_only(None)
    bench.say_cpu_only(object())
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: no CUDA device: T_G (ship weights to the GPU) is not measured, nor predicted")
    assert "its prediction is the profile's GPU figures (a hypothetical GPU)" in out[1]


def test_kernel_build_is_announced_when_it_will_compile(tmp_path, capsys):
    """pip builds the CPU kernels once (about a minute of compiling, its output hidden): setup.py's build step says
    so in one line when a library is out of date, and says nothing when every library is newer than its sources."""
    import importlib.util
    from pathlib import Path

    from setuptools import Distribution, Extension

    spec = importlib.util.spec_from_file_location("hybrid_setup", Path(__file__).resolve().parents[1] / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # not __main__: defines the build step without running setup()
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    ext = Extension("cpu_kernels._k", [str(src)])
    cmd = setup_py.LoudBuildExt(Distribution({"ext_modules": [ext]}))
    cmd.initialize_options()
    cmd.build_lib = str(tmp_path / "build")
    cmd.finalize_options()
    assert cmd.stale(ext)  # nothing built yet
    target = Path(cmd.get_ext_fullpath(ext.name))
    target.parent.mkdir(parents=True)
    target.write_bytes(b"")
    import os
    import time

    os.utime(target, (time.time() + 10, time.time() + 10))
    assert not cmd.stale(ext)
    setup_py.announce_build()
    assert capsys.readouterr().out.strip() == setup_py.BUILDING
