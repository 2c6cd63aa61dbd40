"""bench.decode_context on the built-in demo model (CPU): a timed decode per context length, the profiled steps'
busiest operators per step, and the context checked against --max-context before any load."""

import json

import pytest

from bench import decode_context


def test_decode_context_times_each_length(tmp_path, capsys):
    out = tmp_path / "dc.json"
    assert decode_context.main(["--contexts", "20,90", "--steps", "3", "--warm", "1", "--profiled", "2", "--rows", "4",
                                "--out", str(out), "--", "--max-context", "128"]) == 0
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["graphs"] is False
    assert [r["context"] for r in d["rows"]] == [20, 90]
    for r in d["rows"]:
        assert r["steps"] == 3 and r["ms_per_step"] > 0
        assert abs(r["tokens_per_s"] - 1e3 / r["ms_per_step"]) <= 0.01 * r["tokens_per_s"]
        top = r["top"]
        assert 0 < len(top) <= 4 and top == sorted(top, key=lambda o: -o["self_ms"])
        assert any(o["name"] == "aten::mm" or o["name"] == "aten::addmm" for o in top)
    assert "no graphs (eager)" in capsys.readouterr().out


def test_decode_context_refuses_a_context_the_cache_cannot_hold():
    with pytest.raises(SystemExit):
        decode_context.main(["--contexts", "120", "--steps", "8", "--", "--max-context", "128"])


def test_decode_context_needs_the_model_arguments():
    with pytest.raises(SystemExit):
        decode_context.main(["--contexts", "8"])
