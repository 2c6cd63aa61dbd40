"""Write a Hugging Face-layout checkpoint with random weights for a preset shape.

    python -m bench.make_checkpoint --preset qwen3-30b-a3b --layers 8 --out /tmp/q3-30b-8l
    python -m bench.make_checkpoint --preset deepseek-v3 --layers 5 --fp8 --device cuda --out /tmp/dsv3-5l
    python -m bench.make_checkpoint --preset gpt-oss-120b --layers 4 --mxfp4 --device cuda --out /tmp/gpt-oss-4l
    python -m bench.make_checkpoint --preset deepseek-v3 --fp8 --experts 8 --top-k 4 --device cuda --out /tmp/dsv3-full
    python -m bench.make_checkpoint --preset deepseek-v3 --layers 5 --device cuda --gguf bf16 --out /tmp/dsv3-5l.gguf
    python -m bench.make_checkpoint --list

Presets (hybrid/models/presets.py) copy the published config.json of Qwen3-30B-A3B, Qwen3-235B-A22B,
Mixtral-8x7B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, DeepSeek-V3, Kimi-K2, GLM-4.5 and gpt-oss-120b; --layers keeps
the first N decoder layers (a whole model in bf16 is tens to hundreds of GB: a cut one fits a small disk and still
has every layer's shape); --experts / --top-k cut the routed experts instead (every layer at its real widths, a
few experts each, for the non-expert side's VRAM at full depth; routing groups become one group). By default
a generic byte-level BPE tokenizer (hybrid.runtime.demo.build_tokenizer: ~1k tokens, all ids valid in every
preset's vocabulary) is written in and padded with placeholder tokens `<idN>` up to the preset's vocab_size,
so `hybrid generate --model OUT` runs and every id the random model generates shows as text (without the
padding, ids past the ~1k real tokens decoded to nothing: empty output); --tokenizer none skips it. The
weights are N(0, 0.02): throughput is meaningful, the text is not. --gguf TYPE writes the same shape as one GGUF
file instead (bench.hf_to_gguf.write_random: llama.cpp's converter's names and metadata, the tokenizer in it, a
tensor at a time with no checkpoint first), e.g. a bf16 file for llama.cpp's llama-quantize to make any of its
types from, for side by sides on one file.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybrid.errors import UsageError
from hybrid.models.presets import PRESETS, hf_config
from hybrid.models.writer import write_random_checkpoint


def write_tokenizer(out, vocab_size: int) -> int:
    """Writes hybrid.runtime.demo's generic byte-level BPE (~1k tokens, ChatML template) into folder `out`, padded to
    vocab_size; returns its size. Not the packaged demo's own tokenizer: its 2048 tokens outnumber the demo
    preset's 1088 ids, where this one's fit every preset's vocabulary."""
    from pathlib import Path

    from hybrid.runtime.demo import build_tokenizer, pad_tokenizer

    build_tokenizer(Path(out))
    return pad_tokenizer(Path(out) / "tokenizer.json", vocab_size)


EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")


def cut_experts(raw: dict, experts: int | None, top_k: int | None) -> None:
    """Sets the routed expert count and top-k of config `raw` in place. Group-limited routing (DeepSeek-V3's n_group
    / topk_group) becomes one group, since the preset's groups need not divide the new count."""
    key = next((k for k in EXPERT_KEYS if k in raw), None)
    if key is None and (experts or top_k):
        raise UsageError("--experts / --top-k: this preset has no routed experts")
    n = experts or (raw[key] if key else 0)
    if experts is not None:
        if experts < 1 or experts > raw[key]:
            raise UsageError(f"--experts must be in 1..{raw[key]}, got {experts}")
        raw[key] = experts
        if "n_group" in raw:
            raw["n_group"] = raw["topk_group"] = 1
    for k in TOP_K_KEYS:
        if k in raw:
            want = top_k if top_k is not None else min(raw[k], n)
            if not 1 <= want <= n:
                raise UsageError(f"--top-k must be in 1..{n}, got {want}")
            raw[k] = want


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    p.add_argument("--out", help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--fp8", action="store_true", help="linear weights as block-FP8 (float8_e4m3fn + 128x128 "
                   "weight_scale_inv), as DeepSeek-V3 / Kimi-K2 publish them; the rest in --dtype")
    p.add_argument("--mxfp4", action="store_true", help="gpt-oss: experts as MXFP4 blocks + scales with the "
                   "quantization_config openai publishes (quantized on the host, one expert at a time: ~1 s per "
                   "gpt-oss-120b expert on 2 cores); the rest in --dtype")
    p.add_argument("--experts", type=int, help="routed experts per MoE layer (default: the preset's)")
    p.add_argument("--top-k", type=int, help="experts per token (default: the preset's, at most --experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is much faster)")
    p.add_argument("--tokenizer", default="demo", choices=["demo", "none"],
                   help="write a ~1k-token byte-level BPE tokenizer padded to the vocabulary (default) or none")
    p.add_argument("--gguf", metavar="TYPE", choices=("bf16", "f16", "f32", "q8_0", "q4_0"),
                   help="write --out as one GGUF file with its weight matrices in TYPE (bf16, f16, f32, q8_0, q4_0)")
    p.add_argument("--list", action="store_true", help="list presets with their sizes and exit")
    args = p.parse_args(argv)
    from hybrid.models.families import family_for

    if args.list or not args.out:
        for name in PRESETS:
            raw = hf_config(name)
            cfg = family_for(raw).parse_config(raw)
            n = cfg.param_counts()
            print(f"{name:20s} {raw['model_type']:10s} layers={cfg.num_layers:3d} experts={cfg.num_experts:3d} "
                  f"top-{cfg.experts_per_token}  params: experts {n['experts'] / 1e9:7.2f} B, "
                  f"other {n['non_expert'] / 1e9:6.2f} B")
        return 0 if args.list else 2
    if args.fp8 and args.mxfp4:
        p.error("give --fp8 or --mxfp4, not both")
    try:
        raw = hf_config(args.preset, layers=args.layers)
    except ValueError as exc:  # --layers outside the preset's
        raise UsageError(f"--layers: {exc}") from None
    cut_experts(raw, args.experts, args.top_k)
    t0 = time.perf_counter()
    if args.gguf:
        if args.fp8 or args.mxfp4 or args.tokenizer == "none":
            p.error("--gguf writes its own matrix type and tokenizer: no --fp8, --mxfp4 or --tokenizer none")
        from bench.hf_to_gguf import write_random

        out = write_random(raw, args.out, write_tokenizer, args.gguf, seed=args.seed, device=args.device, progress=True)
        print(f"wrote {out} ({raw['num_hidden_layers']} layers of {args.preset}, {args.gguf} GGUF, random weights, "
              f"{out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
        return 0
    out = write_random_checkpoint(args.out, raw, seed=args.seed, dtype=getattr(torch, args.dtype),
                                  device=args.device, progress=True, fp8_block=(128, 128) if args.fp8 else None,
                                  mxfp4=args.mxfp4)
    if args.tokenizer == "demo":
        write_tokenizer(out, raw["vocab_size"])
    quant = " + fp8" if args.fp8 else " + mxfp4 experts" if args.mxfp4 else ""
    print(f"wrote {out} ({raw['num_hidden_layers']} layers of {args.preset}, {args.dtype}{quant}, "
          "random weights) "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
