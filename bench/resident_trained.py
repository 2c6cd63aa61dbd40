"""Resident experts beside llama.cpp on a model whose routing was learned: batch-1 decode with a share of the experts
in VRAM, ours chosen by the placement planner from routing statistics, llama.cpp's as whole layers (-ncmoe), on
the same checkpoint; with --random, the same on a copy whose weights are drawn at random, so that learned routing
and random-weight routing are set side by side on one shape.

    python -m bench.resident_trained --model DIR --llama-bench PATH/llama-bench [--corpus FOLDER] [--share 0.25]
        [--random] [--prompts 16] [--prompt-tokens 64] [--decode-tokens 64] [--profile P] [--out FILE.json]

DIR is a bench.train_small checkpoint (--size wide has Qwen3-30B-A3B's expert widths, so decode reads DRAM as the
full model does). For each model (the trained one; with --random, its random-weight copy):
1. llama.cpp: the checkpoint written as a bf16 GGUF (bench.hf_to_gguf); llama-bench batch-1 decode of
   --decode-tokens with every expert on the CPU (-ot exps=CPU) and with -ncmoe L - round(share x L), llama.cpp's
   way to hold part of the experts in VRAM (the experts of the first layers stay on the CPU, the last
   round(share x L) layers' go to the GPU). llama-bench decodes tokens it draws at random, which routes unlike
   text; a whole-layer placement is hit by every token whatever its routing, so its speed does not depend on it.
2. ours, as a user runs it: `hybrid profile-routing` on 4 x --prompts prompts cut from the corpus's training
   documents (bench.hit_rate's steps), `hybrid plan --stats` at the VRAM budget that holds round(share x E) experts per MoE
   layer beside the fixed part (the planner may hold fewer where one more shortens no layer's decode), saved; then
   `hybrid generate`'s session opened with --plan FILE and with --gpu-experts 0 (every expert in DRAM); each of
   --prompts held-out prompts is prefilled and decoded greedily for --decode-tokens at batch 1 (CUDA graphs); the
   median over prompts of decode tok/s is reported.
A table (ratios ours / llama.cpp) on stdout; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from bench import hit_rate
from hybrid.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def write_random_copy(model: str, out: Path, seed: int) -> Path:
    """The checkpoint `model` with its weights drawn at random by transformers' initialisation (same config, same
    tokenizer files), written to `out` in bf16."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    m.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (Path(model) / name).is_file():
            shutil.copy(Path(model) / name, out / name)
    return out


def decode_speeds(model: str, placement: list[str], prompts: list[str], decode_tokens: int, flags: list[str]) -> dict:
    """Greedy batch-1 decode after each prompt in `hybrid generate`'s session with `placement` flags: the median
    of decode tok/s over prompts, and each prompt's."""
    import torch

    from hybrid.loading.session import open_session
    from hybrid.runtime.engine import Stats

    args = hit_rate.cli_args("generate", ["--model", model, *flags, *placement])
    s = open_session(args)
    try:
        speeds = []
        for text in prompts:
            ids = s.tokenizer.encode(text)
            s.engine.stats = Stats()
            s.engine.generate([ids], max_new_tokens=decode_tokens, stop_token_ids=[])
            speeds.append(s.engine.stats.decode_tps)
        resident = ([int(layer.is_resident.sum()) for layer in s.offload.layers]
                    if s.offload is not None else [])
    finally:
        del s
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"tok_s": statistics.median(speeds), "per_prompt": speeds, "residents_per_layer": resident,
            "flags": placement}


