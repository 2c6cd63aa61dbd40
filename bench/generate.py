"""All-in-VRAM generation throughput: the ceiling the hybrid runtime is compared to.

Prefill tokens/s for one prompt of each length, and decode tokens/s at several batch sizes with the
effective HBM bandwidth of decode (bytes a step must read / step time) against the measured copy
bandwidth of the device. Decode runs in CUDA graphs unless --eager.

    python -m bench.generate --out generate.json                      # Qwen3-30B-A3B shape, 48 layers
    python -m bench.generate --layers 12 --prefill 512,2048 --decode-batch 1,8
    python -m bench.generate --checkpoint DIR                          # a checkpoint on disk instead
    python -m bench.generate --device cpu --preset demo --prefill 64 --decode-batch 1,4   # smoke test

Without --checkpoint the weights are drawn at random directly in device memory (N(0, 0.02); nothing
is read from disk): the shapes and therefore the speed are the real model's, the text is not. Random
routers route nearly uniformly, which is the worst case for decode bytes (most experts active).
Bytes per decode step = non-expert weights (minus the embedding table, of which B rows are read) +
the distinct experts the step's tokens touched in each layer (counted in one instrumented eager step)
+ the K/V the step attends over (the graphs attend over the whole cache: --decode-context positions).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from hybrid.models import build_empty, init_random_, load_model
from hybrid.models.families import family_for
from hybrid.models.presets import PRESETS, hf_config
from hybrid.runtime import Engine


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev, nbytes=2 << 30) -> float | None:
    """Device-to-device copy GB/s (read + write bytes / time), best of 5."""
    if dev.type != "cuda":
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        sync(dev)
        t = time.perf_counter()
        b.copy_(a)
        sync(dev)
        best = max(best, 2 * nbytes / (time.perf_counter() - t) / 1e9)
    del a, b
    return best


def gemm_peak(dev, dtype, n=8192) -> float | None:
    """Best bf16 n x n x n matmul TFLOP/s of 10: the compute ceiling prefill is compared to."""
    if dev.type != "cuda":
        return None
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(10):
        sync(dev)
        t = time.perf_counter()
        a @ b
        sync(dev)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e12)
    return best


class CountingExperts(torch.nn.Module):
    """Wraps an executor and records how many distinct experts each call touched."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.active = inner, []

    def forward(self, x, ids, w):
        self.active.append(int(torch.unique(ids).numel()))
        return self.inner(x, ids, w)


