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
