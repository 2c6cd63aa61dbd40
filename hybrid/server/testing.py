"""A tiny deterministic stand-in for the engine and tokenizer, for server tests that need no model or
HTTP.

`fake_runtime()` wraps them in the real adapter (hybrid.server.adapter.Runtime), so the tests cover the
adapter and the runtime's sampling too. Tokens are bytes (id = byte + 1; 0 is EOS). The "model" scores
the next token from a hash of the slot's last three tokens, so outputs are deterministic, differ by
prompt, and cannot depend on batch composition: any difference between batched and solo output is a
server bug. It asserts the KV-slot protocol (no prefill into a free slot, no decode of a freed one)
and can be slowed, paused (`gate`) or made to fail (a prompt containing BEL) for limit tests.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from types import SimpleNamespace

import torch

from hybrid.server.adapter import Runtime

VOCAB = 257
FAIL_BYTE = 0x07


class EngineCrash(BaseException):
    """A fatal bug in the engine loop (not an Exception: per-request handlers must not catch it)."""


class FakeTokenizer:
    """Bytes as tokens. Its "chat template" writes `<role>content\\n` per message, then `<assistant>`;
    template inputs (tools, switches) come first as JSON lines, an assistant's calls as hermes (after its
    content, `null` when it has none)
    `<tool_call>{...}</tool_call>` (so the server reads this fake's calls in that format; this attribute is
    what the server looks at, not code that runs), a tool result under `<tool>`."""

    max_token_chars = 1  # a token is one byte of one character
    chat_template = "{# fake: <role>content, tools as JSON, calls as <tool_call>{...}</tool_call> #}"

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        head = "".join(f"<{k}>{json.dumps(v, sort_keys=True)}\n" for k, v in sorted(template_kwargs.items()))
        return self.encode(head + "".join(_fake_turn(m) for m in messages) + "<assistant>")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")

    def grammar_tokenizer(self):
        """llguidance's view of this vocabulary (constrained decoding): id 0 is EOS, id b + 1 the byte b."""
        import llguidance

        class Bytes:
            eos_token_id, bos_token_id, special_token_ids = 0, None, [0]
            tokens = [b"<eos>"] + [bytes([b]) for b in range(256)]

            def __call__(self, data: bytes) -> list[int]:
                return [b + 1 for b in data]

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def _fake_turn(m: dict) -> str:
    """One message as the fake template writes it (a plain message: `<role>content\\n`, as always)."""
    calls = "".join(f"<tool_call>{json.dumps(c['function'], sort_keys=True)}</tool_call>"
                    for c in m.get("tool_calls") or ())
    think = f"<think>{m['reasoning_content']}</think>" if m.get("reasoning_content") else ""
    content = "null" if m.get("content") is None else m["content"]  # (as templates that test for none tell them apart)
    return f"<{m['role']}>{think}{content}{calls}\n"


class FakeEngine:
    def __init__(self, max_batch: int = 4, max_context: int = 256, step_delay_s: float = 0.0):
        self.max_batch, self.max_context = max_batch, max_context
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB))
        self.device = torch.device("cpu")
        self.step_delay_s = step_delay_s
        self.gate = threading.Event()  # cleared = every model call blocks (to fill the queue on purpose)
        self.gate.set()
        self.history: dict[int, list[int]] = {}  # allocated slot -> token ids in its KV cache
        self.lengths = [0] * max_batch  # as Engine.lengths: kept by prefill/decode_step, not by forward
        self._free = list(range(max_batch))[::-1]
        self.max_rows_seen = 0
        # the schedule: ("prefill", slots, chunk sizes) / ("decode", slots)
        self.calls: list[tuple] = []
        self.fail_decode = False  # every decode step raises while set
        self.crash = False  # the next slot allocation kills the engine thread

    def default_stop_ids(self) -> list[int]:
        return [0]

    def allocate_slot(self) -> int:
        if self.crash:
            raise EngineCrash("injected engine crash")
        slot = self._free.pop()  # IndexError when none is free: the scheduler must check first
        self.history[slot] = []
        self.lengths[slot] = 0
        return slot

    def free_slot(self, slot: int) -> None:
        assert slot in self.history, f"slot {slot} freed twice"
        del self.history[slot]
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _logits(self, ids: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(bytes(str(ids[-3:]), "ascii")))
        logits = torch.randn(VOCAB, generator=g)  # [V]
        logits[128:] -= 4.0  # mostly ASCII so texts are readable; multi-byte characters still happen
        logits[1:33] -= 4.0  # few control characters
        return logits

    def _wait(self):
        self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def _append(self, slot: int, ids: list[int]) -> torch.Tensor:
        h = self.history[slot]  # KeyError = prefill into a free slot
        assert 0 < len(ids) and len(h) + len(ids) <= self.max_context
        if FAIL_BYTE + 1 in ids:
            raise RuntimeError("injected prefill failure")
        h.extend(ids)
        return self._logits(h)  # [V]

    def prefill(self, slot: int, ids: list[int]) -> torch.Tensor:
        """Appends to what the slot holds (chunked prefill), like hybrid.runtime.Engine.prefill."""
        self._wait()
        self.calls.append(("prefill", (slot,), (len(ids),)))
        out = self._append(slot, ids)
        self.lengths[slot] += len(ids)
        return out

    def forward(self, input_ids, positions, slots, last_only: bool = False) -> torch.Tensor:
        """Engine.forward: right-padded rows (position -1), lengths NOT advanced; last_only only."""
        assert last_only
        self._wait()
        rows, sizes = [], []
        for ids, pos, slot in zip(input_ids.tolist(), positions.tolist(), slots.tolist()):
            n = sum(p >= 0 for p in pos)
            start = len(self.history[slot])
            assert self.lengths[slot] == start, "lengths not advanced after a batched prefill"
            assert pos[:n] == list(range(start, start + n)) and all(p == -1 for p in pos[n:]), pos
            sizes.append(n)
            rows.append((slot, ids[:n]))
        self.calls.append(("prefill", tuple(s for s, _ in rows), tuple(sizes)))
        if any(FAIL_BYTE + 1 in ids for _, ids in rows):  # the whole batch fails, no row's history moves
            raise RuntimeError("injected prefill failure")
        return torch.stack([self._append(slot, ids) for slot, ids in rows])  # [B, V]

    def decode_step(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        assert len(set(slots)) == len(slots), "a slot twice in one batch"
        self._wait()
        self.calls.append(("decode", tuple(slots)))
        if self.fail_decode:
            raise RuntimeError("injected decode failure")
        self.max_rows_seen = max(self.max_rows_seen, len(slots))
        rows = []
        for slot, tok in zip(slots, tokens):
            h = self.history[slot]  # KeyError = decode of a freed slot
            assert len(h) < self.max_context, "KV cache overflow"
            h.append(tok)
            self.lengths[slot] += 1
            rows.append(self._logits(h))
        return torch.stack(rows)  # [B, V]


def fake_runtime(max_batch: int = 4, max_context: int = 256, step_delay_s: float = 0.0,
                 batch_prefill: str = "on") -> Runtime:
    return Runtime(FakeEngine(max_batch, max_context, step_delay_s), FakeTokenizer(), batch_prefill)