def check_dram(args, dev, dtype) -> None:
    """Refuse in one line (exit 2) a model this machine's DRAM cannot hold (on the CPU every weight is there:
    the default, all 48 layers of Qwen3-30B-A3B in fp32, is ~120 GB), before minutes of building it end in
    the OOM killer (hybrid.loading.dram)."""
    from hybrid.loading.dram import check_dram_fits, model_dram
    from hybrid.models.families import family_for

    if args.checkpoint:
        from hybrid.models import read_config

        cfg = read_config(args.checkpoint)[1]
    else:
        raw = hf_config(args.preset, layers=args.layers)
        cfg = family_for(raw).parse_config(raw)
    # the prefill engine (one slot of the longest prompt) and the decode engine (the largest batch) in turn
    shapes = [(max(args.prefill or [1]) + 1, 1), (args.decode_context + args.decode_steps + 8, max(args.decode_batch or [1]))]
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    need = max((model_dram(cfg, dev.type != "cuda", dtype_bytes, None, c, b) for c, b in shapes), key=lambda n: n.total)
    what = args.checkpoint or f"{args.preset} x {cfg.num_layers} layers"
    check_dram_fits(need, f"{what} in {str(dtype).replace('torch.', '')} on {dev.type}",
                    "use fewer --layers, or --preset demo" + (" (or a CUDA device)" if dev.type != "cuda" else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="first N decoder layers only (default: all)")
    p.add_argument("--checkpoint", help="load this checkpoint directory instead of random in-memory weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prefill", type=ints, default=[512, 2048, 8192])
    p.add_argument("--decode-batch", type=ints, default=[1, 8, 32])
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens per sequence before decoding")
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--moe-path", default="auto", choices=["auto", "grouped", "dense"],
                   help="StackedExperts mode (hybrid/models/moe.py)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    check_dram(args, dev, dtype)
    t0 = time.perf_counter()
    if args.checkpoint:
        model = load_model(args.checkpoint, device=dev, dtype=dtype)
        source = f"checkpoint {args.checkpoint}"
    else:
        raw = hf_config(args.preset, layers=args.layers)
        model = init_random_(build_empty(family_for(raw).parse_config(raw), dev, dtype), seed=0)
        source = "random weights generated in device memory"
    sync(dev)
    load_s = time.perf_counter() - t0
    for layer in model.layers:
        if layer.moe is not None:
            layer.moe.experts.mode = args.moe_path
    cfg = model.cfg
    esize = torch.tensor([], dtype=dtype).element_size()
    counts = cfg.param_counts()
    expert_bytes = cfg.expert_params * esize
    other_bytes = (counts["non_expert"] - cfg.vocab_size * cfg.hidden_size) * esize  # embedding rows ~free
    hbm = copy_bandwidth(dev)
    peak = gemm_peak(dev, dtype)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    header = {
        "bench": "generate", "device": gpu, "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "preset": args.preset if not args.checkpoint else cfg.family, "layers": cfg.num_layers,
        "experts": cfg.num_experts, "top_k": cfg.experts_per_token, "hidden": cfg.hidden_size,
        "expert_intermediate": cfg.expert_intermediate_size, "vocab": cfg.vocab_size,
        "params_experts_B": round(counts["experts"] / 1e9, 3), "params_other_B": round(counts["non_expert"] / 1e9, 3),
        "weights": source, "load_s": round(load_s, 1), "cuda_graphs": dev.type == "cuda" and not args.eager,
        "moe_path": args.moe_path,
        "copy_GBps": round(hbm, 1) if hbm else None, "gemm_peak_TFLOPs": round(peak, 1) if peak else None,
    }
    print("# " + " ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    results = {"header": header, "prefill": [], "decode": []}
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()

    # Prefill: one sequence per length, eager (as the engine runs it).
    if args.prefill:
        eng = Engine(model, max_batch=1, max_context=max(args.prefill) + 1, eager=True)
        for n in args.prefill:
            times = []
            for r in range(args.repeats + 1):
                slot = eng.allocate_slot()
                ids = tokens(n)
                sync(dev)
                t = time.perf_counter()
                eng.prefill(slot, ids)
                sync(dev)
                if r:  # the first run warms up
                    times.append(time.perf_counter() - t)
                eng.free_slot(slot)
            s = statistics.median(times)
            # FLOPs: 2 x active params per token (K experts + everything but the embedding table),
            # plus causal attention (QK^T and PV: 2 * 2 * n/2 * H * hd per token per layer).
            active = counts["non_expert"] - cfg.vocab_size * cfg.hidden_size + cfg.num_moe_layers * cfg.experts_per_token * cfg.expert_params
            flops = 2 * n * active + 2 * n * n * cfg.num_heads * cfg.head_dim * cfg.num_layers
            row = {"tokens": n, "seconds": round(s, 4), "tokens_per_s": round(n / s, 1),
                   "TFLOPs": round(flops / s / 1e12, 1),
                   "fraction_of_gemm_peak": round(flops / s / 1e12 / peak, 3) if peak else None}
            results["prefill"].append(row)
            print(f"prefill {n:6d} tokens: {s * 1e3:9.1f} ms  {n / s:10.1f} tok/s  {flops / s / 1e12:6.1f} TFLOP/s"
                  + (f" ({row['fraction_of_gemm_peak']:.0%} of GEMM peak)" if peak else ""), flush=True)
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # Decode: B sequences of --decode-context tokens, then --decode-steps steps of all B together.
    if args.decode_batch:
        ctx = args.decode_context + args.decode_steps + 8
        eng = Engine(model, max_batch=max(args.decode_batch), max_context=ctx, eager=args.eager or dev.type != "cuda")
        kv_bytes_per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * esize
        for B in args.decode_batch:
            slots = [eng.allocate_slot() for _ in range(B)]
            last = [int(eng.prefill(s, tokens(args.decode_context)).argmax()) for s in slots]
            eng.decode_step(slots, last)  # warm-up (captures the graphs the first time)
            for s in slots:
                eng.lengths[s] = args.decode_context  # rewind: keep every run at the same context
            sync(dev)
            t = time.perf_counter()
            for _ in range(args.decode_steps):
                last = eng.decode_step(slots, last).argmax(-1).tolist()
            sync(dev)
            s_step = (time.perf_counter() - t) / args.decode_steps
            # Count the experts one step touches, in one instrumented eager step.
            wrapped = []
            for layer in model.layers:
                if layer.moe is not None:
                    layer.moe.experts = CountingExperts(layer.moe.experts)
                    wrapped.append(layer.moe)
            with torch.no_grad():
                pos = torch.tensor([[eng.lengths[s]] for s in slots], device=dev)
                model(torch.tensor(last, device=dev)[:, None], pos, torch.tensor(slots, device=dev), eng.cache,
                      last_only=True, kv_len=int(pos.max()) + 1)
            active = [m.experts.active[0] for m in wrapped]
            for m in wrapped:
                m.experts = m.experts.inner
            kv_positions = (ctx if eng.graphs is not None else args.decode_context + args.decode_steps // 2)
            step_bytes = other_bytes + sum(active) * expert_bytes + B * kv_positions * kv_bytes_per_pos
            gbps = step_bytes / s_step / 1e9
            row = {"batch": B, "step_ms": round(s_step * 1e3, 3), "tokens_per_s": round(B / s_step, 1),
                   "active_experts_per_layer": round(sum(active) / len(active), 1),
                   "bytes_per_step_GB": round(step_bytes / 1e9, 3), "effective_HBM_GBps": round(gbps, 1),
                   "fraction_of_copy_bw": round(gbps / hbm, 3) if hbm else None}
            results["decode"].append(row)
            print(f"decode batch {B:3d}: {s_step * 1e3:8.2f} ms/step  {B / s_step:9.1f} tok/s  "
                  f"{row['active_experts_per_layer']:5.1f} experts/layer  {gbps:7.1f} GB/s"
                  + (f" ({gbps / hbm:.0%} of copy bandwidth)" if hbm else ""), flush=True)
            for s in slots:
                eng.free_slot(s)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
