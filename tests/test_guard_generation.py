"""The engine / CLI generate loop (hybrid.runtime.generation): the earliest stop string in the text wins,
whatever order the strings are given in, and the loop stops exactly when the KV slot is full (issue 16:
only the server's text stream tested stop-string precedence).

The engine plays a fixed script of tokens (one-hot logits, greedy); its tokenizer has multi-character
tokens, so one token can complete two stop strings at once, and then only precedence decides the cut.
"""

import pytest
import torch

from hybrid.runtime.generation import run_generation
from hybrid.runtime.sampling import SamplingParams

EOS = 1
PIECES = {2: "x", 3: "ABC", 4: "y", 5: "zz", 6: "A", 7: "BC"}  # id -> text
VOCAB = 8


class PieceTokenizer:
    def encode(self, text):
        raise AssertionError("prompts are token ids here")

    def decode(self, ids):
        return "".join(PIECES.get(i, "") for i in ids)


class ScriptEngine:
    """Generates `script` token by token whatever it is fed; the KV slot's bound is the engine's own."""

    def __init__(self, script, max_context=64):
        self.script, self.max_context = script, max_context
        self.tokenizer = PieceTokenizer()
        self.device = torch.device("cpu")
        self.lengths = [0]
        self._free = [0]
        self.prompt_len = 0

    def default_stop_ids(self):
        return [EOS]

    def allocate_slot(self):
        self.lengths[0] = 0
        return self._free.pop()

    def free_slot(self, s):
        self._free.append(s)

    @property
    def free_slots(self):
        return len(self._free)

    def _logits(self):
        out = torch.zeros(1, VOCAB)
        out[0, self.script[self.lengths[0] - self.prompt_len]] = 10.0
        return out

    def prefill(self, slot, ids):
        assert self.lengths[slot] + len(ids) <= self.max_context
        self.lengths[slot] += len(ids)
        self.prompt_len = self.lengths[slot]
        return self._logits()[0]

    def decode_step(self, slots, tokens):
        # as Engine.decode_step: a token at position max_context has no KV column
        if self.lengths[slots[0]] >= self.max_context:
            raise ValueError(f"a slot reached max_context {self.max_context}")
        self.lengths[slots[0]] += 1
        return self._logits()


def _generate(script, stops, max_new=20, max_context=64, prompt=(2, 2)):
    streamed = []
    (c,) = run_generation(ScriptEngine(script, max_context), [list(prompt)], max_new, SamplingParams(), None,
                          stops, lambda i, tok, delta: streamed.append(delta))
    assert "".join(streamed) == c.text  # the stream's deltas add up to the final text
    return c


@pytest.mark.parametrize("stops", [("BC", "AB"), ("AB", "BC"), ("C", "AB", "xAB")])
def test_earliest_stop_string_wins(stops):
    # one token "ABC" after "x" completes every stop string at once; the earliest one, "AB" at index 1
    # (or "xAB" at 0 in the last case), cuts the text
    c = _generate([2, 3, 4, 4, 4, 4], stops)
    cut = min("xABC".find(s) for s in stops)
    assert (c.text, c.finish_reason, c.token_ids) == ("xABC"[:cut], "stop", [2, 3])


def test_stop_string_across_tokens_and_later_tokens_unread():
    # "A" then "BC": "AB" completes on the second token, before "BC" does on the same token
    c = _generate([6, 7, 2, 2, 2], ("BC", "AB"))
    assert (c.text, c.finish_reason, c.token_ids) == ("", "stop", [6, 7])
    c = _generate([4, 5, 6, 7, 4], ("zzA", "yzz"))  # "yzz" is complete first, one token earlier
    assert (c.text, c.finish_reason, c.token_ids) == ("", "stop", [4, 5])


def test_stops_exactly_when_the_slot_is_full():
    # prompt 3, max_context 8: tokens at positions 3..7 are fed back and the one sampled from position 7
    # needs no KV column, so exactly 8 - 3 + 1 = 6 tokens, "length"; one more would need position 8
    c = _generate([4] * 20, (), max_new=50, max_context=8, prompt=(2, 2, 2))
    assert (len(c.token_ids), c.finish_reason, c.text) == (6, "length", "y" * 6)
    c = _generate([4] * 20, (), max_new=6, max_context=64, prompt=(2, 2, 2))  # max_new_tokens exact too
    assert (len(c.token_ids), c.finish_reason) == (6, "length")
    c = _generate([4, EOS, 4, 4], (), max_new=50)
    assert (c.token_ids, c.finish_reason, c.text) == ([4], "stop", "y")
