"""bench.routing_realism's figures on hand-made routings: uniform-looking, sticky and skewed ones."""

from __future__ import annotations

import numpy as np

from bench.routing_realism import layer_figures, uniform_figures


def test_sticky_routing_is_fully_local():
    chosen = np.tile(np.array([[0, 1]]), (20, 1))  # the same two experts for every token
    f = layer_figures(chosen, num_experts=8)
    assert f["lag1"] == f["lag8"] == f["within8"] == 1.0 and f["reuse_median"] == 1.0
    assert f["max_over_mean"] == 4.0  # 2 of 8 experts take everything: 0.5 of the load vs a mean of 0.125
    assert f["top10_share"] == 0.5  # the top 10% of 8 experts is one expert


def test_rotating_routing_has_no_lag1_overlap_and_a_known_reuse_distance():
    chosen = np.array([[t % 4, 4 + t % 4] for t in range(40)])  # each expert every 4th token
    f = layer_figures(chosen, num_experts=8)
    assert f["lag1"] == 0.0 and f["reuse_median"] == 4.0
    assert f["lag8"] == 1.0 and f["within8"] == 1.0
    assert abs(f["entropy"] - 1.0) < 1e-12  # every expert equally loaded


def test_uniform_baseline():
    u = uniform_figures(16, 4)
    assert u["lag1"] == 0.25 and abs(u["within8"] - (1 - 0.75 ** 8)) < 1e-12


def test_top1_repeat_reads_the_first_ranked_expert_only():
    # the first-ranked expert repeats every other step; the second-ranked one never moves
    chosen = np.array([[t // 2 % 3, 7] for t in range(13)])
    f = layer_figures(chosen, num_experts=8)
    assert f["top1_repeat"] == 6 / 12 and f["lag1"] == (6 * 1.0 + 6 * 0.5) / 12
    assert uniform_figures(8, 2)["top1_repeat"] == 1 / 8


def test_early_guess_overlap_is_per_token_set_overlap():
    chosen = np.array([[0, 1], [2, 3], [4, 5]])
    guess = np.array([[1, 0], [2, 7], [6, 7]])  # order within a row does not matter
    assert layer_figures(chosen, 8, guess)["early_guess"] == (1.0 + 0.5 + 0.0) / 3
    assert layer_figures(chosen, 8)["early_guess"] is None and uniform_figures(8, 2)["early_guess"] == 0.25


def test_early_guess_of_a_model_is_exact_where_attention_adds_nothing():
    """The guess routes the stream the layer received; with every attention output projection zeroed the stream
    the router sees is that one, so the guess is the choice; with them in place the guess is not always it."""
    import torch

    from bench.routing_realism import record_routing
    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config

    raw = hf_config("demo", layers=2)
    model = init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=0, std=0.1)
    ids = torch.randint(0, model.cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    early: dict = {}
    chosen = record_routing(model, ids, 16, early=early)
    figures = [layer_figures(c, model.cfg.num_experts, g)["early_guess"] for c, g in zip(chosen, early["chosen"])]
    assert len(figures) == len(chosen) >= 2 and all(0 <= f < 1 for f in figures), figures
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.o_proj.weight.zero_()
    early = {}
    chosen = record_routing(model, ids, 16, early=early)
    assert all(np.array_equal(c, g) for c, g in zip(chosen, early["chosen"]))
    for layer in model.layers:  # the wrappers are gone: the classes' methods are back
        assert "add_norm" not in vars(layer.mlp_norm) and "_experts_out" not in vars(layer.moe)


def test_ahead_guess_of_a_model_is_exact_where_nothing_changes_the_stream_between_two_routers():
    """The ahead guess routes, with a layer's router, the experts' input of the MoE layer before it. Where that layer's
    experts add nothing, the next layer's attention adds nothing and its MLP norm is the earlier one's, the next
    router sees that input, so the guess is the choice; the first MoE layer has none; an untouched model's guess
    is not always right."""
    import torch

    from bench.routing_realism import record_routing
    from hybrid.models import build_empty, init_random_
    from hybrid.models.families import family_for
    from hybrid.models.presets import hf_config

    raw = hf_config("demo", layers=2)
    model = init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=1, std=0.1)
    ids = torch.randint(0, model.cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    ahead: dict = {}
    chosen = record_routing(model, ids, 16, ahead=ahead)
    assert len(chosen) == 2 and ahead["chosen"][0] is None
    first = layer_figures(chosen[1], model.cfg.num_experts, ahead=ahead["chosen"][1])["ahead_guess"]
    assert 0 <= first < 1 and layer_figures(chosen[0], 8)["ahead_guess"] is None
    a, b = model.layers
    with torch.no_grad():
        for name, p in a.moe.named_parameters():
            if name.startswith("experts."):
                p.zero_()
        b.attn.o_proj.weight.zero_()
        b.mlp_norm.weight.copy_(a.mlp_norm.weight)
    ahead = {}
    chosen = record_routing(model, ids, 16, ahead=ahead)
    assert np.array_equal(chosen[1], ahead["chosen"][1])
    assert layer_figures(chosen[1], model.cfg.num_experts, ahead=ahead["chosen"][1])["ahead_guess"] == 1.0
    assert "_experts_out" not in vars(a.moe) and "_experts_out" not in vars(b.moe)
