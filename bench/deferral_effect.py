"""What expert deferral (--defer-experts N) does to a model's output: greedy tokens and perplexity over a text,
with and without it, on the same checkpoint and placement.

Deferral adds each token's N lowest-ranked experts of a layer one layer late; it is an approximation, so this
reports how far the output moves: the share of greedy tokens that stay the same (and the position of the first
difference) for a few prompts, and the perplexity of a text (teacher-forced, every position) under each setting.
On a random-weight checkpoint (the built-in demo or bench.make_checkpoint) the perplexities themselves mean
nothing; the change between them is what deferral does to that model.

    python -m bench.deferral_effect --defer 1,2 [--model DIR] [--text FILE] [--out deferral.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig
from hybrid.runtime.engine import Engine
from hybrid.runtime.kv_cache import StaticKVCache
from hybrid.runtime.sampling import SamplingParams

TEXT = ("The cost model decides, per batch and per layer, whether to ship an expert's activations to the CPU or "
        "its weights over PCIe to the GPU. A batch of tokens each choosing a few experts makes many assignments; "
        "compute is fixed by that number, weight traffic by how many distinct experts are touched.")


@torch.no_grad()
def perplexity(model, ids: list[int]) -> float:
    cache = StaticKVCache.for_model(model, 1, len(ids) + 1)
    x = torch.tensor([ids], device=model.device)
    logits = model(x, torch.arange(len(ids), device=model.device)[None], torch.tensor([0], device=model.device),
                   cache).float()[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="mean")
    return math.exp(float(nll))


def run(model_dir, defer: int, device: str, prompts, text_ids, n: int, resident: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, _ = load_hybrid(model_dir, device, dtype,
                           HybridConfig(gpu_experts=resident, schedule="cpu", defer_experts=defer), progress=False)
    eng = Engine(model, None, max_batch=len(prompts), max_context=max(map(len, prompts)) + n + 1,
                 eager=device != "cuda")
    outs = eng.generate(prompts, max_new_tokens=n, sampling=SamplingParams(temperature=0), stop_token_ids=[])
    return dict(tokens=[o.token_ids for o in outs], perplexity=perplexity(model, text_ids))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo)")
    p.add_argument("--defer", default="1,2", help="deferred experts per token to compare with 0")
    p.add_argument("--text", help="a UTF-8 text file for the perplexity (default: a built-in paragraph)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--resident", type=int, default=0, help="resident experts per layer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.model is None:
        from hybrid.runtime.demo import ensure_demo_checkpoint

        a.model = str(ensure_demo_checkpoint())
    text = Path(a.text).read_text(encoding="utf-8") if a.text else TEXT
    prompt_texts = ("The capital of France is", "def add(a, b):", "Mixture-of-Experts models")
    if (Path(a.model) / "tokenizer.json").is_file():
        from hybrid.runtime.tokenizer import Tokenizer

        encode = Tokenizer(a.model).encode
    else:  # a bare random checkpoint: its bytes, folded into the vocabulary, stand in for token ids
        from hybrid.models.loader import read_config

        vocab = read_config(a.model)[1].vocab_size
        print(f"# no tokenizer.json in {a.model}: token ids are the text's bytes modulo the vocabulary ({vocab})")
        encode = lambda s: [b % vocab for b in s.encode()]  # noqa: E731
    text_ids = encode(text)[:512]
    prompts = [encode(s) for s in prompt_texts]
    base = run(a.model, 0, a.device, prompts, text_ids, a.tokens, a.resident)
    rows = [dict(defer=0, same_tokens=1.0, first_difference=None, perplexity=base["perplexity"])]
    print(f"# deferral effect | {a.model} | {a.device} | {len(text_ids)} text tokens, {a.tokens} greedy tokens x "
          f"{len(prompts)} prompts\ndefer 0: perplexity {base['perplexity']:.3f}")
    for d in (int(v) for v in a.defer.split(",")):
        r = run(a.model, d, a.device, prompts, text_ids, a.tokens, a.resident)
        same = sum(x == y for t0, t1 in zip(base["tokens"], r["tokens"]) for x, y in zip(t0, t1))
        total = sum(len(t) for t in base["tokens"])
        first = [next((i for i, (x, y) in enumerate(zip(t0, t1)) if x != y), None)
                 for t0, t1 in zip(base["tokens"], r["tokens"])]
        rows.append(dict(defer=d, same_tokens=same / total, first_difference=first, perplexity=r["perplexity"]))
        print(f"defer {d}: {100 * same / total:.0f}% of greedy tokens unchanged (first difference per prompt: "
              f"{first}), perplexity {r['perplexity']:.3f} ({100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}%)")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(model=a.model, device=a.device, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
