"""Does the placement planner's resident set catch the routing it expects? The planner's predicted resident hit rate
against the one measured on held-out text, on a model that has learned something (bench.train_small).

    python -m bench.hit_rate --model DIR [--corpus FOLDER] [--resident-shares 0.125,0.25,0.5 | --gpu-budget SIZE,...]
        [--profile-prompts 64] [--heldout-prompts 32] [--prompt-tokens 64] [--decode-tokens 32] [--out FILE.json]

Method:
1. Profile, as a user would with their own traffic: --profile-prompts prompts of --prompt-tokens tokens cut at evenly
   spaced places of the corpus's TRAINING documents go through `hybrid profile-routing` (its parser and its run(),
   --decode-tokens greedy tokens after each prompt), which writes the routing statistics file.
2. Plan: `hybrid plan --stats FILE` (its parser and build_plan(), priced at --max-batch 1, the batch-1 decode
   measured below) chooses the residents for each budget. --gpu-budget SIZE is given to the planner as it is;
   --resident-shares S gives it the budget that holds round(S x E) experts per MoE layer beside the GPU's fixed
   part (bf16 GPU weights, so that part does not move with the budget); the planner spends it across layers and
   may stop short of it when no further resident shortens a layer's decode makespan. The planner computes no hit
   rate itself, so the prediction is the one its statistics imply: per MoE layer, the share of the statistics'
   routed (token, expert) pairs whose expert is resident, sum(counts[resident]) / sum(counts) with the raw counts
   (no prior), for the decode steps' counts (decode_counts) and for the prompts' (counts - decode_counts); overall:
   the same pooled over layers (every layer routes every token, so it is the mean of the layers').
3. Measure: --heldout-prompts prompts cut the same way from the HELD-OUT documents, run by the same code
   (profile-routing's profile(), one prompt at a time, in a session opened from profile-routing's flags): each
   prompt is prefilled (teacher-forced) and then decoded greedily --decode-tokens steps at batch 1. The measured hit
   rate is the share of the routed pairs that land on the plan's residents, for the prompt tokens and for the
   decode steps apart; decode's standard error is over prompts (std of the per-prompt rates / sqrt(n)).
4. Report per budget: residents, the uniform-routing hit rate (residents / E: what a plan without statistics could
   expect), predicted and measured for decode and prefill, and the relative error |predicted - measured| / measured
   against --bound (default 0.15). stdout table; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from hybrid.errors import UsageError

DEFAULT_SHARES = "0.125,0.25,0.5"
DEFAULT_BOUND = 0.15
HUGE_BUDGET = str(2**50)  # a byte count no budget check refuses (DRAM here; VRAM for the probe plan)


# -- prompts ----------------------------------------------------------------------------------------------------------
def cut_prompts(text: str, tokenizer, count: int, tokens: int) -> list[str]:
    """`count` prompts of `tokens` tokens from `text`, at evenly spaced token offsets (overlapping only when the text
    holds fewer than count x tokens tokens), as text: the profiler and the measurement encode them as a user's
    prompts are encoded."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < tokens + 1:
        raise UsageError(f"the text has {len(ids)} tokens, fewer than one prompt of {tokens}")
    starts = np.linspace(0, len(ids) - tokens, num=count).round().astype(int)
    return [tokenizer.decode(ids[s:s + tokens], skip_special_tokens=False) for s in starts]


def corpus_texts(corpus: Path) -> tuple[str, str]:
    """(training text, held-out text) of a bench.corpus folder, documents joined by blank lines."""
    from bench.corpus import load_corpus

    train, heldout = load_corpus(corpus)
    return "\n\n".join(d.text for d in train), "\n\n".join(d.text for d in heldout)


def training_report(model: str) -> dict:
    """The model's training.json (bench.train_small), {} when there is none."""
    path = Path(model) / "training.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: unreadable ({exc})") from None


def default_corpus(model: str) -> Path:
    """The corpus bench.train_small reads by default ($HYBRID_CACHE/corpus) of the source the model's
    training.json names (shakespeare, train_small's default, when it names none)."""
    from bench.corpus import ensure_corpus

    return ensure_corpus(source=(training_report(model).get("corpus") or {}).get("source") or "shakespeare")


def check_heldout(model: str, corpus: Path) -> None:
    """Refuse a corpus whose held-out documents are not the ones the model was trained without."""
    from bench.corpus import read_manifest

    trained = (training_report(model).get("corpus") or {}).get("heldout")
    here = (read_manifest(corpus) or {}).get("heldout")
    if trained and here != trained:
        raise UsageError(f"{corpus}: its held-out documents {here} are not the ones {model} was trained without "
                         f"({trained}); give the corpus it was trained on with --corpus")


