"""Engine, sampling and CLI behaviour on the CPU: slots, padding, chunked prefill, stop tokens and
strings, streaming, seeds, top-k/top-p, the demo checkpoint and `hybrid generate/chat`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybrid.cli import main
from hybrid.models import build_empty, init_random_
from hybrid.models.families import family_for
from hybrid.models.presets import hf_config
from hybrid.runtime import Engine, SamplingParams, sample
from hybrid.runtime.generation import run_generation
from hybrid.runtime.sampling import filter_logits


@pytest.fixture(scope="module")
def model():
    raw = hf_config("demo", layers=2)
    cfg = family_for(raw).parse_config(raw)
    return init_random_(build_empty(cfg, "cpu", torch.float32), seed=0, std=0.1)


def prompt(n, seed=0):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_slots_allocate_free_and_reuse(model):
    e = Engine(model, max_batch=2, max_context=16)
    a, b = e.allocate_slot(), e.allocate_slot()
    assert {a, b} == {0, 1}
    with pytest.raises(ValueError, match="all 2 KV slots"):
        e.allocate_slot()
    e.prefill(a, prompt(5))
    assert e.lengths[a] == 5
    e.free_slot(a)
    with pytest.raises(ValueError, match="not allocated"):
        e.free_slot(a)
    assert e.allocate_slot() == a and e.lengths[a] == 0


def test_padding_writes_nothing_and_rows_are_independent(model):
    e = Engine(model, max_batch=3, max_context=16)
    p = prompt(6, 1)
    alone = e.forward(torch.tensor([p]), torch.arange(6)[None], torch.tensor([1]))[0]  # [T, V]
    k_before = e.cache.k[:, :, :16].clone()
    ids = torch.tensor([p + [0, 0], prompt(8, 2)])
    pos = torch.tensor([list(range(6)) + [-1, -1], list(range(8))])
    both = e.forward(ids, pos, torch.tensor([0, 2]))
    assert torch.allclose(both[0, :6], alone, atol=1e-5)
    # Row 0's padding (positions -1) left slot 0's positions 6, 7 untouched.
    assert torch.equal(e.cache.k[:, 0, 6:16], k_before[:, 0, 6:16])
    last = e.forward(ids, pos, torch.tensor([0, 2]), last_only=True)  # [B, V]
    assert torch.allclose(last[0], alone[5], atol=1e-5)


def test_chunked_prefill_equals_one_shot(model):
    e = Engine(model, max_batch=2, max_context=32)
    p = prompt(12, 3)
    s0, s1 = e.allocate_slot(), e.allocate_slot()
    one = e.prefill(s0, p)
    e.prefill(s1, p[:5])
    two = e.prefill(s1, p[5:])
    assert torch.allclose(one, two, atol=1e-5)
    with pytest.raises(ValueError, match="exceed max_context"):
        e.prefill(s1, prompt(30))


def test_greedy_batch_equals_one_by_one(model):
    prompts = [prompt(n, n) for n in (3, 9, 5, 7)]
    batched = Engine(model, max_batch=3, max_context=40).generate(prompts, 12, stop_token_ids=[])
    for p, r in zip(prompts, batched):
        alone = Engine(model, max_batch=1, max_context=40).generate([p], 12, stop_token_ids=[])[0]
        assert r.token_ids == alone.token_ids and len(r.token_ids) == 12


def test_stop_token_ends_and_is_not_returned(model):
    p = prompt(6, 4)
    free = Engine(model, max_batch=1, max_context=40).generate([p], 10, stop_token_ids=[])[0].token_ids
    stop = free[4]
    first = free.index(stop)
    out = Engine(model, max_batch=1, max_context=40).generate([p], 10, stop_token_ids=[stop])[0]
    assert out.token_ids == free[:first] and out.finish_reason == "stop"


def test_max_context_ends_generation(model):
    out = Engine(model, max_batch=1, max_context=10).generate([prompt(6)], 50, stop_token_ids=[])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5  # positions 6..9 decode, +1 from prefill


def test_a_prompt_must_leave_room_for_one_token(model):
    e = Engine(model, max_batch=1, max_context=10)
    with pytest.raises(ValueError, match="max_context is 10"):
        e.generate([prompt(10)], 4, stop_token_ids=[])
    out = e.generate([prompt(9)], 4, stop_token_ids=[])[0]  # the prefill's token, then position 9 decodes one
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_cache_reads_never_reach_the_padding_column():
    """Padding positions (-1) write to a spare column past max_context; a read asking for more than max_context
    positions stops at max_context, so that column never enters attention."""
    from hybrid.runtime.kv_cache import StaticKVCache

    c = StaticKVCache(1, 2, 4, num_kv_heads=1, head_dim=2)
    slots, pos = torch.tensor([0, 1]), torch.tensor([[0, -1], [3, -1]])
    vals = [torch.ones(2, 2, 1, 2) for _ in c.buffers]
    c.write(0, slots, pos, *vals)
    for kv_len in (None, 4, 9):
        k = c.read(0, slots, kv_len)[0]
        assert k.shape[1] == 4
        assert k[0, 0].eq(1).all() and k[1, 3].eq(1).all() and float(k.abs().sum()) == 2 * 2  # no padding value
    assert c.read(0, slots, 2)[0].shape[1] == 2


def test_seeded_sampling_is_reproducible_and_differs_by_seed(model):
    e = Engine(model, max_batch=2, max_context=40)
    p = prompt(4, 5)
    sp = SamplingParams(temperature=1.0, seed=7)
    a = e.generate([p, p], 16, sampling=[sp, SamplingParams(temperature=1.0, seed=8)], stop_token_ids=[])
    b = e.generate([p], 16, sampling=sp, stop_token_ids=[])
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != a[1].token_ids
    greedy = e.generate([p], 16, stop_token_ids=[])[0].token_ids
    topk1 = e.generate([p], 16, sampling=SamplingParams(temperature=1.0, top_k=1, seed=3), stop_token_ids=[])
    assert topk1[0].token_ids == greedy


def test_filter_logits_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [True, False, False, False, True]
    probs = torch.softmax(logits, -1)  # sorted: 3.0 (0.61), 2.0 (0.22), 1.0 (0.08), ...
    p = float(probs[4] + probs[0]) - 1e-4  # mass of the top two, just under it
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=p)))
    assert kept.tolist() == [True, False, False, False, True]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.01)))
    assert kept.tolist() == [False, False, False, False, True]
    assert sample(logits[None], [SamplingParams()], [None]) == [4]
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


@pytest.fixture(scope="module")
def demo_dir():
    from hybrid.runtime.demo import demo_checkpoint

    return demo_checkpoint()


def test_stop_strings_and_streaming_with_tokenizer(demo_dir):
    from hybrid.models import load_model
    from hybrid.runtime.tokenizer import Tokenizer

    tok = Tokenizer(demo_dir)
    e = Engine(load_model(demo_dir, progress=False), tok, max_batch=2, max_context=64)
    p = tok.encode("Hello, world! The capital")
    free = e.generate([p], 20, stop_token_ids=[])[0]
    assert free.text == tok.decode(free.token_ids)
    pieces = []
    streamed = e.generate([p, p[:3]], 20, stop_token_ids=[], stream=lambda i, t, d: pieces.append((i, d)))
    assert "".join(d for i, d in pieces if i == 0) == streamed[0].text == free.text
    assert "".join(d for i, d in pieces if i == 1) == streamed[1].text
    stop = free.text[len(free.text) // 2:][:3]
    assert stop and stop in free.text
    out = e.generate([p], 20, stop_token_ids=[], stop_strings=[stop])[0]
    assert out.text == free.text[:free.text.find(stop)] and out.finish_reason == "stop"


def test_earliest_of_two_stop_strings_cuts_and_held_text_is_flushed(demo_dir):
    """Two stop strings that complete on the same token, one starting a character after the other: the text
    ends before the earlier one. Streamed with a long stop string (a large hold-back), the deltas still add up
    to the whole text once generation ends by length."""
    from hybrid.models import load_model
    from hybrid.runtime.tokenizer import Tokenizer

    tok = Tokenizer(demo_dir)
    e = Engine(load_model(demo_dir, progress=False), tok, max_batch=1, max_context=64)
    p = tok.encode("Hello, world! The capital")
    free = e.generate([p], 20, stop_token_ids=[])[0].text
    i = next(i for i in range(1, len(free) - 3)
             if free.find(free[i:i + 3]) == i and free.find(free[i + 1:i + 3]) == i + 1)
    out = e.generate([p], 20, stop_token_ids=[], stop_strings=[free[i + 1:i + 3], free[i:i + 3]])[0]
    assert out.text == free[:i] and out.finish_reason == "stop"
    pieces = []
    never = free[-3:] + "\x00" * 37  # never completed; the text's last characters start it, so they are held back
    out = e.generate([p], 20, stop_token_ids=[], stop_strings=[never], stream=lambda i, t, d: pieces.append(d))[0]
    assert out.finish_reason == "length" and out.text == free and "".join(pieces) == free


def test_demo_checkpoint_is_the_packaged_folder(demo_dir):
    import hybrid
    from hybrid.runtime.demo import DEMO_FILES

    assert demo_dir == Path(hybrid.__file__).resolve().parent / "runtime" / "demo_model"
    assert all((demo_dir / name).is_file() for name in DEMO_FILES)
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    tcfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]


def test_cli_generate_json(demo_dir, capsys):
    assert main(["generate", "--prompt", "Hello there", "-n", "6", "--json"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert res["demo"] is True and "Shakespeare" in out.err and "--model DIR" in out.err
    assert len(res["generated_token_ids"]) <= 6 and res["prompt"] == "Hello there"
    assert res["prefill_tokens_per_s"] > 0 and res["dtype"] == "float32"
    # Same greedy tokens from the library.
    from hybrid.models import load_model
    from hybrid.runtime.tokenizer import Tokenizer

    e = Engine(load_model(demo_dir, progress=False), Tokenizer(demo_dir), max_batch=1, max_context=64)
    assert e.generate([res["prompt_token_ids"]], 6)[0].token_ids == res["generated_token_ids"]


def test_cli_generate_text_and_errors(demo_dir, capsys):
    assert main(["generate", "-n", "4", "--prompt", "Once upon"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Once upon") and "tok/s" in out.err and "decode" in out.err
    assert main(["generate", "--top-p", "0", "-n", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", str(demo_dir / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"hybrid generate: error: model directory not found: {demo_dir / 'nope'}"


def test_cli_chat(demo_dir, capsys, monkeypatch):
    lines = iter(["hi", "/reset", "", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt="": next(lines))
    assert main(["chat", "-n", "5"]) == 0
    err = capsys.readouterr().err
    assert err.count("decode") == 2  # one stats line per reply


def test_warmup_leaves_engine_clean(model):
    e = Engine(model, max_batch=2, max_context=8)
    e.warmup()
    assert e.free_slots == 2 and e.stats.prefill_tokens == 0 and e.stats.decode_steps == 0
    assert e.generate([prompt(3)], 4, stop_token_ids=[])[0].token_ids == \
        Engine(model, max_batch=1, max_context=8).generate([prompt(3)], 4, stop_token_ids=[])[0].token_ids


def test_make_checkpoint_writes_a_loadable_model_with_tokenizer(demo_dir, tmp_path, capsys):
    from bench.make_checkpoint import main as make

    out = tmp_path / "demo1"
    assert make(["--preset", "demo", "--layers", "1", "--out", str(out), "--dtype", "float32"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and (out / "tokenizer.json").is_file()
    assert "wrote" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "-n", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["demo"] is False and len(res["generated_token_ids"]) <= 2


def test_chat_template_features(tmp_path):
    """Templates use namespace(), loop controls, raise_exception and tojson, as real ones do."""
    from hybrid.runtime.tokenizer import Tokenizer
    from hybrid.runtime.demo import build_tokenizer

    build_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{%- set ns = namespace(n=0) -%}"
        "{%- for m in messages -%}{%- if m.role not in ['user', 'assistant', 'system'] -%}"
        "{{ raise_exception('bad role ' + m.role) }}{%- endif -%}"
        "{%- set ns.n = ns.n + 1 -%}<{{ m.role }}>{{ m.content | trim }}{{ eos_token }}{%- endfor -%}"
        "{{ ns.n | tojson }}{%- if add_generation_prompt %}<assistant>{% endif -%}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}])
    assert text == "<user>hi<|im_end|><assistant>yo<|im_end|>2<assistant>"
    with pytest.raises(Exception, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")  # transformers 5 layout
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "a!"


# The generate loop (hybrid.runtime.generation) on a scripted engine: the earliest stop string in the text
# wins, whatever order the strings are given in, and the loop stops exactly when the KV slot is full. The
# engine plays a fixed script of tokens (one-hot logits, greedy); its tokenizer has multi-character tokens,
# so one token can complete two stop strings at once, and then only precedence decides the cut.

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


def test_text_held_for_a_stop_string_is_flushed_at_the_length_limit():
    # "A" could start the stop string "AB", so it is held back until the length limit ends the sequence; then
    # it is streamed (the deltas add up to the text)
    c = _generate([2, 6, 4], ("AB",), max_new=2)
    assert (c.text, c.finish_reason, c.token_ids) == ("xA", "length", [2, 6])


def test_text_held_for_a_stop_string_is_flushed_at_eos():
    # "A" could start the stop string "AB" and is held back; EOS ends the sequence next, and the "A" is streamed
    # then (the deltas add up to the text, checked in _generate)
    c = _generate([2, 6, EOS, 4], ("AB",))
    assert (c.text, c.finish_reason, c.token_ids) == ("xA", "stop", [2, 6])
