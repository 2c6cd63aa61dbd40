"""bench.serve_features run as a user runs it (`python -m bench.serve_features`, its own `hybrid serve` child) on the
demo checkpoint on the CPU, small sizes: the JSON has its figures, the long prompt sent again is answered the same
and from the prefix cache (per /metrics), the cache-off server reuses nothing and answers the same, constrained
outputs parse and follow the schema; bad arguments are one line and exit status 2.

The server runs in float64: a reused prefix and a prefill from scratch run different matmul shapes, which in float32
may round differently and flip the random model's near-ties (tests/test_prefix_cache.py); in float64 a different
output would be a cache bug. Timings are printed, not asserted (a shared 2-core runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_features import SETTINGS, output_problem, schema_problem

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240  # two server starts (torch import, model load)
DECODE_TOKENS, STRING_CHARS = 48, 24  # the demo's tokens are short: the schema's skeleton alone takes ~25


def bench(*args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYBRID_NO_PROGRESS="1")
    return subprocess.run([sys.executable, "-m", "bench.serve_features", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-features") / "features.json"
    run = bench("--prefix-tokens", "300", "--max-tokens", "4", "--decode-tokens", str(DECODE_TOKENS),
                "--string-chars", str(STRING_CHARS), "--batches", "1,2", "--rounds", "1", "--compare-off",
                "--server-arg=--dtype=float64", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(run.stdout)
    return json.loads(out.read_text())


def test_the_long_prompt_sent_again_is_answered_the_same_from_the_prefix_cache(result):
    p = result["prefix_cache"]
    assert abs(p["prompt_tokens"] - 300) <= 6 and abs(p["warmup_prompt_tokens"] - 300) <= 6
    first, second, third = p["requests"]
    assert all(r["status"] == 200 and r["ttft_s"] > 0 and r["prompt_tokens"] == p["prompt_tokens"]
               and r["completion_tokens"] == 4 for r in p["requests"])
    assert p["identical_text"] and p["identical_tokens"] and p["max_logprob_diff"] == 0.0
    assert len(first["tokens"]) == 4 and first["text"]
    # /metrics: the first request (after a warm-up of another prompt) misses, the next two reuse all but the last token
    reused = [r["metrics_delta"]["hybrid_prefix_cache_tokens_reused"] for r in p["requests"]]
    assert reused == [0, p["prompt_tokens"] - 1, p["prompt_tokens"] - 1]
    assert [r["metrics_delta"]["hybrid_prefix_cache_hits"] for r in p["requests"]] == [0, 1, 1]
    assert p["metrics_after"]["hybrid_prefix_cache_hits"] == p["metrics_before"]["hybrid_prefix_cache_hits"] + 2
    assert p["metrics_delta"]["hybrid_prefix_cache_lookups"] == 3
    assert p["ttft_ratio_1_2"] == round(first["ttft_s"] / second["ttft_s"], 2)
    assert p["ttft_ratio_1_3"] == round(first["ttft_s"] / third["ttft_s"], 2)
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens the cache served, as /metrics counted them
    assert [r["cached_tokens"] for r in p["requests"]] == reused


def test_the_cache_off_server_reuses_nothing_and_answers_the_same(result):
    off = result["prefix_cache_off"]
    assert off["same_text_as_cache_on"] and off["identical_text"]
    assert [r["metrics_delta"]["hybrid_prefix_cache_hits"] for r in off["requests"]] == [0, 0, 0]
    assert off["metrics_delta"]["hybrid_prefix_cache_tokens_reused"] == 0
    assert [r["cached_tokens"] for r in off["requests"]] == [0, 0, 0]
    assert off["requests"][0]["text"] == result["prefix_cache"]["requests"][0]["text"]


def test_constrained_outputs_parse_and_rates_and_costs_are_reported(result):
    c = result["constrained"]
    assert set(c["batches"]) == {"1", "2"} and c["failures"] == 0
    for batch, per in c["batches"].items():
        for s in SETTINGS:
            rows = per[s]["requests"]
            assert len(rows) == int(batch) and all(r["status"] == 200 for r in rows)
            assert per[s]["decode_tok_s_median"] > 0
            for r in rows:  # tokens after the first over the time after the first (figures rounded to 0.1 ms)
                rate = (r["completion_tokens"] - 1) / (r["latency_s"] - r["ttft_s"])
                assert r["decode_tok_s"] == pytest.approx(rate, rel=5e-3)
            assert all(1 < t <= DECODE_TOKENS for t in per[s]["completion_tokens"])
        assert per["free"]["completion_tokens"] == [DECODE_TOKENS] * int(batch)  # the random model never stops
        # json_schema: the string's maxLength closes the object within the budget; every output parses and validates
        schema = per["json_schema"]
        assert schema["valid"] == int(batch) and schema["truncated"] == 0 and schema["failures"] == 0
        for r in schema["requests"]:
            obj = json.loads(r["text"])
            assert schema_problem(obj, STRING_CHARS) is None and r["finish_reason"] == "stop"
        # json_object: the random model fills its first key until max_tokens; finished ones would be checked
        obj = per["json_object"]
        assert obj["valid"] + obj["truncated"] == int(batch) and obj["failures"] == 0
        assert all(r["text"].startswith("{") for r in obj["requests"])
        for s in ("json_schema", "json_object"):
            assert per["cost"][s] == round(1 - per[s]["decode_tok_s_median"] / per["free"]["decode_tok_s_median"], 4)
    assert c["schema"]["properties"]["answer"]["maxLength"] == STRING_CHARS


def test_the_schema_check_catches_each_broken_field():
    ok = {"answer": "a b", "confidence": 7, "done": False}
    assert schema_problem(ok, 3) is None
    assert "answer" in schema_problem(dict(ok, answer="abcd"), 3)
    assert "confidence" in schema_problem(dict(ok, confidence=True), 3)
    assert "confidence" in schema_problem(dict(ok, confidence=101), 3)
    assert "done" in schema_problem(dict(ok, done=0), 3)
    assert "keys" in schema_problem(dict(ok, extra=1), 3)
    assert "keys" in schema_problem({"answer": "", "done": True}, 3)
    assert "not JSON" in output_problem("json_schema", '{"answer": "x"', 3)
    assert output_problem("json_object", '{"k": [1, 2]}', 3) is None
    assert "not an object" in output_problem("json_object", "[1]", 3)


@pytest.mark.parametrize("args, words", [
    (["--batches", "1,x"], "--batches"),
    (["--batches", "0,8"], "--batches"),
    (["--prefix-tokens", "8"], "--prefix-tokens"),
    (["--decode-tokens", "1"], "--decode-tokens"),
    (["--rounds", "0"], "--rounds"),
    (["--max-context", "512"], "--max-context"),
])
def test_a_bad_argument_is_one_line_and_exit_status_2(args, words):
    run = bench(*args, timeout=60)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("bench.serve_features: error: ") and words in lines[0]
    assert "spawned" not in run.stdout  # refused before any server started