# -- the CLI's own steps -----------------------------------------------------------------------------------------------
def cli_args(command: str, argv: list[str]) -> argparse.Namespace:
    """The namespace `hybrid COMMAND ARGV...` would run with."""
    from hybrid.cli import build_parser

    return build_parser([command]).parse_args([command, *argv])


def profile_stats(model_flags: list[str], prompts: list[str], decode_tokens: int, folder: Path):
    """Routing statistics of `prompts` written by `hybrid profile-routing` -> (stats file, RoutingStats)."""
    from hybrid.commands import profile_routing
    from placement.routing_stats import load_stats

    prompt_file, stats_file = folder / "profile-prompts.jsonl", folder / "routing-stats.json"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    profile_routing.run(cli_args("profile-routing", [*model_flags, "--prompts", str(prompt_file), "--out",
                                                     str(stats_file), "--decode-tokens", str(decode_tokens)]))
    return stats_file, load_stats(stats_file)


def plan_for(model: str, stats_file: Path, gpu_budget: str, plan_flags: list[str]):
    """`hybrid plan --model MODEL --stats FILE --gpu-budget SIZE` at batch 1 -> its Plan."""
    from hybrid.commands.plan import build_plan

    args = cli_args("plan", ["--model", model, "--stats", str(stats_file), "--gpu-budget", gpu_budget,
                             "--cpu-budget", HUGE_BUDGET, "--max-batch", "1", *plan_flags])
    return build_plan(args)[0]


def resident_mask(plan, layers: tuple[int, ...], num_experts: int) -> np.ndarray:
    """bool [L, E] of a Plan's resident experts, rows in the statistics' layer order."""
    by_layer = {lp.layer: lp.resident_experts for lp in plan.layers}
    mask = np.zeros((len(layers), num_experts), dtype=bool)
    for row, layer in enumerate(layers):
        mask[row, list(by_layer.get(layer, ()))] = True
    return mask


def share_budget(probe, share: float, num_experts: int, moe_layers: int) -> tuple[str, int]:
    """(--gpu-budget in bytes, experts asked for) that holds round(share x E) experts per MoE layer beside the fixed
    part of `probe` (a plan of the same settings)."""
    g = probe.memory["gpu"]
    fixed = (g["non_expert"] + g["kv_cache"] + g["staging"] + g["graph_buffers"] + g.get("prefill_activations", 0)
             + g["reserve"])
    asked = round(share * num_experts) * moe_layers
    return str(fixed + asked * g["per_resident_expert"]), asked


# -- hit rates ---------------------------------------------------------------------------------------------------------
def hit_rates(counts: np.ndarray, resident: np.ndarray) -> tuple[float | None, list[float | None]]:
    """(overall, per layer) share of the routed pairs in `counts` [L, E] that fall on `resident` [L, E] experts;
    None where no pair was routed."""
    counts = np.asarray(counts, dtype=np.float64)
    hit = (counts * resident).sum(axis=1)
    total = counts.sum(axis=1)
    layers = [float(h / t) if t else None for h, t in zip(hit, total)]
    return (float(hit.sum() / total.sum()) if total.sum() else None), layers


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return abs(predicted - measured) / measured


