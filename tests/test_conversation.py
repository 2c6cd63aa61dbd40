"""Multi-turn generation on a kept KV slot: only the new part of each prompt is prefilled, same tokens."""

import pytest
import torch

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine, SamplingParams
from hybrid.runtime.generation import Conversation

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    raw = hf_config("demo")
    cfg = family_for(raw).parse_config(raw)
    # float64: reusing a prefix and prefilling from scratch round differently in float32, and a random
    # router's near-ties would then flip experts; in float64 any difference is a real cache bug
    return init_random_(build_empty(cfg, "cpu", torch.float64), seed=5, std=0.1)


def test_second_turn_reuses_the_held_prefix_and_matches_a_fresh_run(model):
    eng = Engine(model, None, max_batch=1, max_context=256, eager=True)
    conv = Conversation.open(eng)
    turn1 = [5, 9, 200, 17, 3, 88, 41]
    out1 = eng.generate([turn1], max_new_tokens=6, sampling=GREEDY, stop_token_ids=[], conversation=conv)[0]
    assert conv.held == (turn1 + out1.token_ids)[: len(turn1) + 5]  # the last token was never fed back
    assert eng.free_slots == 0  # the conversation keeps its slot
    turn2 = turn1 + out1.token_ids + [7, 7, 120]
    before = eng.stats.prefill_tokens
    out2 = eng.generate([turn2], max_new_tokens=8, sampling=GREEDY, stop_token_ids=[], conversation=conv)[0]
    assert eng.stats.prefill_tokens - before == len(turn2) - len(turn1) - 5  # only what the slot lacked

    fresh = Engine(model, None, max_batch=1, max_context=256, eager=True)
    ref = fresh.generate([turn2], max_new_tokens=8, sampling=GREEDY, stop_token_ids=[])[0]
    assert out2.token_ids == ref.token_ids
    conv.close(eng)
    assert eng.free_slots == 1


def test_a_diverging_prompt_cuts_back_to_the_common_prefix(model):
    eng = Engine(model, None, max_batch=1, max_context=256, eager=True)
    conv = Conversation.open(eng)
    eng.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=3, sampling=GREEDY, stop_token_ids=[], conversation=conv)
    other = [1, 2, 3, 90, 91]  # edits the history after three tokens
    before = eng.stats.prefill_tokens
    out = eng.generate([other], max_new_tokens=5, sampling=GREEDY, stop_token_ids=[], conversation=conv)[0]
    assert eng.stats.prefill_tokens - before == 2
    ref = Engine(model, None, max_batch=1, max_context=256, eager=True).generate(
        [other], max_new_tokens=5, sampling=GREEDY, stop_token_ids=[])[0]
    assert out.token_ids == ref.token_ids
    # the same prompt again still prefills one token (its logits are needed)
    before = eng.stats.prefill_tokens
    eng.generate([conv.held[:4]], max_new_tokens=1, sampling=GREEDY, stop_token_ids=[], conversation=conv)
    assert eng.stats.prefill_tokens - before == 1


def test_conversation_takes_one_prompt(model):
    eng = Engine(model, None, max_batch=2, max_context=64, eager=True)
    with pytest.raises(ValueError, match="exactly one prompt"):
        eng.generate([[1], [2]], conversation=Conversation.open(eng))


def test_chat_cli_reuses_the_conversation(tmp_path, capsys, monkeypatch):
    import re

    from cpu_kernels import knobs
    from hybrid.cli import main

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path))
    knobs.reset()
    lines = iter(["hi", "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    assert main(["chat", "-n", "4"]) == 0
    reused = [int(n) for n in re.findall(r"\((\d+) reused from the last turn\)", capsys.readouterr().err)]
    assert len(reused) == 2 and reused[0] == 0 and reused[1] > 0
