"""Engine.generate never leaks a KV slot: however a call ends (KeyboardInterrupt or an error mid-generation, a
stream callback that raises to stop early, a prompt refused for a bad token id) the next call finds every slot
free and generates what a fresh engine does. A leaked slot used to make the next call spin forever waiting
for it, so every call that could hang runs under `bounded`."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine, SamplingParams
from hybrid.runtime.generation import Conversation

GREEDY = SamplingParams(temperature=0)
HANG_S = 30  # far beyond a few tokens of a one-layer model; only a regression waits this long
PROMPTS = [[5, 9, 200, 17, 3], [88, 41, 7, 7, 120, 64]]


@pytest.fixture(scope="module")
def model():
    raw = hf_config("demo", layers=1)
    cfg = family_for(raw).parse_config(raw)
    # float64: a conversation's reused prefix and a fresh prefill must give the same greedy tokens
    return init_random_(build_empty(cfg, "cpu", torch.float64), seed=3, std=0.1)


def new_engine(model, max_batch=2):
    return Engine(model, None, max_batch=max_batch, max_context=64, eager=True)


def bounded(engine, fn, *args, **kw):
    """fn(*args, **kw) in a thread, failing the test instead of hanging it if the call never returns; a stuck
    call is then released (every slot marked free) so it stops burning a core for the rest of the session."""
    box = {}

    def call():
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(HANG_S)
    if worker.is_alive():
        engine._free = list(range(engine.max_batch))
        worker.join(5)
        pytest.fail(f"the call did not return within {HANG_S} s (waiting for a KV slot that was never freed?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def greedy(engine, prompts, n=6, **kw):
    return [c.token_ids for c in bounded(engine, engine.generate, prompts, max_new_tokens=n, sampling=GREEDY,
                                         stop_token_ids=[], **kw)]


@contextlib.contextmanager
def failing(engine, method, nth, exc):
    """engine.<method>, except that its nth call raises exc instead of running (an instance attribute shadowing
    the method, removed on exit)."""
    real, calls = getattr(engine, method), [0]

    def wrapped(*args, **kw):
        calls[0] += 1
        if calls[0] == nth:
            raise exc
        return real(*args, **kw)

    setattr(engine, method, wrapped)
    try:
        yield
    finally:
        delattr(engine, method)


@pytest.mark.parametrize("where", ["decode_step", "prefill"])
def test_keyboard_interrupt_mid_generation_frees_every_slot(model, where):
    eng = new_engine(model)
    with failing(eng, where, 2, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        greedy(eng, PROMPTS)
    assert eng.free_slots == eng.max_batch
    assert greedy(eng, PROMPTS) == greedy(new_engine(model), PROMPTS)
    assert eng.free_slots == eng.max_batch


def test_an_error_while_more_prompts_wait_than_slots_frees_them_all(model):
    eng = new_engine(model)
    prompts = PROMPTS + [[1, 2, 3], [4, 5, 6, 7]]  # two wait for a slot when the step fails
    with failing(eng, "decode_step", 3, RuntimeError("injected")), pytest.raises(RuntimeError, match="injected"):
        greedy(eng, prompts)
    assert eng.free_slots == eng.max_batch
    assert greedy(eng, prompts) == greedy(new_engine(model), prompts)


def test_more_bad_prompts_than_slots_each_raise_and_the_engine_still_works(model):
    eng = new_engine(model)
    V = model.cfg.vocab_size
    for _ in range(eng.max_batch + 1):
        with pytest.raises(ValueError, match=rf"prompt 1: token id {V} at position 2 .*\[0, {V}\)"):
            greedy(eng, [PROMPTS[0], [1, 2, V, 3]])
        assert eng.free_slots == eng.max_batch  # refused before any prompt took a slot
    assert greedy(eng, PROMPTS) == greedy(new_engine(model), PROMPTS)


@pytest.mark.parametrize("bad, match", [(-1, r"token id -1 at position 1 .*\[0, "),
                                        (2.5, r"position 1 is 2\.5, not an integer")])
def test_a_negative_or_non_integer_id_is_refused(model, bad, match):
    eng = new_engine(model)
    with pytest.raises(ValueError, match=match):
        greedy(eng, [[7, bad, 9]])
    assert eng.free_slots == eng.max_batch
    assert greedy(eng, PROMPTS) == greedy(new_engine(model), PROMPTS)


class StopReading(Exception):
    """The caller's way to stop a streamed generation early."""


def test_a_stream_stopped_after_one_token_frees_its_slot(model):
    eng = new_engine(model, max_batch=1)
    got = []

    def stream(index, token, delta):
        got.append(token)
        raise StopReading

    with pytest.raises(StopReading):
        greedy(eng, PROMPTS[:1], n=8, stream=stream)
    assert len(got) == 1 and eng.free_slots == 1
    assert greedy(eng, PROMPTS) == greedy(new_engine(model), PROMPTS)  # one slot: the two run in turn


def test_slots_held_outside_the_call_raise_instead_of_spinning(model):
    eng = new_engine(model)
    held = [eng.allocate_slot() for _ in range(eng.max_batch)]
    with pytest.raises(RuntimeError, match="wait for a KV slot, but none is free"):
        greedy(eng, PROMPTS)
    for slot in held:
        eng.free_slot(slot)
    assert greedy(eng, PROMPTS) == greedy(new_engine(model), PROMPTS)


def test_an_interrupted_conversation_turn_leaves_the_slot_holding_what_it_says(model):
    """The kept slot's record of what it holds follows the interrupted turn: the next turn must not reuse
    cache positions that turn overwrote."""
    eng = new_engine(model, max_batch=1)
    conv = Conversation.open(eng)
    turn1 = [5, 9, 200, 17, 3, 88, 41]
    greedy(eng, [turn1], conversation=conv)
    turn2 = turn1[:3] + [60, 61, 62]  # overwrites the cache from position 3
    with failing(eng, "decode_step", 2, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        greedy(eng, [turn2], conversation=conv)
    assert conv.held[: len(turn2)] == turn2
    turn3 = turn1 + [11, 12]  # shares turn1's prefix, which the cache no longer holds past position 3
    assert greedy(eng, [turn3], conversation=conv) == greedy(new_engine(model), [turn3])
