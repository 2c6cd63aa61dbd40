"""Per-row token sampling for a decode batch: greedy, temperature, top-k, top-p, per-request seeds.

Each sequence owns a torch.Generator, so a seeded request draws the same random numbers whether it runs
alone or batched with others; greedy rows use argmax and touch no generator at all.
"""

from __future__ import annotations

import torch

from hybrid.server.schemas import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()  # fresh non-deterministic seed
    else:
        g.manual_seed(seed % (1 << 64))
    return g


def sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """logits: [V] for one sequence -> the chosen token id."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always survives)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """logits: [B, V] -> one token per row. Greedy rows go through one batched argmax."""
    out = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids = torch.argmax(logits[greedy].float(), dim=-1).tolist()  # [G]
        for i, t in zip(greedy, ids):
            out[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_row(logits[i], p, gens[i])
    return out
