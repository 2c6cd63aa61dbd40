"""ModelConfig's checks at their edges (hybrid.models.config): the largest allowed values pass, one past them
fails. Each case re-runs the checks through dataclasses.replace on the demo preset's parsed config."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybrid.models.families import family_for
from hybrid.models.presets import hf_config


@pytest.fixture(scope="module")
def cfg():
    raw = hf_config("demo", layers=2)
    return family_for(raw).parse_config(raw)


def test_every_expert_per_token_is_allowed(cfg):
    assert replace(cfg, experts_per_token=cfg.num_experts).experts_per_token == cfg.num_experts
    with pytest.raises(ValueError, match="experts_per_token"):
        replace(cfg, experts_per_token=cfg.num_experts + 1)


def test_two_rotary_dims_are_enough(cfg):
    half = 2 / cfg.head_dim  # head_dim x factor = 2 rotated dims
    assert replace(cfg, rope=replace(cfg.rope, partial_rotary_factor=half)).rope.partial_rotary_factor == half
    with pytest.raises(ValueError, match="rotary dims"):
        replace(cfg, rope=replace(cfg.rope, partial_rotary_factor=1 / cfg.head_dim))  # 1 dim


def test_a_one_token_sliding_window_is_allowed(cfg):
    assert replace(cfg, sliding_window=1).sliding_window == 1
    with pytest.raises(ValueError, match="sliding_window"):
        replace(cfg, sliding_window=0)


def test_groups_that_exactly_hold_the_experts_per_token(cfg):
    """Group-limited routing: topk_group groups of num_experts / n_group experts must hold experts_per_token;
    exactly as many is enough."""
    n_group = cfg.num_experts // 2
    per_group = cfg.num_experts // n_group
    k = cfg.experts_per_token
    topk = -(-k // per_group)  # the fewest groups that hold k
    sig = replace(cfg.router, kind="sigmoid", n_group=n_group, topk_group=topk)
    exact = replace(cfg, experts_per_token=topk * per_group, router=sig)
    assert exact.router.topk_group * per_group == exact.experts_per_token
    with pytest.raises(ValueError, match="cannot hold"):
        replace(cfg, experts_per_token=topk * per_group + 1, router=sig)
