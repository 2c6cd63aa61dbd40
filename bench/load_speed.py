"""First-load speed: `hybrid generate --model DIR` as a user runs it, timed per --cpu-dtype.

For each CPU dtype, three fresh processes (`hybrid generate --model DIR --cpu-dtype DT -n 1`):

    convert   --no-cache: the checkpoint's experts converted (de-quantized, quantized, packed) for the CPU executor
    write     the packed cache missed: converted again and written to the cache
    hit       the packed cache hit: the packed bytes copied back, no conversion

Each row gives the load's seconds and GB/s of checkpoint (every safetensors or GGUF byte / the load's seconds, from
the "loaded in ..." line hybrid prints, whose read / convert / upload / cache split is shown as printed), the whole
start a user waits for (generate's own "loaded in ... (warm-up ...)" line: the checkpoint's headers, the weights,
the tokenizer, the placement and the warm-up), and the process's memory sampled from /proc every 10 ms: peak
anonymous memory (RssAnon), the anonymous memory once the load is done (settled: when that line appears), their
difference (the conversion's staging), and VmHWM (peak resident memory, page cache of the memory-mapped checkpoint
included); and the process's CPU seconds (user + system, the whole run: a figure that other load on the machine
does not inflate as it does the wall time).

With --prompt-words N each process also runs a first prompt of N words and --decode-tokens after its warm-up
(generate --json), so a restart's first prompt is timed beside a process that converted (its packed bytes just
written): the last line per dtype gives the ratios.

The checkpoint is read once before the runs (its GB/s is printed: the disk's, or the page cache's when the
files were already cached), so every run reads it from the page cache alike. The packed caches go to a fresh
HYBRID_CACHE under --scratch (this machine's calibrated profile.json is copied in), removed at the end.

    python -m bench.make_checkpoint --preset qwen3-30b-a3b --layers 12 --out /data/q3-12l
    python -m bench.load_speed --model /data/q3-12l                              # bf16, int8, int4
    python -m bench.load_speed --model /data/dsv3-cut --cpu-dtype int8 --runs convert --json out.json
    python -m bench.load_speed --model /data/q3-q4_0.gguf --cpu-dtype default      # a GGUF file, its own format
    python -m bench.load_speed --model /data/dsv3 --cpu-dtype int4 -- --gpu-dtype int4 --gpu-budget 24GiB

Arguments after `--` go to every `hybrid generate` process as they are (GPU dtype, budget, context).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RUNS = ("convert", "write", "hit")
WORDS = "the quick brown fox jumps over the lazy dog while seven wise owls count their silver coins ".split()
LOAD_LINE = re.compile(r"loaded in ([\d.]+) s: read ([\d.]+) s, convert ([\d.]+) s, upload ([\d.]+) s, cache .*")
# generate's own line: the whole start a user waits for (the checkpoint's headers, the weights, the tokenizer, the
# placement and the warm-up), where LOAD_LINE is the weights' part
START_LINE = re.compile(r"loaded in ([\d.]+) s \(warm-up ([\d.]+) s.*")
FIELDS = ("RssAnon", "VmRSS", "VmHWM")


def checkpoint_files(model: Path) -> list[Path]:
    """A folder's safetensors files, or a GGUF file's parts."""
    if model.suffix == ".gguf" and model.is_file():
        from hybrid.models.gguf.files import split_parts

        return split_parts(model)
    return sorted(model.rglob("*.safetensors"))


def checkpoint_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in checkpoint_files(model))


def read_once(model: Path) -> float:
    """Reads every safetensors file sequentially; returns GB/s."""
    t0, n = time.perf_counter(), 0
    for f in checkpoint_files(model):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


def memory_kib(pid: int) -> dict[str, int]:
    """RssAnon, VmRSS and VmHWM of a live process in KiB ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0])
    except OSError:
        return {}
    return out


