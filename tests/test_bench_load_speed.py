"""bench.load_speed's command line: the arguments after `--` reach every `hybrid generate` process it starts."""

from __future__ import annotations

import pytest

from bench import load_speed


class Started(Exception):
    pass


def test_run_once_puts_generate_args_on_generates_command(monkeypatch, tmp_path):
    seen = {}

    def popen(cmd, **kw):
        seen["cmd"] = cmd
        raise Started

    monkeypatch.setattr(load_speed.subprocess, "Popen", popen)
    with pytest.raises(Started):
        load_speed.run_once(tmp_path, "int4", True, {}, generate_args=("--gpu-dtype", "int4", "--gpu-budget", "24GiB"))
    cmd = seen["cmd"]
    assert cmd[cmd.index("--cpu-dtype") + 1] == "int4" and "--no-cache" in cmd
    i = cmd.index("--gpu-dtype")
    assert cmd[i:i + 4] == ["--gpu-dtype", "int4", "--gpu-budget", "24GiB"]


def test_main_splits_its_own_options_from_generates(monkeypatch, tmp_path):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    calls = []

    def run_once(model, dtype, no_cache, env, prompt_words=0, decode=1, generate_args=()):
        calls.append((dtype, no_cache, generate_args))
        return dict(load_s=1.0, start_s=2.0, read_s=0.5, convert_s=0.4, upload_s=0.1, line="loaded", process_cpu_s=1.0,
                    peak_anon_gib=1.5, settled_anon_gib=1.0, peak_hwm_gib=2.0, settled_rss_gib=1.2)

    monkeypatch.setattr(load_speed, "run_once", run_once)
    out = tmp_path / "rows.json"
    assert load_speed.main(["--model", str(model), "--cpu-dtype", "int8", "--runs", "convert", "--scratch",
                            str(tmp_path / "s"), "--json", str(out), "--", "--gpu-dtype", "int4", "--max-context",
                            "32768"]) == 0
    assert calls == [("int8", True, ("--gpu-dtype", "int4", "--max-context", "32768"))]
    import json

    assert json.loads(out.read_text())["generate_args"] == ["--gpu-dtype", "int4", "--max-context", "32768"]