def measure(session, prompts: list[str], decode_tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per held-out prompt: (prompt tokens' counts [L, E], decode steps' counts [L, E]), by profile-routing's own
    profile() (teacher-forced prefill, then greedy batch-1 decode steps)."""
    from hybrid.commands.profile_routing import profile

    out = []
    for text in prompts:
        ids = session.tokenizer.encode(text)
        if not ids:
            continue
        _, counts, _, _, dec, _ = profile(session.engine, [ids], window=len(ids) + decode_tokens,
                                          decode_tokens=decode_tokens)
        out.append((counts - dec, dec))
    if not out:
        raise UsageError("the held-out prompts encode to no tokens")
    return out


def budget_row(label: str, plan, stats, measured, asked: int | None) -> dict:
    """One budget's figures: residents, uniform share, predicted and measured hit rates, relative errors."""
    resident = resident_mask(plan, stats.layers, stats.num_experts)
    dec_counts = stats.decode_counts if stats.decode_counts is not None else np.zeros_like(stats.counts)
    pred_dec, pred_dec_layers = hit_rates(dec_counts, resident)
    pred_pre, pred_pre_layers = hit_rates(stats.counts - dec_counts, resident)
    meas_pre, meas_pre_layers = hit_rates(sum(p for p, _ in measured), resident)
    meas_dec, meas_dec_layers = hit_rates(sum(d for _, d in measured), resident)
    per_prompt = [r for r in (hit_rates(d, resident)[0] for _, d in measured) if r is not None]
    stderr = float(np.std(per_prompt, ddof=1) / math.sqrt(len(per_prompt))) if len(per_prompt) > 1 else None
    return {
        "budget": label, "gpu_budget_bytes": plan.gpu_budget_bytes, "residents_asked": asked,
        "residents": int(resident.sum()), "residents_per_layer": resident.sum(axis=1).tolist(),
        "uniform": float(resident.mean()),
        "predicted": {"decode": pred_dec, "prefill": pred_pre, "decode_layers": pred_dec_layers,
                      "prefill_layers": pred_pre_layers},
        "measured": {"decode": meas_dec, "prefill": meas_pre, "decode_layers": meas_dec_layers,
                     "prefill_layers": meas_pre_layers, "decode_stderr": stderr},
        "relative_error": {"decode": relative_error(pred_dec, meas_dec), "prefill": relative_error(pred_pre, meas_pre)},
    }


def plan_budgets(model: str, stats_file: Path, stats, budgets, plan_flags: list[str]) -> list[tuple[str, object, int]]:
    """[(label, Plan, residents asked or None)] of `hybrid plan` at each budget: a --gpu-budget as it is, a share of
    E per layer as the budget that holds it beside the fixed part (GPU weights in bf16 and the probe's prefill pass,
    so the part stays put)."""
    out, probe = [], None
    for kind, value in budgets:
        if kind == "share":
            flags = [*plan_flags, "--gpu-dtype", "bf16"]
            probe = probe or plan_for(model, stats_file, HUGE_BUDGET, flags)
            flags += ["--prefill-chunk", str(probe.settings["prefill_chunk"])]  # the probe's pass: the part stays put
            size, asked = share_budget(probe, value, stats.num_experts, len(stats.layers))
            out.append((f"share {value:g}", plan_for(model, stats_file, size, flags), asked))
        else:
            out.append((f"gpu-budget {value}", plan_for(model, stats_file, value, plan_flags), None))
    return out


# -- the run -----------------------------------------------------------------------------------------------------------
def run(model: str, corpus: Path, budgets: list[tuple[str, float | str]], profile_prompts: int, heldout_prompts: int,
        prompt_tokens: int, decode_tokens: int, model_flags: list[str] = (), plan_flags: list[str] = (),
        workdir: Path | None = None, bound: float = DEFAULT_BOUND) -> dict:
    """The whole check; `budgets`: ("share", S) or ("gpu-budget", SIZE) entries. Returns the report (see main)."""
    from hybrid.loading.session import open_session
    from hybrid.runtime.tokenizer import Tokenizer

    train_text, heldout_text = corpus_texts(corpus)
    check_heldout(model, corpus)
    tok = Tokenizer(model)
    train_prompts = cut_prompts(train_text, tok, profile_prompts, prompt_tokens)
    held_prompts = cut_prompts(heldout_text, tok, heldout_prompts, prompt_tokens)
    flags = ["--model", model, "--max-context", str(2 * prompt_tokens + decode_tokens), *model_flags]
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(str(workdir)) as folder:
        stats_file, stats = profile_stats(flags, train_prompts, decode_tokens, Path(folder))
        args = cli_args("profile-routing", flags)
        args.eager = True  # as profile-routing runs: its hooks do not run inside replayed CUDA graphs
        session = open_session(args, log=lambda _m: None)
        measured = measure(session, held_prompts, decode_tokens)
        plans = plan_budgets(model, stats_file, stats, budgets, list(plan_flags))
    rows = [budget_row(label, plan, stats, measured, asked) for label, plan, asked in plans]
    per_token = stats.topk * len(stats.layers)  # routed pairs a token adds to a [L, E] count
    return {"model": model, "corpus": str(corpus), "num_experts": stats.num_experts, "topk": stats.topk,
            "moe_layers": list(stats.layers), "bound": bound,
            "profile": {"prompts": len(train_prompts), "tokens": stats.tokens, "decode_tokens": stats.decode_tokens,
                        "source": "training documents"},
            "heldout": {"prompts": len(measured), "prefill_tokens": int(sum(p.sum() for p, _ in measured)) // per_token,
                        "decode_tokens": int(sum(d.sum() for _, d in measured)) // per_token},
            "budgets": rows}


def _fmt(x: float | None, pct: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:.1f}%" if pct else f"{x:.3f}")


def table(report: dict) -> str:
    head = (f"# hit rate | {report['model']} | {report['num_experts']} experts top-{report['topk']}, "
            f"{len(report['moe_layers'])} MoE layers | profile {report['profile']['tokens']} tokens "
            f"({report['profile']['decode_tokens']} decode) from training text | held out "
            f"{report['heldout']['prefill_tokens']} prompt + {report['heldout']['decode_tokens']} decode tokens")
    cols = ("budget", "residents", "uniform", "pred dec", "meas dec", "dec se", "rel err", "pred pre",
            "meas pre", "rel err")
    lines = [head, "  ".join(f"{c:>20}" if i == 0 else f"{c:>9}" for i, c in enumerate(cols))]
    for r in report["budgets"]:
        cells = [r["budget"], f"{r['residents']}" + (f"/{r['residents_asked']}" if r["residents_asked"] else ""),
                 _fmt(r["uniform"]), _fmt(r["predicted"]["decode"]), _fmt(r["measured"]["decode"]),
                 _fmt(r["measured"]["decode_stderr"]), _fmt(r["relative_error"]["decode"], False),
                 _fmt(r["predicted"]["prefill"]), _fmt(r["measured"]["prefill"]),
                 _fmt(r["relative_error"]["prefill"], False)]
        lines.append("  ".join(f"{c:>20}" if i == 0 else f"{c:>9}" for i, c in enumerate(cells)))
    return "\n".join(lines)


def parse_budgets(shares: str | None, gpu_budgets: str | None) -> list[tuple[str, float | str]]:
    if gpu_budgets:
        from hybrid.loading.parse import parse_bytes

        sizes = [s.strip() for s in gpu_budgets.split(",") if s.strip()]
        if not sizes:
            raise UsageError(f"--gpu-budget {gpu_budgets!r}: no size in it")
        for s in sizes:
            parse_bytes(s)  # a bad size fails here, before the model is loaded
        return [("gpu-budget", s) for s in sizes]
    out = []
    for s in (shares or DEFAULT_SHARES).split(","):
        try:
            v = float(s)
        except ValueError:
            raise UsageError(f"--resident-shares: {s!r} is not a number") from None
        if not 0 < v <= 1:
            raise UsageError(f"--resident-shares: {v} is not in (0, 1]")
        out.append(("share", v))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (a bench.train_small output)")
    p.add_argument("--corpus", type=Path, help="bench.corpus folder (default: train_small's, $HYBRID_CACHE/corpus)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resident-shares", help=f"residents per MoE layer as shares of E (default {DEFAULT_SHARES})")
    g.add_argument("--gpu-budget", help="comma-separated --gpu-budget sizes given to the planner as they are")
    p.add_argument("--profile-prompts", type=int, default=64)
    p.add_argument("--heldout-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--device", default="auto", help="where profiling and measuring run (cuda or cpu)")
    p.add_argument("--profile", help="hardware profile the planner prices with (default: hybrid plan's)")
    p.add_argument("--bound", type=float, default=DEFAULT_BOUND, help="relative error the check allows")
    p.add_argument("--keep", type=Path, help="keep the prompts and the routing statistics in this folder")
    p.add_argument("--out", help="write the report as JSON")
    a = p.parse_args(argv)
    for name in ("profile_prompts", "heldout_prompts", "prompt_tokens"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if a.decode_tokens < 1:
        raise UsageError("--decode-tokens must be >= 1 (decode is what residency serves)")
    budgets = parse_budgets(a.resident_shares, a.gpu_budget)
    corpus = a.corpus if a.corpus is not None else default_corpus(a.model)
    report = run(a.model, corpus, budgets, a.profile_prompts, a.heldout_prompts, a.prompt_tokens, a.decode_tokens,
                 model_flags=["--device", a.device], plan_flags=["--profile", a.profile] if a.profile else [],
                 workdir=a.keep, bound=a.bound)
    print(table(report))
    worst = max((e for r in report["budgets"] for e in r["relative_error"].values() if e is not None), default=None)
    print(f"largest relative error {_fmt(worst, False)} (bound {a.bound:g}): "
          f"{'within' if worst is not None and worst <= a.bound else 'NOT within'} the bound")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
