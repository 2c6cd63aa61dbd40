"""bench.prefill_profile on the built-in demo model (CPU): timed prefills per length, passes counted from the
session's prefill pass, the profiled run's busiest operators."""

import json

import pytest

from bench import prefill_profile


def test_prefill_profile_times_each_length_and_profiles_the_first(tmp_path, capsys):
    out = tmp_path / "pp.json"
    assert prefill_profile.main(["--tokens", "70,40", "--repeats", "2", "--rows", "4", "--out", str(out), "--",
                                 "--prefill-chunk", "32", "--max-context", "128"]) == 0
    d = json.loads(out.read_text())
    assert d["prefill_chunk"] == 32 and d["device"] == "cpu"
    assert [(r["tokens"], r["passes"]) for r in d["runs"]] == [(70, 3), (70, 3), (40, 2), (40, 2)]
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in d["runs"])
    assert d["profiled"]["tokens"] == 70
    top = d["profiled"]["top"]
    assert 0 < len(top) <= 4 and any(o["name"] == "aten::mm" for o in top)
    assert top == sorted(top, key=lambda o: -o["self_ms"])
    assert "prefill passes of 32 tokens" in capsys.readouterr().out


def test_prefill_profile_refuses_a_length_the_context_cannot_hold():
    with pytest.raises(SystemExit):
        prefill_profile.main(["--tokens", "200", "--", "--max-context", "128"])


def test_prefill_profile_needs_the_model_arguments():
    with pytest.raises(SystemExit):
        prefill_profile.main(["--tokens", "8"])
