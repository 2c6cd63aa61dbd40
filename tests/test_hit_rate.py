"""bench.hit_rate on a tiny Qwen3-MoE trained here (bench.train_small, the offline stdlib corpus): the planner's
resident hit rate, predicted from routing statistics of training text, is what held-out prompts measure (decode
and prefill, within 15% relative), beats the uniform share (a trained model routes skewed), and the measured
prefill counts are the router's own choices (bench.routing_realism records them by another path)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("transformers")

from bench import corpus as corpus_mod  # noqa: E402
from bench.hit_rate import (check_heldout, cut_prompts, hit_rates, measure, parse_budgets, relative_error,  # noqa: E402
                            run as hit_rate_run)
from bench.train_small import SIZES, run as train_run  # noqa: E402
from hybrid.errors import UsageError  # noqa: E402

BOUND = 0.15
TINY = replace(SIZES["tiny"], steps=200, eval_tokens=1024)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_mod.write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib", "stdlib")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-tiny")
    report = train_run("qwen3_moe", out, TINY, corpus, "cpu", seed=0, log=lambda *_: None)
    assert report["heldout_perplexity"] < 0.5 * report["unigram_perplexity"]  # it has learned something
    return str(out)


@pytest.fixture(scope="module")
def report(trained, corpus, tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model's steps gain nothing from a second thread, and wait on it when busy
    try:
        return hit_rate_run(trained, corpus, [("share", 0.25)], profile_prompts=48, heldout_prompts=24,
                            prompt_tokens=64, decode_tokens=32, model_flags=["--device", "cpu"],
                            workdir=tmp_path_factory.mktemp("hit-rate"))
    finally:
        torch.set_num_threads(threads)


def test_prediction_matches_held_out_routing_and_beats_uniform(report):
    (row,) = report["budgets"]
    print(row)
    assert row["residents"] == row["residents_asked"] == 8 and row["uniform"] == 0.25  # 4 of 16 in each of 2 layers
    for part in ("decode", "prefill"):
        predicted, measured = row["predicted"][part], row["measured"][part]
        assert 0 < predicted <= 1 and 0 < measured <= 1, (part, row)
        assert predicted > row["uniform"] + 0.1, (part, row)  # the statistics matter
        assert relative_error(predicted, measured) == row["relative_error"][part] < BOUND, (part, row)
    assert report["profile"]["decode_tokens"] == 48 * 32 and report["heldout"]["decode_tokens"] == 24 * 32


def test_measured_prefill_counts_are_the_routers_choices(trained, corpus):
    """measure()'s prompt counts (profile-routing's hooks on the executor) equal a histogram of the expert ids that
    bench.routing_realism.record_routing sees the router return, teacher-forcing the same prompts."""
    import argparse

    from bench.hit_rate import cli_args, corpus_texts
    from bench.routing_realism import record_routing
    from hybrid.loading.session import open_session

    args = cli_args("profile-routing", ["--model", trained, "--device", "cpu", "--max-context", "160"])
    assert isinstance(args, argparse.Namespace)
    args.eager = True
    session = open_session(args, log=lambda _m: None)
    prompts = cut_prompts(corpus_texts(corpus)[1], session.tokenizer, 4, 48)
    measured = measure(session, prompts, decode_tokens=8)
    E = session.engine.model.cfg.num_experts
    for text, (prefill, decode) in zip(prompts, measured):
        ids = session.tokenizer.encode(text)
        chosen = record_routing(session.engine.model, ids, window=len(ids))
        assert np.array_equal(prefill, np.stack([np.bincount(c.ravel(), minlength=E) for c in chosen]))
        assert (decode.sum(axis=1) == 8 * session.engine.model.cfg.experts_per_token).all()


def test_hit_rates_count_resident_pairs_per_layer_and_pooled():
    counts = np.array([[6, 2, 2, 0], [1, 1, 1, 1]])
    resident = np.array([[True, False, False, True], [False, True, True, False]])
    overall, layers = hit_rates(counts, resident)
    assert layers == [0.6, 0.5] and overall == pytest.approx(8 / 14)
    assert hit_rates(np.zeros((1, 4)), resident[:1]) == (None, [None])
    assert relative_error(0.5, 0.4) == pytest.approx(0.25) and relative_error(0.5, 0.0) is None


def test_prompts_are_evenly_spaced_cuts_of_the_text(trained):
    from hybrid.runtime.tokenizer import Tokenizer

    tok = Tokenizer(trained)
    text = " ".join(f"w{i}" for i in range(400))
    ids = tok.encode(text, add_special_tokens=False)
    prompts = cut_prompts(text, tok, 3, 10)
    assert prompts[0] == tok.decode(ids[:10], skip_special_tokens=False)
    assert prompts[-1] == tok.decode(ids[-10:], skip_special_tokens=False)
    assert len(set(prompts)) == 3
    with pytest.raises(UsageError, match="fewer than one prompt"):
        cut_prompts("w1 w2", tok, 3, 10)


def test_bad_budgets_and_a_foreign_corpus_are_one_line_errors(trained, tmp_path):
    assert parse_budgets("0.125,0.5", None) == [("share", 0.125), ("share", 0.5)]
    assert parse_budgets(None, "1GiB,2GiB") == [("gpu-budget", "1GiB"), ("gpu-budget", "2GiB")]
    for bad in ("0", "1.5", "x"):
        with pytest.raises(UsageError, match="--resident-shares"):
            parse_budgets(bad, None)
    with pytest.raises(UsageError, match="as a size"):
        parse_budgets(None, "12XB")
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"source": "stdlib", "heldout": ["argparse"]}')
    with pytest.raises(UsageError, match="not the ones"):
        check_heldout(trained, other)


def test_resident_trained_runs_both_models_and_plans_the_share(trained, corpus, tmp_path):
    """bench.resident_trained without llama-bench: ours at every-expert-in-DRAM and at the planned quarter, on the
    trained model and on its random-weight copy (same config and tokenizer, other weights)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from bench import resident_trained

    copy = resident_trained.write_random_copy(trained, tmp_path / "random", seed=1)
    assert json.loads((copy / "config.json").read_text())["moe_intermediate_size"] == TINY.expert_ffn
    assert (copy / "tokenizer.json").read_bytes() == (Path(trained) / "tokenizer.json").read_bytes()
    ours, theirs = load_file(next(copy.glob("*.safetensors"))), load_file(f"{trained}/model.safetensors")
    assert ours.keys() == theirs.keys()
    name = next(k for k in ours if ".experts." in k)
    assert not ours[name].equal(theirs[name])  # drawn, not copied
    out = tmp_path / "rows.json"
    assert resident_trained.main(["--model", trained, "--corpus", str(corpus), "--prompts", "2", "--prompt-tokens",
                                  "32", "--decode-tokens", "4", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["label"] == "trained" and "llama" not in row and row["plan"]["residents_asked"] == 8
    for key in ("none", "share"):
        assert row["ours"][key]["tok_s"] > 0 and len(row["ours"][key]["per_prompt"]) == 2
    assert row["ours"]["none"]["flags"] == ["--gpu-experts", "0"] and row["ours"]["share"]["flags"][0] == "--plan"
