"""`hybrid profile-routing`: counts per layer and per window, in the documented file format."""

import json

import numpy as np
import pytest
import torch

from hybrid.cli import main
from placement.routing_stats import load_stats


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_models import demo_shaped_checkpoint

    return demo_shaped_checkpoint(tmp_path_factory.mktemp("pr") / "ckpt", seed=6)


def test_counts_and_windows_are_exact(ckpt):
    """The recorder's counts equal the router's own choices, and windows cut exactly every N tokens."""
    from hybrid.commands.profile_routing import profile
    from hybrid.models import load_model
    from hybrid.runtime.engine import Engine

    model = load_model(ckpt, device="cpu", dtype=torch.float32, progress=False)
    eng = Engine(model, None, max_batch=1, max_context=64, eager=True)
    prompts = [list(range(3, 40)), list(range(50, 60)), list(range(100, 121))]  # 37 + 10 + 21 = 68 tokens
    layers, counts, tokens, series, dec, n_dec = profile(eng, prompts, window=16)
    assert layers == [0, 1] and tokens == 68 and n_dec == 0 and not dec.any()
    assert [n for n, _ in series] == [16, 16, 16, 16, 4]
    assert np.array_equal(sum(c for _, c in series), counts)
    assert (counts.sum(axis=1) == 68 * model.cfg.experts_per_token).all()
    # the same prompts routed by hand, layer 0: top-k of the router's scores of the MoE block's input
    seen = []

    def route(m, a):
        seen.append(torch.topk(torch.nn.functional.linear(a[0], m.router).float(), m.top_k, dim=-1).indices.reshape(-1))

    h = model.layers[0].moe.register_forward_pre_hook(route)
    try:
        for p in prompts:
            s = eng.allocate_slot()
            eng.prefill(s, p)
            eng.free_slot(s)
    finally:
        h.remove()
    assert np.array_equal(np.bincount(torch.cat(seen).numpy(), minlength=16), counts[0])
    # with 3 greedy decode tokens after each prompt: 9 more tokens, windows still exact
    prefill_counts = counts
    layers, counts, tokens, series, dec, n_dec = profile(eng, prompts, window=16, decode_tokens=3)
    assert tokens == 77 and [n for n, _ in series] == [16, 16, 16, 16, 13]
    assert (counts.sum(axis=1) == 77 * model.cfg.experts_per_token).all()
    # the decode steps' part, counted apart: 9 tokens, and what is left is exactly the prompts' routing
    assert n_dec == 9 and (dec.sum(axis=1) == 9 * model.cfg.experts_per_token).all()
    assert np.array_equal(counts - dec, prefill_counts)


def test_cli_writes_the_documented_format(ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('first prompt about printing presses\n\n{"prompt": "def f(x): return x * 2"}\nthird one\n')
    out = tmp_path / "stats.json"
    assert main(["profile-routing", "--model", str(ckpt), "--prompts", str(prompts), "--out", str(out),
                 "--window", "8", "--max-context", "64", "--decode-tokens", "2"]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "hybrid-routing-stats" and data["schema_version"] == 1
    assert data["num_experts"] == 16 and data["topk"] == 4 and data["window_tokens"] == 8
    assert data["source"]["prompt_count"] == 3 and data["source"]["prompts"] == str(prompts)
    assert data["source"]["decode_tokens_per_prompt"] == 2
    assert [x["layer"] for x in data["layers"]] == [0, 1]
    assert all(sum(x["counts"]) == data["tokens"] * 4 for x in data["layers"])
    assert data["decode_tokens"] == 3 * 2  # two per prompt, counted apart too
    assert all(sum(x["decode_counts"]) == data["decode_tokens"] * 4 for x in data["layers"])
    assert sum(w["tokens"] for w in data["series"]) == data["tokens"]
    stats = load_stats(out)  # what `hybrid plan --stats` reads
    assert stats.tokens == data["tokens"] and stats.decode_tokens == 6
    assert np.allclose(stats.decode_shares().sum(axis=1), 4) and np.allclose(stats.prefill_shares().sum(axis=1), 4)
    assert main(["plan", "--model", str(ckpt), "--stats", str(out), "--gpu-budget", "2GiB", "--cpu-budget", "1GiB",
                 "--profile", "ktransformers-paper-amx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["stats"]["kind"] == "measured"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["profile-routing", "--model", str(ckpt), "--prompts", str(empty)]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_shares_at_their_edges():
    """Rows of shares sum to K, also without data (uniform K/E); a run with no prompt tokens has the prefill share
    of all tokens; a layer may route exactly tokens x K, not one more."""
    from hybrid.errors import UsageError
    from placement.routing_stats import RoutingStats

    empty = RoutingStats(8, 2, (0, 1), np.zeros((2, 8), dtype=np.int64), 0)
    assert np.allclose(empty.shares(), 2 / 8) and np.allclose(empty.shares().sum(axis=1), 2)
    counts = np.array([[3, 1, 0, 0], [0, 2, 2, 0]])
    only_decode = RoutingStats(4, 2, (0, 1), counts, 2, decode_counts=counts, decode_tokens=2)
    assert np.array_equal(only_decode.prefill_shares(), only_decode.shares())
    assert np.array_equal(only_decode.decode_shares(), counts / 2)
    RoutingStats(4, 2, (0, 1), counts, 2)  # 4 = 2 tokens x top-2: full
    with pytest.raises(UsageError, match="more than tokens x topk"):
        RoutingStats(4, 2, (0, 1), counts + np.array([[1, 0, 0, 0], [0, 0, 0, 0]]), 2)
