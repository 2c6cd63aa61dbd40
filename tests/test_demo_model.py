"""The built-in demo (hybrid/runtime/demo_model) is a trained model, not random weights: hybrid's loader gives
transformers' logits from it; its perplexity on Shakespeare it never saw (two held-out plays) is far below a random
model's of the same shape; its greedy continuations are English words, not a loop, by a check that real Shakespeare
passes and a random model of the same shape fails; and its training record is the run it ships."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from hybrid.models import build_empty, init_random_, load_model
from hybrid.models.families import family_for
from hybrid.runtime import Engine
from hybrid.runtime.demo import DEMO_FILES, demo_checkpoint, demo_notice
from hybrid.runtime.tokenizer import Tokenizer

# From the two plays bench.train_small holds out (The Two Gentlemen of Verona, The Winter's Tale), as the corpus
# writes them: text the demo was scored on, never trained on.
HELDOUT = """VALENTINE.
Cease to persuade, my loving Proteus:
Home-keeping youth have ever homely wits.
Were't not affection chains thy tender days
To the sweet glances of thy honour'd love,
I rather would entreat thy company
To see the wonders of the world abroad,
Than, living dully sluggardiz'd at home,
Wear out thy youth with shapeless idleness.

MAMILLIUS.
A sad tale's best for winter. I have one
Of sprites and goblins.
"""
PROMPTS = ["To be, or not to be", "KING HENRY.", "Good morrow,"]
# Common words of English and of Shakespeare's (function words, pronouns old and new, frequent verbs and nouns):
# about half of the running words of real text (48% of HELDOUT's), rare in a random model's strings of sub-word
# pieces (at most 40% over 12 random models of the demo's shape, std 0.02 to 1, most below 25%).
COMMON = set("""
the and i to of a you my that in is not it me with be your his this he but for have as thou so him will what thy
all her no do by shall if are we thee on our lord now good o sir from at they she or well would was which more then
their here there let an how when love man come them hath one than upon like us may say make know go should did were
am must why yet see where who can too such out up nor had these some most much been give take tell speak hear doth
mine own very king time day night heart life death father mother son god men great true sweet never ever art thus
first old noble way away again before any every nothing yes ay nay fair honour other those being into over still
heaven world hand eyes name soul done made think pray dead live die word words madam lady queen prince duke friend
master""".split())


@pytest.fixture(scope="module")
def demo():
    path = demo_checkpoint()
    return path, Tokenizer(path), load_model(path, progress=False)


@pytest.fixture(scope="module")
def random_model(demo):
    """A model of the demo's shape with random weights, N(0, 0.02) as bench.make_checkpoint writes them."""
    raw = json.loads((demo[0] / "config.json").read_text())
    return init_random_(build_empty(family_for(raw).parse_config(raw), "cpu", torch.float32), seed=0, std=0.02)


def perplexity(model, ids: list[int]) -> float:
    """exp of the mean next-token negative log-likelihood of `ids`, teacher-forced through hybrid's engine."""
    e = Engine(model, max_batch=1, max_context=len(ids) + 1, eager=True)
    logits = e.forward(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]))[0].float()
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def words(text: str) -> list[str]:
    """Whitespace-separated words, lower-cased, stripped of the punctuation around them."""
    return [w for w in (re.sub(r"^[^a-z]+|[^a-z]+$", "", w.lower()) for w in text.split()) if w]


def english(text: str) -> tuple[float, int, int]:
    """(share of the words that are COMMON, distinct words, words) of `text`."""
    ws = words(text)
    return sum(w in COMMON for w in ws) / max(len(ws), 1), len(set(ws)), len(ws)


def reads_as_english(text: str) -> bool:
    """Nearly half the words common ones, and at least 15 different words: neither gibberish nor a word looping."""
    share, distinct, _ = english(text)
    return share >= 0.45 and distinct >= 15


def greedy(model, tok, n: int = 40) -> str:
    """The greedy continuations of PROMPTS, n tokens each, joined."""
    e = Engine(model, tok, max_batch=1, max_context=128)
    return "\n".join(e.generate([tok.encode(p)], n, stop_token_ids=[])[0].text for p in PROMPTS)


def test_the_packaged_files_and_the_notice_come_from_the_training_record(demo):
    path, tok, _ = demo
    assert all((path / name).is_file() for name in DEMO_FILES)
    report = json.loads((path / "training.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and tok.vocab_size == cfg["vocab_size"] == report["vocab"]
    assert report["corpus"]["source"] == "shakespeare" and report["params"]["total"] < 3e6
    assert report["heldout_perplexity"] < 0.2 * report["unigram_perplexity"], report
    notice = demo_notice(path)
    assert len(notice.splitlines()) == 1 and "Shakespeare" in notice and "--model DIR" in notice
    assert f"{report['steps']} steps" in notice and f"perplexity {report['heldout_perplexity']:.0f}" in notice


def test_hybrid_loads_the_demo_with_transformers_logits(demo):
    pytest.importorskip("transformers")
    from bench.train_small import compare_logits

    path, tok, _ = demo
    diff, scale = compare_logits(path, tok.encode(HELDOUT)[:64])
    assert scale > 1.0 and diff <= 1e-4, f"max |hybrid - transformers| {diff:.2e}, max |logit| {scale:.2f}"


def test_held_out_perplexity_is_far_below_a_random_models(demo, random_model):
    path, tok, model = demo
    ids = tok.encode(HELDOUT)
    trained, rand = perplexity(model, ids), perplexity(random_model, ids)
    vocab = tok.vocab_size
    assert trained < 150, f"demo perplexity {trained:.1f} on {len(ids)} held-out tokens (random: {rand:.0f})"
    assert rand > vocab / 2, f"random-weight perplexity {rand:.0f}, vocabulary {vocab}"


def test_greedy_text_reads_as_english_where_a_random_models_does_not(demo, random_model):
    _, tok, model = demo
    assert reads_as_english(HELDOUT), english(HELDOUT)  # the check passes real Shakespeare
    text = greedy(model, tok)
    assert reads_as_english(text), f"demo: (common share, distinct, words) = {english(text)}: {text!r}"
    noise = greedy(random_model, tok)
    assert not reads_as_english(noise), f"random: (common share, distinct, words) = {english(noise)}: {noise!r}"
