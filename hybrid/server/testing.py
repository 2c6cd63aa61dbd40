"""A tiny deterministic stand-in for the model runtime, for server tests that must not depend on a model.

Tokens are bytes (id = byte + 1; 0 is EOS). The "model" scores the next token from a hash of the slot's
last three tokens, so outputs are deterministic, differ by prompt, and cannot depend on batch
composition — any difference between batched and solo output is then a scheduler bug. It asserts the
KV-slot protocol (no prefill into a busy slot, no decode of an empty one) and can be slowed, paused or
made to fail for limit tests.
"""

from __future__ import annotations

import threading
import time
import zlib

import torch

from hybrid.server import sampling

VOCAB = 257


class FakeRuntime:
    def __init__(self, max_batch: int = 4, max_context: int = 256, step_delay_s: float = 0.0,
                 eos_bias: float = 0.0):
        self.model_id = "fake"
        self.max_batch = max_batch
        self.max_context = max_context
        self.vocab_size = VOCAB
        self.eos_token_ids = frozenset({0})
        self.step_delay_s = step_delay_s
        self.eos_bias = eos_bias  # > 0 makes sequences end by EOS sooner
        self.gate = threading.Event()  # cleared = every model call blocks (fills the queue on purpose)
        self.gate.set()
        self.fail_on = "\x07"  # a prompt containing this byte makes prefill raise
        self.history: dict[int, list[int]] = {}  # slot -> token ids in its KV cache
        self.max_rows_seen = 0

    # tokenizer
    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")

    # model
    def _logits(self, ids: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(bytes(str(ids[-3:]), "ascii")))
        logits = torch.randn(VOCAB, generator=g)  # [V]
        logits[128:] -= 4.0  # mostly ASCII, so texts are readable; some multi-byte chars still happen
        logits[1:33] -= 4.0  # few control characters
        logits[0] += self.eos_bias
        return logits

    def _wait(self):
        self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        assert slot not in self.history, f"prefill into busy slot {slot}"
        assert 0 <= slot < self.max_batch and 0 < len(ids) < self.max_context
        self._wait()
        if (self.fail_on.encode()[0] + 1) in ids:
            raise RuntimeError("injected prefill failure")
        self.history[slot] = list(ids)
        return self._logits(ids)  # [V]

    def decode_step(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        assert len(set(slots)) == len(slots), "a slot twice in one batch"
        self._wait()
        self.max_rows_seen = max(self.max_rows_seen, len(slots))
        rows = []
        for slot, tok in zip(slots, tokens):
            h = self.history[slot]  # KeyError = decode of a released slot
            assert len(h) < self.max_context, "KV cache overflow"
            h.append(tok)
            rows.append(self._logits(h))
        return torch.stack(rows)  # [B, V]

    def release(self, slot: int) -> None:
        self.history.pop(slot, None)

    make_generator = staticmethod(sampling.make_generator)
    sample = staticmethod(sampling.sample)