def prompt_of(words: int) -> str:
    """A prompt of `words` words (about a token each; "hello" for 0)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(words)) if words else "hello"


def run_once(model: Path, dtype: str, no_cache: bool, env: dict, prompt_words: int = 0, decode: int = 1,
             generate_args: tuple[str, ...] = ()) -> dict:
    """One `hybrid generate` process: its load line and its memory (GiB), sampled while it runs; with prompt_words,
    the first prompt's prefill and decode tokens/s (generate --json, after its warm-up). generate_args: more of
    generate's options, as they are."""
    chosen = ["--gpu-experts", "0"] if dtype == "default" else ["--cpu-dtype", dtype]  # default: the file's own
    cmd = [sys.executable, "-m", "hybrid", "generate", "--model", str(model), *chosen, "-n", str(decode),
           "--prompt", prompt_of(prompt_words), *generate_args] + (["--no-cache"] if no_cache else []) + \
        (["--json"] if prompt_words else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if prompt_words else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    peak = {k: 0 for k in FIELDS}
    state = {"settled": None, "line": None, "start": None, "tail": []}

    running = threading.Event()
    running.set()

    def sample():
        while running.is_set():
            m = memory_kib(proc.pid)
            for k, v in m.items():
                peak[k] = max(peak[k], v)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for raw in proc.stderr:
        for part in re.split(rb"[\r\n]", raw):
            text = part.decode(errors="replace").strip()
            if not text:
                continue
            state["tail"] = (state["tail"] + [text])[-5:]
            if state["line"] is None and LOAD_LINE.fullmatch(text):
                state["line"], state["settled"] = text, memory_kib(proc.pid)
            elif state["start"] is None and START_LINE.fullmatch(text):
                state["start"] = float(START_LINE.fullmatch(text).group(1))
    out = proc.stdout.read() if prompt_words else b""
    _, status, usage = os.wait4(proc.pid, 0)  # its CPU seconds: contention-proof beside the wall time
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    running.clear()
    sampler.join()
    if rc != 0 or state["line"] is None:
        raise SystemExit(f"load_speed: `{' '.join(cmd)}` failed (exit {rc}): {' | '.join(state['tail'])}")
    total, read, convert, upload = (float(v) for v in LOAD_LINE.fullmatch(state["line"]).groups())
    gib = 1 / 2**20
    settled = state["settled"] or {}
    first = {}
    if prompt_words:  # the first prompt's speeds, as generate --json reports them
        res = json.loads(out.decode().strip().splitlines()[-1])
        first = dict(prefill_tokens=res["prefill_tokens"], prefill_tok_s=res["prefill_tokens_per_s"],
                     decode_tok_s=res["decode_tokens_per_s"])
        state["start"] = state["start"] if state["start"] is not None else res["load_s"]  # --json: the same figure
    return dict(load_s=total, start_s=state["start"], read_s=read, convert_s=convert, upload_s=upload, **first,
                line=state["line"],
                process_cpu_s=usage.ru_utime + usage.ru_stime,
                peak_anon_gib=peak["RssAnon"] * gib, settled_anon_gib=settled.get("RssAnon", 0) * gib,
                peak_hwm_gib=peak["VmHWM"] * gib, settled_rss_gib=settled.get("VmRSS", 0) * gib)


def scratch_cache(scratch: Path) -> Path:
    """A fresh HYBRID_CACHE holding this machine's profile.json (so the scheduler is priced as usual)."""
    scratch.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="load-speed-", dir=scratch))
    from cpu_kernels.knobs import knobs

    home = knobs().cache
    if (home / "profile.json").is_file():
        shutil.copy(home / "profile.json", root / "profile.json")
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load_speed", description=__doc__.split("\n\n")[0],
                                 epilog="arguments after `--` go to every `hybrid generate` process as they are, e.g. "
                                        "`-- --gpu-dtype int4 --gpu-budget 24GiB`")
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory, or a GGUF file")
    ap.add_argument("--cpu-dtype", default="bf16,int8,int4",
                    help="comma-separated CPU dtypes (default bf16,int8,int4); `default`: none given, the checkpoint's "
                    "own default (a GGUF file's: the format nearest its blocks)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--scratch", type=Path, default=Path("~/.cache").expanduser(),
                    help="folder for the temporary packed caches (default ~/.cache; removed at the end)")
    ap.add_argument("--prompt-words", type=int, default=0,
                    help="also time each process's first prompt of this many words (generate --json, after its "
                         "warm-up): a restart's first prompt beside a converting process's (default 0: a one-word "
                         "prompt, not timed)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after that prompt (default 32)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, generate_args = ap.parse_args(argv[:cut]), tuple(argv[cut + 1:])
    runs = [r for r in args.runs.split(",") if r]
    is_gguf = args.model.suffix == ".gguf" and args.model.is_file()
    if not (args.model.is_dir() or is_gguf) or any(r not in RUNS for r in runs):
        ap.error(f"--model must be a checkpoint folder or a GGUF file and --runs a subset of {','.join(RUNS)}")
    total = checkpoint_bytes(args.model)
    print(f"checkpoint {args.model}: {total / 1e9:.2f} GB, read once at {read_once(args.model):.2f} GB/s; "
          f"{os.cpu_count()} cpus", flush=True)
    root = scratch_cache(args.scratch)
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_NO_PROGRESS"} | {"HYBRID_CACHE": str(root)}
    rows = []
    try:
        for dtype in [d for d in args.cpu_dtype.split(",") if d]:
            for run in runs:
                if run == "hit" and "write" not in runs and not any(r["dtype"] == dtype for r in rows):
                    run_once(args.model, dtype, False, env, generate_args=generate_args)  # the cache a hit needs
                decode = args.decode_tokens if args.prompt_words else 1
                r = dict(dtype=dtype, run=run, **run_once(args.model, dtype, run == "convert", env, args.prompt_words,
                                                           decode, generate_args))
                r["gbps"] = total / 1e9 / max(r["load_s"], 1e-9)
                rows.append(r)
                extra = r["peak_anon_gib"] - r["settled_anon_gib"]
                start = "-" if r["start_s"] is None else f"{r['start_s']:.1f}"
                print(f"{dtype:5s} {run:8s} {r['load_s']:6.1f} s  {r['gbps']:5.2f} GB/s  (whole start {start} s; "
                      f"process cpu {r['process_cpu_s']:5.1f} s)  anon peak "
                      f"{r['peak_anon_gib']:5.2f} GiB settled {r['settled_anon_gib']:5.2f} (+{extra:.2f})  "
                      f"VmHWM {r['peak_hwm_gib']:5.2f} GiB | {r['line']}", flush=True)
                if args.prompt_words:
                    print(f"      first prompt: {r['prefill_tokens']} tokens at {r['prefill_tok_s']:.1f} tok/s, "
                          f"decode {r['decode_tok_s']:.2f} tok/s", flush=True)
        if args.prompt_words:  # a restart's first prompt against a process that converted (its bytes just written)
            for dtype in dict.fromkeys(r["dtype"] for r in rows):
                by = {r["run"]: r for r in rows if r["dtype"] == dtype}
                if "hit" in by and "convert" in by:
                    h, c = by["hit"], by["convert"]
                    print(f"{dtype}: a restart's first prompt: prefill {h['prefill_tok_s'] / c['prefill_tok_s']:.2f}x, "
                          f"decode {h['decode_tok_s'] / c['decode_tok_s']:.2f}x the converting process's", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(dict(model=str(args.model), checkpoint_bytes=total, cpus=os.cpu_count(),
                                             generate_args=list(generate_args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
