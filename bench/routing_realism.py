"""How a model routes, token by token: expert load skew and temporal locality per MoE layer, beside what uniform
random routing would give. Random-weight checkpoints route unlike trained ones (the reason BENCHMARKS.md's
resident-expert and LLC figures need a trained model); this measures it.

    python -m bench.routing_realism --model DIR [--corpus FOLDER | --text FILE] [--tokens 4096] [--out FILE.json]

Per MoE layer, over --tokens of text read in order (teacher-forced, windows of --window positions; a token's
routing is what decode would compute for it, since routing depends only on its own hidden state):
    top10_share     share of all (token, expert) assignments that go to the 10% most-used experts (uniform: 0.10)
    max_over_mean   the most-used expert's load over the mean load (uniform: ~1)
    entropy         load entropy over log(E) (uniform: 1)
    lag1 / lag8     share of a token's K experts also used by the token 1 (8) positions before (uniform: K/E)
    top1_repeat     share of tokens whose first-ranked expert is the token before's first-ranked (uniform: 1/E; the
                    measure of Mixtral's routing analysis, Jiang et al. 2024, arXiv 2401.04088, Table 5)
    within8         share of a token's experts used by any of the 8 tokens before (uniform: 1 - (1 - K/E)^8)
    reuse_median    median positions since an expert was last used, over reused (token, expert) pairs
    early_guess     share of a token's K experts that the layer's router picks from the layer's input, before its
                    attention (the MLP norm of the residual stream as the layer receives it, routed as the layer
                    routes; uniform: K/E): how much of a step's expert reads could be known, and started, while the
                    GPU computes the layer's attention
    ahead_guess     share of a token's K experts that the layer's router picks from the input of the MoE layer
                    before it (that layer's experts' input, routed as this layer routes; uniform: K/E): a guess the
                    CPU lane could make itself when the earlier layer's call ends, with no help from the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import numpy as np
import torch

from hybrid.errors import UsageError


@contextlib.contextmanager
def expert_choices(model, early: dict | None = None, ahead: dict | None = None):
    """Within the block, every MoE layer's expert choices are recorded: yields {model layer index: [[T, K] int
    tensors on the CPU], one per forward}. Every routing path (the fused router GEMV's at decode sizes too) hands
    its choice to the layer's _experts_out, which is what is wrapped. With `early` (a dict), the layer's early guess
    is recorded into it the same way: its router applied to the MLP norm of the residual stream the layer received,
    taken where the layer adds attention's output to that stream (its MLP norm's add_norm). With `ahead` (a dict),
    each MoE layer's ahead guess, keyed by its index: its router applied to the experts' input of the MoE layer
    before it, taken in that layer's _experts_out."""
    seen: dict[int, list] = {}
    moes = [(i, layer) for i, layer in enumerate(model.layers) if layer.moe is not None]
    following = {i: nxt for (i, _), nxt in zip(moes, moes[1:])}  # MoE layer -> (index, layer) of the next one
    for i, layer in moes:
        def recording(x, chosen, weights, into, _out=layer.moe._experts_out, _i=i):
            seen.setdefault(_i, []).append(chosen.detach().cpu())
            if ahead is not None and _i in following:
                j, nxt = following[_i]
                guess, _ = nxt.moe.route(x.reshape(-1, x.shape[-1]))
                ahead.setdefault(j, []).append(guess.detach().cpu())
            return _out(x, chosen, weights, into)

        def guessing(h, delta, _add_norm=layer.mlp_norm.add_norm, _layer=layer, _i=i):
            guess, _ = _layer.moe.route(_layer.mlp_norm(h).reshape(-1, h.shape[-1]))
            early.setdefault(_i, []).append(guess.detach().cpu())
            return _add_norm(h, delta)
        layer.moe._experts_out = recording
        if early is not None:
            layer.mlp_norm.add_norm = guessing
    try:
        yield seen
    finally:
        for _, layer in moes:
            del layer.moe._experts_out  # the instance attributes go; the classes' methods are back
            if early is not None:
                del layer.mlp_norm.add_norm


