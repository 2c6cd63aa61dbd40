"""The engine thread on its own (no HTTP): chunked prefill interleaving, slot recycling, terminal events."""

import threading
import time

import pytest
import torch

from hybrid.server.adapter import Runtime
from hybrid.server.metrics import Metrics
from hybrid.server.scheduler import QueueFull, Scheduler, Sequence
from hybrid.server.schemas import SamplingParams
from hybrid.server.testing import fake_runtime

GREEDY = SamplingParams(temperature=0.0)


class Collector:
    """A sink that records events and signals when the sequence ends."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.kind in ("done", "error"):
            self.done.set()

    @property
    def text(self):
        return "".join(e.text for e in self.events if e.kind == "text")

    @property
    def terminal(self):
        return [e for e in self.events if e.kind in ("done", "error")]

    @property
    def kind(self):
        """The last event's kind ('done' or 'error' once the sequence ended)."""
        return self.events[-1].kind


def _seq(ids, max_tokens, params=GREEDY):
    c = Collector()
    return Sequence(list(ids), max_tokens, params, c), c


def _run(rt, seqs, chunk=64, max_queue=64, queued_first=False):
    """Run seqs to the end; queued_first: all are queued before the engine thread starts looking."""
    sched = Scheduler(rt, Metrics(), max_queue=max_queue, prefill_chunk=chunk)
    if not queued_first:
        sched.start()
    try:
        for s, _ in seqs:
            sched.submit([s])
        if queued_first:
            sched.start()
        for _, c in seqs:
            assert c.done.wait(20)
    finally:
        sched.stop()
    return sched


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    rt = fake_runtime(max_batch=4, max_context=2048)
    short, sc = _seq([5, 6, 7], 40)
    long_ids = [(i * 37) % 200 + 20 for i in range(1000)]  # no id 8 (= BEL, fails on purpose)
    long, lc = _seq(long_ids, 5)
    rt.engine.step_delay_s = 0.001
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=128)
    sched.start()
    try:
        sched.submit([short])
        while short.n_generated < 3:  # the short one is decoding when the long prompt arrives
            time.sleep(0.001)
        sched.submit([long])
        assert lc.done.wait(20) and sc.done.wait(20)
    finally:
        sched.stop()
    calls = rt.engine.calls
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill" and c[2][0] > 3]
    assert [calls[i][2] for i in chunks] == [(128,)] * 7 + [(104,)]  # fixed boundaries: multiples of 128
    short_slot = calls[0][1][0]  # the first prefill was the short prompt's
    for a, b in zip(chunks, chunks[1:]):  # the short sequence decodes between every two chunks
        assert any(c[0] == "decode" and short_slot in c[1] for c in calls[a + 1 : b]), calls[a : b + 1]
    # chunking does not change the result: same output as the long prompt alone
    alone, ac = _seq(long_ids, 5)
    _run(fake_runtime(max_batch=4, max_context=2048), [(alone, ac)], chunk=1000)
    assert ac.text == lc.text and lc.terminal[0].completion_tokens == 5


def test_slots_are_recycled_and_every_sequence_ends_once():
    rt = fake_runtime(max_batch=2, max_context=128)
    seqs = [_seq([i + 20, i + 21], 3 + i % 5) for i in range(12)]
    sched = _run(rt, seqs)
    for s, c in seqs:
        assert len(c.terminal) == 1 and c.terminal[0].kind == "done"
        assert c.terminal[0].finish_reason in ("stop", "length")
        assert c.events[-1].kind == "done"  # nothing after the terminal event
    assert rt.engine.max_rows_seen == 2 and rt.free_slots == 2
    assert sched.stats()["running"] == 0


def test_decode_failure_fails_running_sequences_and_engine_recovers():
    rt = fake_runtime(max_batch=2, max_context=128)
    rt.engine.fail_decode = True
    (a, ac), (b, bc) = _seq([3, 4], 10), _seq([5, 6], 10)
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=64)
    sched.start()
    try:
        sched.submit([a, b])
        assert ac.done.wait(10) and bc.done.wait(10)
        assert ac.terminal[0].kind == "error" and "injected decode failure" in ac.terminal[0].error
        assert rt.free_slots == 2
        rt.engine.fail_decode = False
        c, cc = _seq([10, 11], 4)
        sched.submit([c])
        assert cc.done.wait(10) and cc.terminal[0].kind == "done"
    finally:
        sched.stop()


def test_shutdown_fails_waiting_sequences_with_503():
    rt = fake_runtime(max_batch=1, max_context=128)
    rt.engine.gate.clear()  # the engine blocks in the first prefill
    seqs = [_seq([3, 4], 4) for _ in range(3)]
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=64)
    sched.start()
    for s, _ in seqs:
        sched.submit([s])
    while rt.free_slots:
        time.sleep(0.001)
    stopper = threading.Thread(target=sched.stop)
    stopper.start()
    rt.engine.gate.set()
    stopper.join(10)
    for _, c in seqs:
        assert c.done.wait(5) and len(c.terminal) == 1
    statuses = sorted(c.terminal[0].kind for _, c in seqs)
    assert statuses.count("error") >= 2  # the queued ones were told, not dropped
    assert all(c.terminal[0].status == 503 for _, c in seqs if c.terminal[0].kind == "error")


