"""Server finish reasons, pinned exactly (issue 16): EOS ends a sequence with "stop" at the step it is
sampled, and the max-context limit ends it with "length" at prompt + completion == max_context.

The engine here plays a fixed script of tokens per prompt (one-hot logits, greedy sampling), and its
tokenizer renders EOS as visible text, so a leaked EOS shows up in the output instead of vanishing.
"""

import threading

import torch

from hybrid.server.adapter import Runtime
from hybrid.server.metrics import Metrics
from hybrid.server.scheduler import Scheduler, Sequence
from hybrid.server.schemas import SamplingParams

EOS = 1
VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


class VisibleEosTokenizer:
    """id 1 = EOS, printed as "<EOS>"; ids >= 2 are letters ("a" = 2)."""

    def encode(self, text):
        return [ord(c) - ord("a") + 2 for c in text]

    def encode_chat(self, messages):
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids):
        return "".join("<EOS>" if i == EOS else chr(ord("a") + i - 2) for i in ids)


class ScriptEngine:
    """Generates script[prompt[0]] token by token, whatever it is fed; checks the KV slot never overflows."""

    def __init__(self, scripts, max_context, max_batch=2):
        self.scripts, self.max_context, self.max_batch = scripts, max_context, max_batch
        self.model = type("M", (), {"cfg": type("C", (), {"vocab_size": VOCAB})})()
        self.device = torch.device("cpu")
        self.hist, self.prompt_len = {}, {}
        self._free = list(range(max_batch))
        self.lengths = [0] * max_batch
        self.decode_steps = 0

    def default_stop_ids(self):
        return [EOS]

    def allocate_slot(self):
        s = self._free.pop()
        self.hist[s], self.lengths[s] = [], 0
        return s

    def free_slot(self, s):
        del self.hist[s]
        self._free.append(s)

    @property
    def free_slots(self):
        return len(self._free)

    def _next(self, s):
        h = self.hist[s]
        assert len(h) <= self.max_context, "KV cache overflow"
        script = self.scripts[h[0]]
        i = len(h) - self.prompt_len[s]  # tokens fed back so far = index of the next scripted token
        logits = torch.zeros(VOCAB)
        logits[script[i]] = 10.0
        return logits

    def prefill(self, s, ids):
        self.hist[s].extend(ids)
        self.prompt_len[s] = len(self.hist[s])
        self.lengths[s] = len(self.hist[s])
        return self._next(s)

    def decode_step(self, slots, tokens):
        self.decode_steps += 1
        out = []
        for s, t in zip(slots, tokens):
            self.hist[s].append(t)
            self.lengths[s] += 1
            out.append(self._next(s))
        return torch.stack(out)


def _run(engine, prompts_and_limits):
    """-> [(text, done event)] per sequence, run to the end through the real scheduler."""
    rt = Runtime(engine, VisibleEosTokenizer(), batch_prefill="off")
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=64)
    results = []
    for prompt, max_tokens in prompts_and_limits:
        events, done = [], threading.Event()

        def sink(ev, events=events, done=done):
            events.append(ev)
            if ev.kind in ("done", "error"):
                done.set()

        results.append((Sequence(list(prompt), max_tokens, GREEDY, sink), events, done))
    sched.start()
    try:
        for seq, _, _ in results:
            sched.submit([seq])
        for _, _, done in results:
            assert done.wait(20)
    finally:
        sched.stop()
    out = []
    for _, events, _ in results:
        (end,) = [e for e in events if e.kind in ("done", "error")]
        assert end.kind == "done", end.error
        out.append(("".join(e.text for e in events if e.kind == "text"), end))
    return out


def test_eos_stops_exactly_when_sampled():
    # prompt "a" -> b c EOS d e ...; prompt "b" -> EOS first (sampled right after prefill);
    # prompt "c" -> never EOS: must run to max_tokens with "length"
    tail = list(range(5, 25))  # longer than any max_tokens below, so a leaked EOS runs on visibly
    scripts = {2: [3, 4, EOS] + tail, 3: [EOS] + tail, 4: tail}
    eng = ScriptEngine(scripts, max_context=64)
    (t1, e1), (t2, e2), (t3, e3) = _run(eng, [([2], 8), ([3], 8), ([4], 5)])
    assert (t1, e1.finish_reason, e1.completion_tokens) == ("bc", "stop", 3)  # EOS counted, never shown
    assert (t2, e2.finish_reason, e2.completion_tokens) == ("", "stop", 1)
    assert (t3, e3.finish_reason, e3.completion_tokens) == ("defgh", "length", 5)
    assert "<EOS>" not in t1 + t2 + t3


def test_max_context_stop_is_exact():
    # prompt of 3 + completion must fit max_context = 8: exactly 5 tokens, "length", no KV overflow;
    # a second sequence whose max_tokens lands on the same step ends "length" too, at the same count
    script = list(range(5, 30))
    eng = ScriptEngine({2: script, 3: script}, max_context=8)
    (t1, e1), (t2, e2) = _run(eng, [([2, 3, 4], 100), ([3, 4, 5], 5)])
    assert (e1.finish_reason, e1.completion_tokens, e1.prompt_tokens) == ("length", 5, 3)
    assert t1 == VisibleEosTokenizer().decode(script[:5])
    assert (e2.finish_reason, e2.completion_tokens) == ("length", 5)
    # one more: a prompt of max_context - 1 gets exactly one token (sampled after prefill, no decode step)
    eng = ScriptEngine({2: script}, max_context=8)
    ((t, e),) = _run(eng, [([2] * 7, 100)])
    assert (e.finish_reason, e.completion_tokens, t) == ("length", 1, "d")
    assert eng.decode_steps == 0