def record_routing(model, ids: list[int], window: int, early: dict | None = None,
                   ahead: dict | None = None) -> list[np.ndarray]:
    """[L][T, K] int expert ids each MoE layer chose for each token, in text order; with `early` (a dict), its
    entry "chosen" gets the same for the layers' early guesses (expert_choices); with `ahead`, its entry "chosen"
    the ahead guesses, None for the first MoE layer (it has no MoE layer before it)."""
    from hybrid.runtime.kv_cache import StaticKVCache

    cache = StaticKVCache.for_model(model, 1, window + 1)
    guesses = {} if early is not None else None
    aheads = {} if ahead is not None else None
    with expert_choices(model, guesses, aheads) as seen, torch.no_grad():
        for start in range(0, len(ids), window):
            chunk = ids[start:start + window]
            x = torch.tensor([chunk], device=model.device)
            model(x, torch.arange(len(chunk), device=model.device)[None], torch.tensor([0], device=model.device),
                  cache)
    if early is not None:
        early["chosen"] = [torch.cat(guesses[i]).numpy() for i in sorted(guesses)]
    if ahead is not None:
        ahead["chosen"] = [torch.cat(aheads[i]).numpy() if i in aheads else None for i in sorted(seen)]
    return [torch.cat(seen[i]).numpy() for i in sorted(seen)]


def set_overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |a_t & b_t| / K for [T, K] id arrays."""
    return float(np.mean([len(set(x.tolist()) & set(y.tolist())) / a.shape[1] for x, y in zip(a, b)]))


def layer_figures(chosen: np.ndarray, num_experts: int, early: np.ndarray | None = None,
                  ahead: np.ndarray | None = None) -> dict:
    T, K = chosen.shape
    load = np.bincount(chosen.ravel(), minlength=num_experts).astype(np.float64)
    share = load / load.sum()
    top = np.sort(share)[::-1][:max(1, num_experts // 10)].sum()
    nz = share[share > 0]
    sets = [set(row.tolist()) for row in chosen]
    lag = {d: float(np.mean([len(sets[t] & sets[t - d]) / K for t in range(d, T)])) if T > d else None for d in (1, 8)}
    within = [len(sets[t] & set().union(*sets[t - 8:t])) / K for t in range(8, T)]
    last: dict[int, int] = {}
    gaps = []
    for t, row in enumerate(chosen):
        for e in row.tolist():
            if e in last:
                gaps.append(t - last[e])
            last[e] = t
    return {"top10_share": float(top), "max_over_mean": float(load.max() / load.mean()),
            "entropy": float(-(nz * np.log(nz)).sum() / np.log(num_experts)), "lag1": lag[1], "lag8": lag[8],
            "top1_repeat": float(np.mean(chosen[1:, 0] == chosen[:-1, 0])) if T > 1 else None,
            "within8": float(np.mean(within)) if within else None,
            "reuse_median": float(np.median(gaps)) if gaps else None,
            "early_guess": set_overlap(early, chosen) if early is not None else None,
            "ahead_guess": set_overlap(ahead, chosen) if ahead is not None else None}


def uniform_figures(num_experts: int, k: int) -> dict:
    p = k / num_experts
    return {"top10_share": 0.10, "max_over_mean": 1.0, "entropy": 1.0, "lag1": p, "lag8": p,
            "top1_repeat": 1 / num_experts, "within8": 1 - (1 - p) ** 8, "reuse_median": None,
            "early_guess": p, "ahead_guess": p}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    p.add_argument("--corpus", help="a bench.corpus folder: its held-out text")
    p.add_argument("--text", help="a UTF-8 text file instead")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.tokens < 16 or a.window < 2:
        raise UsageError("--tokens must be >= 16 and --window >= 2")
    if a.corpus:
        from bench.corpus import load_corpus

        text = "\n\n".join(d.text for d in load_corpus(a.corpus)[1])
    elif a.text:
        text = Path(a.text).read_text(encoding="utf-8")
    else:
        raise UsageError("give --corpus FOLDER or --text FILE")
    from bench.quality import encoder
    from hybrid.models import load_model

    ids = encoder(a.model)(text)[:a.tokens]
    model = load_model(a.model, progress=False)
    cfg = model.cfg
    guessed, ahead = {}, {}
    chosen = record_routing(model, ids, a.window, early=guessed, ahead=ahead)
    base = uniform_figures(cfg.num_experts, cfg.experts_per_token)
    layers = [layer_figures(c, cfg.num_experts, g, h) for c, g, h in zip(chosen, guessed["chosen"], ahead["chosen"])]
    print(f"# routing realism | {a.model} | {len(ids)} tokens | {cfg.num_experts} experts, top-{cfg.experts_per_token}")
    keys = list(base)
    print("layer  " + "  ".join(f"{k:>13}" for k in keys))
    print("uniform" + "  ".join(f"{'-' if base[k] is None else round(base[k], 3):>13}" for k in keys))
    for i, f in zip(cfg.moe_layer_indices, layers):
        print(f"{i:<7}" + "  ".join(f"{'-' if f[k] is None else round(f[k], 3):>13}" for k in keys))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "tokens": len(ids), "num_experts": cfg.num_experts,
                                           "topk": cfg.experts_per_token, "uniform": base,
                                           "layers": dict(zip(map(str, cfg.moe_layer_indices), layers))}, indent=1))
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
