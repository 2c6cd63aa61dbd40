"""Quantized GPU weights end to end, as a user runs them: `hybrid generate --json` once per --gpu-dtype in a fresh
process, with the GPU's memory sampled by nvidia-smi while it runs, beside `hybrid plan`'s VRAM figure for the same
settings.

    python -m bench.gpu_weights --model DIR --gpu-dtypes bf16,int8,int4 --cpu-dtype int4 \\
        [--gpu-budget 24GiB] [--max-context 32768] [--prompt-tokens 2048] [--decode-tokens 128] --out FILE.json

Per dtype: load seconds, prefill and decode tokens/s (batch 1, CUDA graphs), the process's peak VRAM (the most
nvidia-smi saw above what was in use before it started: CUDA context, allocator slack and all), the plan's
gpu_bytes, the GPU dtype of each part, and the greedy tokens (the same for bf16 before and after a change to the
GPU weights: compare two runs' files). Needs CUDA and nvidia-smi.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

WORDS = "the quick brown fox jumps over the lazy dog while seven wise owls count their silver coins ".split()


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[0])


class VramSampler:
    """The largest GPU memory in use seen every `period` seconds while running (MiB)."""

    def __init__(self, period: float = 0.05):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, gpu_used_mib())
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def common_flags(args, dtype: str) -> list[str]:
    flags = ["--model", args.model, "--gpu-dtype", dtype, "--max-context", str(args.max_context)]
    if args.cpu_dtype:
        flags += ["--cpu-dtype", args.cpu_dtype]
    if args.gpu_budget:
        flags += ["--gpu-budget", args.gpu_budget]
    return flags


def planned(args, dtype: str) -> dict | None:
    """`hybrid plan`'s VRAM for the same settings (None without --gpu-budget: nothing is planned)."""
    if not args.gpu_budget:
        return None
    cmd = [sys.executable, "-m", "hybrid", "plan", *common_flags(args, dtype), "--cpu-budget", args.cpu_budget,
           "--json"]
    if args.profile:
        cmd += ["--profile", args.profile]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip()}
    plan = json.loads(p.stdout)
    return {"gpu_bytes": plan["gpu_bytes"], "gpu_dtypes": plan["settings"].get("gpu_dtypes"),
            "memory": plan["memory"]["gpu"]}


def run_one(args, dtype: str) -> dict:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_tokens))
    cmd = [sys.executable, "-m", "hybrid", "generate", *common_flags(args, dtype), "--json", "-n",
           str(args.decode_tokens), "--prompt", prompt]
    if args.profile:
        cmd += ["--profile", args.profile]
    base = gpu_used_mib()
    with VramSampler() as vram:
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        return {"gpu_dtype": dtype, "error": p.stderr.strip()[-2000:]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    gpu_line = next((ln for ln in p.stderr.splitlines() if ln.startswith("GPU weights:")), "")
    return {"gpu_dtype": dtype, "gpu_weights": gpu_line, "load_s": out["load_s"],
            "prefill_tokens": out["prefill_tokens"], "prefill_tokens_per_s": out["prefill_tokens_per_s"],
            "decode_tokens": out["decode_tokens"], "decode_tokens_per_s": out["decode_tokens_per_s"],
            # the device's use before the process started beside it: another process's memory there (or freed
            # while this one ran) makes the difference meaningless
            "peak_vram_mib": vram.peak - base, "base_vram_mib": base, "generated_token_ids": out["generated_token_ids"],
            # the device's memory after each start-up step (hybrid.loading.session.vram_mark), bytes
            "phases": out.get("vram", []), "plan": planned(args, dtype),
            # generate's own lines (placement, load split, warnings), progress bars left out
            "log": [ln.split("\r")[-1] for ln in p.stderr.splitlines() if ln.strip() and "it/s" not in ln][-25:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--gpu-dtypes", default="bf16,int8,int4", help="comma-separated --gpu-dtype values to run")
    p.add_argument("--cpu-dtype")
    p.add_argument("--gpu-budget", help="passed to generate and plan (auto then chooses under it)")
    p.add_argument("--cpu-budget", default="1TiB", help="for the plan only (default %(default)s)")
    p.add_argument("--profile")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="words in the prompt (about one token each)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    rows = []
    for dtype in args.gpu_dtypes.split(","):
        row = run_one(args, dtype)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "generated_token_ids"}), flush=True)
    ref = next((r for r in rows if r.get("gpu_dtype") == "bf16" and "error" not in r), None)
    for r in rows:
        if ref is not None and "error" not in r:
            toks = r["generated_token_ids"]
            r["greedy_agreement_with_bf16"] = sum(a == b for a, b in zip(toks, ref["generated_token_ids"])) / max(1, len(toks))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