def run_one(model: str, corpus: Path, llama_bench: str | None, share: float, n_prompts: int, prompt_tokens: int,
            decode_tokens: int, profile: str | None, threads: int, reps: int, folder: Path) -> dict:
    """Both sides on one checkpoint (see the module's docstring)."""
    import transformers

    from bench.hf_to_gguf import convert
    from bench.vs_llamacpp import run_llama
    from hybrid.runtime.tokenizer import Tokenizer

    cfg = transformers.AutoConfig.from_pretrained(model)
    layers, experts = cfg.num_hidden_layers, getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    gpu_layers = round(share * layers)
    out: dict = {"model": model, "layers": layers, "experts": experts, "share": share}
    if llama_bench:
        gguf = convert(model, folder / "model-bf16.gguf", "bf16", progress=True)
        llama = {"none": run_llama(llama_bench, str(gguf), ["-ot", "exps=CPU"], threads, reps, gen=decode_tokens),
                 "share": run_llama(llama_bench, str(gguf), ["-ncmoe", str(layers - gpu_layers)], threads, reps,
                                    gen=decode_tokens)}
        gguf.unlink()
        out["llama"] = llama
    train_text, heldout_text = hit_rate.corpus_texts(corpus)
    tok = Tokenizer(model)
    train_prompts = hit_rate.cut_prompts(train_text, tok, n_prompts * 4, prompt_tokens)
    held_prompts = hit_rate.cut_prompts(heldout_text, tok, n_prompts, prompt_tokens)
    context = ["--max-context", str(2 * prompt_tokens + decode_tokens)]
    profiled = ["--profile", profile] if profile else []
    stats_file, stats = hit_rate.profile_stats(["--model", model, *context], train_prompts, 16, folder)
    (label, plan, asked), = hit_rate.plan_budgets(model, stats_file, stats, [("share", share)], profiled)
    plan_file = plan.save(folder / "plan.json")
    flags = [*context, *profiled]
    out["ours"] = {"none": decode_speeds(model, ["--gpu-experts", "0"], held_prompts, decode_tokens, flags),
                   "share": decode_speeds(model, ["--plan", str(plan_file)], held_prompts, decode_tokens, flags)}
    out["plan"] = {"budget": label, "gpu_budget_bytes": plan.gpu_budget_bytes, "residents_asked": asked}
    for side in ("ours", "llama"):
        if side in out:
            out[side]["speedup"] = out[side]["share"]["tok_s"] / out[side]["none"]["tok_s"]
    if "llama" in out:
        out["ratio"] = {k: out["ours"][k]["tok_s"] / out["llama"][k]["tok_s"] for k in ("none", "share")}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | placement | llama.cpp tok/s | ours tok/s | ratio |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        per_layer = r["ours"]["share"]["residents_per_layer"]
        for key, what in (("none", "every expert in DRAM"),
                          ("share", f"{r['share']:g} of the experts in VRAM (llama.cpp: {round(r['share'] * r['layers'])} "
                                    f"of {r['layers']} layers; ours: {sum(per_layer)} of {r['experts'] * r['layers']}"
                                    " planned)")):
            llama = r.get("llama", {}).get(key, {}).get("tok_s")
            ratio = r.get("ratio", {}).get(key)
            lines.append(f"| {r['label']} | {what} | {'-' if llama is None else f'{llama:.1f}'} | "
                         f"{r['ours'][key]['tok_s']:.1f} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import os

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (a bench.train_small output)")
    p.add_argument("--llama-bench", help="llama-bench binary (none: ours only)")
    p.add_argument("--corpus", type=Path, help="bench.corpus folder (default: train_small's, $HYBRID_CACHE/corpus)")
    p.add_argument("--share", type=float, default=0.25, help="share of the experts in VRAM (default 0.25)")
    p.add_argument("--random", action="store_true", help="also a random-weight copy of the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="the random copy's seed")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts decoded (4x as many profiled)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--profile", help="hardware profile the planner and the scheduler price with")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads (default: every core)")
    p.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    p.add_argument("--out", help="write the rows as JSON")
    a = p.parse_args(argv)
    if not 0 < a.share < 1:
        raise UsageError(f"--share {a.share}: give a share in (0, 1)")
    if min(a.prompts, a.prompt_tokens, a.decode_tokens) < 1:
        raise UsageError("--prompts, --prompt-tokens and --decode-tokens must be >= 1")
    corpus = a.corpus if a.corpus is not None else hit_rate.default_corpus(a.model)
    hit_rate.check_heldout(a.model, corpus)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [("trained", a.model)]
        if a.random:
            models.append(("random weights", str(write_random_copy(a.model, Path(tmp) / "random", a.seed))))
        for label, model in models:
            folder = Path(tmp) / label.replace(" ", "_")
            folder.mkdir()
            row = run_one(model, corpus, a.llama_bench, a.share, a.prompts, a.prompt_tokens, a.decode_tokens,
                          a.profile, a.threads, a.reps, folder)
            rows.append(dict(row, label=label, model=a.model if label == "trained" else f"{a.model} (random copy)"))
            print(table(rows[-1:]), flush=True)
            if a.out:  # after each model: a later one's failure keeps the earlier rows
                Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
