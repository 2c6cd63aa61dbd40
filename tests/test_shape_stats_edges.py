"""The cost model's expert shape and the routing statistics at their edges: every expert per token and a
recorded run of exactly MAX_TOKENS are allowed, one past either is refused."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.errors import UsageError
from placement.cost_model import ExpertShape, expected_active_experts
from placement.routing_stats import MAX_TOKENS, RoutingStats


def test_every_expert_per_token_is_a_shape():
    assert ExpertShape("s", hidden=8, intermediate=4, num_experts=4, topk=4).topk == 4
    with pytest.raises(UsageError, match="topk 5 > num_experts 4"):
        ExpertShape("s", hidden=8, intermediate=4, num_experts=4, topk=5)
    assert expected_active_experts(4, 4, 3) == 4.0  # every token touches every expert
    with pytest.raises(UsageError, match="topk <= experts"):
        expected_active_experts(4, 5, 3)


def stats(topk=2, tokens=10, E=4):
    return RoutingStats(num_experts=E, topk=topk, layers=(0,), counts=np.zeros((1, E), dtype=np.int64), tokens=tokens)


def test_routing_stats_take_every_expert_per_token_and_max_tokens():
    assert stats(topk=4).topk == 4
    with pytest.raises(UsageError, match="topk"):
        stats(topk=5)
    assert stats(tokens=MAX_TOKENS).tokens == MAX_TOKENS
    with pytest.raises(UsageError, match="not a recorded run"):
        stats(tokens=MAX_TOKENS + 1)