def test_cancelled_sequences_free_their_slots_at_the_next_step():
    rt = fake_runtime(max_batch=2, max_context=256)
    rt.engine.step_delay_s = 0.005
    (a, ac), (b, bc) = _seq([3, 4], 200), _seq([5, 6], 200)
    m = Metrics()
    sched = Scheduler(rt, m, max_queue=8, prefill_chunk=64)
    sched.start()
    try:
        sched.submit([a, b])
        while a.n_generated < 3 or b.n_generated < 3:
            time.sleep(0.001)
        sched.cancel([a])
        deadline = time.monotonic() + 5
        while rt.free_slots != 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert not b.finished and m.cancelled == 1 and ac.terminal == []
        sched.cancel([b])
        while rt.free_slots != 2:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        sched.stop()


def test_leaked_slots_are_reported_not_spun_on(caplog):
    rt = fake_runtime(max_batch=1, max_context=64)
    rt.allocate_slot()  # leak the only slot behind the scheduler's back
    s, c = _seq([3, 4], 4)
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=64)
    sched.start()
    try:
        sched.submit([s])
        time.sleep(0.3)
        assert any("stuck waiting" in r.message for r in caplog.records)
        assert len([r for r in caplog.records if "stuck waiting" in r.message]) <= 2  # backs off, no spin
        sched.cancel([s])  # a stuck request can still be cancelled
        deadline = time.monotonic() + 3
        while sched.stats()["waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        sched.stop()


def _solo_texts(prompts, max_tokens):
    out = []
    for ids in prompts:
        s, c = _seq(ids, max_tokens)
        _run(fake_runtime(max_batch=4, max_context=256), [(s, c)])
        out.append(c.text)
    return out


def test_burst_of_short_prompts_is_prefilled_in_one_padded_pass():
    rt = fake_runtime(max_batch=4, max_context=256)
    prompts = [[20 + i] * (5 + 3 * i) for i in range(6)]  # 5, 8, 11, ... tokens
    seqs = [_seq(ids, 6) for ids in prompts]
    _run(rt, seqs, chunk=64, max_queue=8, queued_first=True)  # all queued before the engine thread looks
    prefills = [c for c in rt.engine.calls if c[0] == "prefill"]
    # one pass for the four that get slots (padded 4 x 14 <= 64), the other two as slots free up
    assert prefills[0] == ("prefill", (0, 1, 2, 3), (5, 8, 11, 14))
    assert rt.engine.calls[1][0] == "decode"  # then decode, before the next admissions
    assert [c.text for _, c in seqs] == _solo_texts(prompts, 6)


def test_padded_size_of_a_prefill_pass_stays_within_the_chunk():
    rt = fake_runtime(max_batch=4, max_context=256)
    seqs = [_seq([30 + i] * 40, 3) for i in range(4)]
    _run(rt, seqs, chunk=100, max_queue=8, queued_first=True)
    prefills = [c[2] for c in rt.engine.calls if c[0] == "prefill"]
    assert prefills == [(40, 40), (40, 40)]  # 2 x 40 fits in 100, 3 x 40 does not


def test_a_prompt_that_breaks_a_batched_prefill_fails_alone():
    rt = fake_runtime(max_batch=4, max_context=256)
    prompts = [[40, 41, 42], [50, 8, 51], [60, 61]]  # token 8 = BEL: the fake engine raises on it
    seqs = [_seq(ids, 4) for ids in prompts]
    rt.engine.gate.clear()
    sched = Scheduler(rt, Metrics(), max_queue=8, prefill_chunk=64)
    sched.start()
    try:
        blocker, bc = _seq([70], 2)
        sched.submit([blocker])
        while rt.free_slots == 4:
            time.sleep(0.001)
        for s, _ in seqs:
            sched.submit([s])
        rt.engine.gate.set()
        for _, c in seqs + [(blocker, bc)]:
            assert c.done.wait(10)
    finally:
        sched.stop()
    kinds = [c.terminal[0].kind for _, c in seqs]
    assert kinds == ["done", "error", "done"]
    assert any(len(c[1]) == 3 for c in rt.engine.calls if c[0] == "prefill")  # it was tried batched
    assert rt.free_slots == 4
    # the retried prompts generate what they generate alone (the failed batch left no history behind)
    assert [seqs[0][1].text, seqs[2][1].text] == _solo_texts([prompts[0], prompts[2]], 4)


def test_without_batch_prefill_each_prompt_gets_its_own_pass():
    rt = fake_runtime(max_batch=4, max_context=256, batch_prefill="off")
    prompts = [[20 + i] * (5 + i) for i in range(3)] + [[50, 8, 51]]  # the last one fails (BEL)
    seqs = [_seq(ids, 4) for ids in prompts]
    _run(rt, seqs, chunk=64, max_queue=8, queued_first=True)
    prefills = [c for c in rt.engine.calls if c[0] == "prefill"]
    assert [c[2] for c in prefills] == [(5,), (6,), (7,), (3,)]
    assert rt.engine.calls[len(prefills)][0] == "decode"  # all four in one pass, then decode
    assert [c.terminal[0].kind for _, c in seqs] == ["done"] * 3 + ["error"]
    assert [c.text for _, c in seqs[:3]] == _solo_texts(prompts[:3], 4)


def test_a_pass_may_fill_the_prefill_budget_exactly():
    rt = fake_runtime(max_batch=4, max_context=256)
    seqs = [_seq([30 + i] * 25, 3) for i in range(4)]
    _run(rt, seqs, chunk=100, max_queue=8, queued_first=True)
    prefills = [c[2] for c in rt.engine.calls if c[0] == "prefill"]
    assert prefills == [(25, 25, 25, 25)]  # 4 x 25 = 100: one pass, not 3 + 1


def test_the_queue_takes_exactly_max_queue_sequences():
    sched = Scheduler(fake_runtime(max_batch=1, max_context=64), Metrics(), max_queue=3, prefill_chunk=64)
    sched.submit([_seq([5], 2)[0], _seq([6], 2)[0]])  # not started: nothing leaves the queue
    with pytest.raises(QueueFull):
        sched.submit([_seq([7], 2)[0], _seq([8], 2)[0]])  # 4 > 3: all or none
    sched.submit([_seq([9], 2)[0]])  # 3 == max_queue: still taken
    with pytest.raises(QueueFull):
        sched.submit([_seq([10], 2)[0]])
    sched.stop()


def test_a_sequence_stops_with_length_when_it_reaches_max_context():
    rt = fake_runtime(max_batch=1, max_context=16)
    s, c = _seq([40] * 10, 100)
    _run(rt, [(s, c)])
    done = c.terminal[0]
    assert c.kind == "done" and done.finish_reason == "length" and s.n_generated == 6  # 10 + 6 = 16 positions


# Finish reasons, pinned exactly: EOS ends a sequence with "stop" at the step it is sampled, and the
# max-context limit ends it with "length" at prompt + completion == max_context. The engine here plays a
# fixed script of tokens per prompt (one-hot logits, greedy sampling), and its tokenizer renders EOS as
# visible text, so a leaked EOS shows up in the output instead of vanishing.

EOS = 1
VOCAB = 64


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


def _run_script(engine, prompts_and_limits, params=GREEDY):
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

        results.append((Sequence(list(prompt), max_tokens, params, sink), events, done))
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
    (t1, e1), (t2, e2), (t3, e3) = _run_script(eng, [([2], 8), ([3], 8), ([4], 5)])
    assert (t1, e1.finish_reason, e1.completion_tokens) == ("bc", "stop", 3)  # EOS counted, never shown
    assert (t2, e2.finish_reason, e2.completion_tokens) == ("", "stop", 1)
    assert (t3, e3.finish_reason, e3.completion_tokens) == ("defgh", "length", 5)
    assert "<EOS>" not in t1 + t2 + t3


def test_eos_flushes_text_held_back_for_a_stop_string():
    # stop "end": "e" could start it, so it is held back; EOS arrives next and ends the sequence, and the "e"
    # is streamed then (it was output, and no stop string completed)
    scripts = {2: [25, 26, 6, EOS] + list(range(5, 25))}  # "x" "y" "e" EOS
    ((text, end),) = _run_script(ScriptEngine(scripts, max_context=64), [([2], 10)],
                                 SamplingParams(temperature=0.0, stop=("end",)))
    assert (text, end.finish_reason, end.completion_tokens) == ("xye", "stop", 4)


def test_max_context_stop_is_exact():
    # prompt of 3 + completion must fit max_context = 8: exactly 5 tokens, "length", no KV overflow;
    # a second sequence whose max_tokens lands on the same step ends "length" too, at the same count
    script = list(range(5, 30))
    eng = ScriptEngine({2: script, 3: script}, max_context=8)
    (t1, e1), (t2, e2) = _run_script(eng, [([2, 3, 4], 100), ([3, 4, 5], 5)])
    assert (e1.finish_reason, e1.completion_tokens, e1.prompt_tokens) == ("length", 5, 3)
    assert t1 == VisibleEosTokenizer().decode(script[:5])
    assert (e2.finish_reason, e2.completion_tokens) == ("length", 5)
    # one more: a prompt of max_context - 1 gets exactly one token (sampled after prefill, no decode step)
    eng = ScriptEngine({2: script}, max_context=8)
    ((t, e),) = _run_script(eng, [([2] * 7, 100)])
    assert (e.finish_reason, e.completion_tokens, t) == ("length", 1, "d")
    assert eng.decode_steps == 0
