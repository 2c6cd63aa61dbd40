"""A DeepSeek-V3-shaped FP8 checkpoint, loaded as published, end to end (the models table's DeepSeek row).

    python -m bench.deepseek_box --ckpt /tmp/dsv3-5l --cpu-dtype int8 --profile PROFILE.json --out DIR

1. Writes the checkpoint unless DIR/config.json exists: the deepseek-v3 preset cut to 5 layers (the 3 dense
   ones + 2 MoE layers of 256 experts), linear weights block-FP8 as DeepSeek publishes them (~28 GB: 22.5 GB
   of FP8 experts, 3.7 GB of bf16 embedding + head), random numbers drawn on the GPU.
2. Loads it with the hybrid experts (`load_hybrid`: FP8 de-quantized per tensor, each MoE layer packed for
   the CPU executor in --cpu-dtype before the next is read) and reports the load time, the process's peak
   and settled resident memory (the DRAM footprint) and the executor's expert bytes.
3. Runs bench.hybrid_e2e's measurements on the loaded model: prefill 2048 / 8192 and decode at batch 1 / 8
   tokens/s per strategy against the placement's roofline (see bench/hybrid_e2e.py for the bounds).
Results: DIR/deepseek_box_<cpu dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import torch

from bench import hybrid_e2e
from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from hybrid.models.presets import hf_config
from hybrid.models.writer import write_random_checkpoint
from hybrid.offload.build import expert_shape, load_hybrid
from hybrid.offload.config import HybridConfig
from placement.json_file import write_json


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set of this process. The peak is VmHWM, which the kernel reports as at least
    the current RSS; getrusage's ru_maxrss is updated lazily and was seen below VmRSS read just after it."""
    return status_kib("VmRSS") * 1024, status_kib("VmHWM") * 1024


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class AnonPeak:
    """The largest anonymous resident memory (RssAnon) seen while the block runs, sampled every 20 ms. The
    kernel's peak RSS also counts the checkpoint's memory-mapped file pages the loader touched (page cache,
    given back under pressure), which overstate what a load needs; RssAnon is the memory the process owns.
    `end` is RssAnon when the block ended (also counted in `peak`)."""

    def __enter__(self):
        import threading

        self.peak, self._stop = status_kib("RssAnon") * 1024, threading.Event()

        def sample():
            while not self._stop.wait(0.02):
                self.peak = max(self.peak, status_kib("RssAnon") * 1024)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = status_kib("RssAnon") * 1024
        self.peak = max(self.peak, self.end)


def write_checkpoint(path: Path, raw: dict, quant: str = "fp8") -> None:
    """quant: "fp8" (block-FP8, DeepSeek's) or "mxfp4" (the experts, gpt-oss's)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    write_random_checkpoint(path, raw, seed=0, device=dev, progress=True,
                            fp8_block=(128, 128) if quant == "fp8" else None, mxfp4=quant == "mxfp4")


def ensure_checkpoint(path: Path, layers: int, config: str | None = None, preset: str = "deepseek-v3",
                      quant: str = "fp8") -> dict:
    """Writes the checkpoint in a child process, so that the load's peak resident memory measured in this
    one is the loader's own (the writer holds host copies of a whole layer and its shard)."""
    if (path / "config.json").is_file():
        return {"written": False}
    t0 = time.perf_counter()
    raw = json.loads(Path(config).read_text()) if config else hf_config(preset, layers=layers)
    child = multiprocessing.get_context("spawn").Process(target=write_checkpoint, args=(path, raw, quant))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"writing {path} failed (exit code {child.exitcode})")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"# wrote {path}: {size / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"written": True, "write_s": time.perf_counter() - t0, "disk_bytes": size}


