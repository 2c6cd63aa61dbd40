"""First use: a random checkpoint of a real shape gets a tokenizer that covers its vocabulary (and a model
whose vocabulary its tokenizer does not cover is warned about); load time is reported apart from prefill;
the warm-up leaves no state behind; an install that lost the demo's files is told so in one line."""

from __future__ import annotations

import json

import torch

from hybrid.cli import main


def test_make_checkpoint_tokenizer_covers_the_vocab(tmp_path, capsys):
    from bench.make_checkpoint import main as make
    from hybrid.runtime.tokenizer import Tokenizer

    out = tmp_path / "olmoe"
    # OLMoE's real vocabulary (50304) with a tiny body: 1 layer, the writer keeps the preset's widths
    assert make(["--preset", "olmoe-1b-7b", "--layers", "1", "--out", str(out), "--dtype", "bfloat16"]) == 0
    raw = json.loads((out / "config.json").read_text())
    tok = Tokenizer(out)
    assert tok.vocab_size >= raw["vocab_size"] == 50304
    assert tok.decode([50000]) == "<id50000>"
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "-n", "3", "--json"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)
    assert res["text"] and "warning" not in cap.err  # every generated id has text now
    assert res["load_s"] > 0 and "warmup_s" in res and res["prefill_tokens"] == len(res["prompt_token_ids"])


def test_vocab_larger_than_tokenizer_warns(tmp_path, capsys):
    from bench.make_checkpoint import main as make

    out = tmp_path / "olmoe"
    assert make(["--preset", "olmoe-1b-7b", "--layers", "1", "--out", str(out), "--tokenizer", "none"]) == 0
    from hybrid.runtime.demo import build_tokenizer

    build_tokenizer(out)  # the old behaviour: the 1k tokenizer, not padded to the vocabulary
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "-n", "1"]) == 0
    err = capsys.readouterr().err
    assert "warning: the model has 50304 token ids but its tokenizer only" in err


def test_generate_reports_load_time_apart_from_prefill(capsys):
    assert main(["generate", "-n", "2"]) == 0
    err = capsys.readouterr().err
    assert "loaded in" in err and "warm-up" in err


def test_warmup_leaves_no_state():
    # the first real generation after a warm-up equals one on a fresh engine without it, token for token and
    # in its logits; the routing counters of the executors are what they were
    from hybrid.models import load_model
    from hybrid.runtime.demo import demo_checkpoint
    from hybrid.runtime.engine import Engine

    model = load_model(demo_checkpoint(), progress=False)
    prompt = [5, 17, 300, 42, 9]
    cold = Engine(model, max_batch=2, max_context=64)
    slot = cold.allocate_slot()
    ref_logits = cold.prefill(slot, prompt).clone()
    cold.free_slot(slot)
    ref = Engine(model, max_batch=2, max_context=64).generate([prompt], 6, stop_token_ids=[])[0].token_ids

    warm = Engine(model, max_batch=2, max_context=64)
    assert warm.warmup(tokens=40) > 0
    assert warm.free_slots == 2 and warm.lengths == [0, 0] and warm.stats.prefill_tokens == 0
    slot = warm.allocate_slot()
    torch.testing.assert_close(warm.prefill(slot, prompt), ref_logits, rtol=0, atol=0)
    warm.free_slot(slot)
    warm.stats.prefill_tokens = 0
    assert warm.generate([prompt], 6, stop_token_ids=[])[0].token_ids == ref


def test_warmup_restores_hybrid_routing_counters():
    import numpy as np

    from hybrid.runtime.demo import demo_checkpoint
    from hybrid.runtime.engine import Engine
    from hybrid.offload.build import load_hybrid
    from hybrid.offload.config import HybridConfig

    model, offload = load_hybrid(str(demo_checkpoint()), torch.device("cpu"), torch.float32,
                                 HybridConfig(gpu_experts=2, schedule="cpu"), progress=False)
    e = Engine(model, max_batch=1, max_context=64)
    before = [layer.moe.experts.stats.routed.copy() for layer in model.layers if layer.moe is not None]
    e.warmup(tokens=20)
    after = [layer.moe.experts.stats.routed for layer in model.layers if layer.moe is not None]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_an_install_without_the_demo_files_is_one_line(tmp_path, monkeypatch, capsys):
    """The demo ships in the package: an install that lost one of its files says how to mend it, in one line and
    exit 2, for generate and plan alike."""
    import shutil

    from hybrid.runtime import demo

    broken = tmp_path / "demo_model"
    shutil.copytree(demo.demo_checkpoint(), broken)
    (broken / "model.safetensors").unlink()
    monkeypatch.setattr(demo, "DEMO_DIR", broken)
    for argv in (["generate", "-n", "1", "--prompt", "hi"], ["plan", "--gpu-budget", "2GiB", "--cpu-budget", "8GiB"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert "model.safetensors" in err[0] and "reinstall hybrid-moe or pass --model DIR" in err[0], err


def test_placeholders_pad_the_bpe_vocabulary_not_the_added_tokens(tmp_path):
    """pad_tokenizer's <idN> are entries of the BPE model's vocabulary: the added tokens stay the tokenizer's own
    specials (llguidance's token table, built for constrained decoding, grows quadratically with added tokens),
    each placeholder decodes to its name, and encoding text never yields one (no merge reaches them)."""
    from tokenizers import Tokenizer as HfTokenizer

    from hybrid.runtime.demo import build_tokenizer, pad_tokenizer

    build_tokenizer(tmp_path)
    before = json.loads((tmp_path / "tokenizer.json").read_text())
    n = HfTokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert pad_tokenizer(tmp_path / "tokenizer.json", n + 3000) == n + 3000
    after = json.loads((tmp_path / "tokenizer.json").read_text())
    assert after["added_tokens"] == before["added_tokens"]
    assert after["model"]["vocab"][f"<id{n + 2999}>"] == n + 2999
    tok = HfTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.decode([n, n + 2999]) == f"<id{n}><id{n + 2999}>"
    assert max(tok.encode(f"some text <id{n + 5}> and more").ids) < n
    assert pad_tokenizer(tmp_path / "tokenizer.json", n + 3000, tmp_path / "copy.json") == n + 3000
    assert json.loads((tmp_path / "copy.json").read_text()) == after