def arguments(doc: str, ckpt: str, layers: int, preset: str, cpu_dtype: str) -> argparse.ArgumentParser:
    """The command line of a model bench over a preset-shaped checkpoint (deepseek_box, gpt_oss_box)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--ckpt", default=ckpt, help="checkpoint directory (written if missing)")
    p.add_argument("--layers", type=int, default=layers, help="decoder layers of the written checkpoint")
    p.add_argument("--config", help=f"a config.json to write instead of the {preset} preset (tests, variants)")
    p.add_argument("--cpu-dtype", default=cpu_dtype, choices=CPU_DTYPE_NAMES)
    p.add_argument("--profile", required=True)
    p.add_argument("--isa")
    p.add_argument("--cpu-threads", type=int)
    p.add_argument("--resident", type=int, help="resident experts per layer (default: a quarter)")
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--prefill", type=hybrid_e2e.ints, default=[2048, 8192])
    p.add_argument("--decode-batch", type=hybrid_e2e.ints, default=[1, 8])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--strategies", type=lambda s: s.split(","), default=["cost", "cpu", "ship", "threshold:32"])
    p.add_argument("--out", default="bench/results")
    return p


def main(argv=None) -> int:
    args = arguments(__doc__, "/tmp/dsv3-5l", 5, "deepseek-v3", "int8").parse_args(argv)
    res = run_box(args, "deepseek-v3", "fp8")
    write_json(Path(args.out) / f"deepseek_box_{args.cpu_dtype}.json", res, indent=1)
    return 0


def run_box(args, preset: str, quant: str) -> dict:
    """Writes the checkpoint if missing (`preset` cut to --layers, `quant` as published; a GGUF file is taken as it
    is, `preset` its label), loads it with the hybrid experts (args.cpu_group: int4's group, if set) and runs
    bench.hybrid_e2e's measurements; returns its results with the checkpoint and load figures."""
    from hybrid.models.gguf import is_gguf

    ckpt = Path(args.ckpt)  # a GGUF file is loaded as it is (bench.gguf_box)
    written = {"written": False} if is_gguf(ckpt) else ensure_checkpoint(ckpt, args.layers, args.config, preset, quant)
    load = {}

    def build(a, hw, device, dtype):  # bench.hybrid_e2e.run's model builder, from the checkpoint instead
        rss0 = rss_bytes()[0]
        t0 = time.perf_counter()
        hcfg = HybridConfig(gpu_experts=0, schedule="cost", cpu_dtype=a.cpu_dtype, cpu_isa=a.isa,
                            cpu_group=getattr(a, "cpu_group", None) or HybridConfig.cpu_group,
                            cpu_threads=a.cpu_threads, profile=hw,  # hw: hybrid_e2e.run's pricing_profile
                            layer_formats=getattr(a, "layer_formats", False))  # a mixed GGUF's layers, as users load
        with AnonPeak() as anon:
            model, off = load_hybrid(ckpt, device, dtype, hcfg, progress=True)
        cur, peak = rss_bytes()
        load.update(load_s=time.perf_counter() - t0, rss_before=rss0, rss_after=cur, rss_peak=peak,
                    anon_after=anon.end, anon_peak=anon.peak,
                    dram_expert_bytes=off.memory()["dram_expert_bytes"])
        print(f"# loaded {ckpt} ({a.cpu_dtype}) in {load['load_s']:.0f} s; RSS {cur / 2**30:.1f} GiB (peak "
              f"{peak / 2**30:.1f} GiB, with mapped checkpoint pages); anonymous {load['anon_after'] / 2**30:.1f} "
              f"GiB (peak {anon.peak / 2**30:.1f} GiB); executor experts {load['dram_expert_bytes'] / 2**30:.1f} GiB",
              flush=True)
        return model, model.cfg, expert_shape(model.cfg, a.cpu_dtype, dtype), off

    args.preset, args.trace, args.defer_experts, args.isolate = preset, None, 0, False
    hybrid_e2e.apply_defaults(args, torch.cuda.is_available())
    own_build, hybrid_e2e.build = hybrid_e2e.build, build
    try:  # for this run only: a later hybrid_e2e run in the same process (the test suite) builds its own model
        res = hybrid_e2e.run(args)
    finally:
        hybrid_e2e.build = own_build
    res.update(checkpoint=str(ckpt), checkpoint_written=written, load=load)
    return res


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
