"""What each lossy setting does to a model's output: perplexity over held-out text and greedy agreement with the
reference run, for the CPU experts' dtypes, expert deferral, the GPU weights' dtypes and the KV cache's dtype, on
one checkpoint.

    python -m bench.quality --model DIR [--text FILE] [--settings cpu:int8,cpu:int4:64,defer:1,gpu:int4,...] \\
        [--tokens 4096] [--prompts 16] [--new 32] [--out FILE.json]

Settings (the reference is `ref`: bf16 experts in the CPU executor, every GPU part in the compute dtype):
    cpu:bf16 | cpu:int8 | cpu:int4[:GROUP] | cpu:mxfp4 | cpu:q8_0 | cpu:q4_0 | cpu:q2_k ... cpu:iq4_xs | cpu:iq2_xxs
                                                          the routed experts' dtype in DRAM (GROUP: int4 inputs
                                                          per scale, default 128)
    defer:N                                               expert deferral of each token's N lowest experts
    gpu:int8 | gpu:int4 | gpu:fp8                         every non-expert part's GPU dtype (DESIGN.md, GPU weights)
    kv:fp8                                                the KV cache in float8 e4m3 (--kv-dtype fp8)
    gguf:f32 | gguf:f16 | gguf:bf16 | gguf:q8_0 | gguf:q4_0
                                                          the checkpoint converted to a GGUF file of that type
                                                          (bench.hf_to_gguf: weight matrices in it, norms and
                                                          routers F32) and loaded from it as `hybrid --model
                                                          X.gguf` does: the CPU experts in the format nearest the
                                                          file's (q8_0 for Q8_0, q4_0 for Q4_0,
                                                          bf16 for float files). Converted once per type into a
                                                          temporary folder; the setting fails unless the file's
                                                          own tokenizer encodes the text to the checkpoint's ids
Perplexity: teacher-forced over --tokens of the text in windows of the model's --window positions; greedy
agreement: --prompts prompts of 32 tokens cut from the text, --new greedy tokens each, the share of positions
equal to the reference's and each prompt's first differing position. On a model that has learned something
(bench.train_small, the built-in demo among them) these are quality figures; on random weights
(bench.make_checkpoint) only the change between settings means anything, and little.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from cpu_kernels.dtypes import NAMES as CPU_DTYPE_NAMES
from hybrid.errors import UsageError
from hybrid.offload.build import load_hybrid
from hybrid.offload.config import HybridConfig
from hybrid.runtime.config import RuntimeConfig
from hybrid.runtime.engine import Engine
from hybrid.runtime.kv_cache import StaticKVCache
from hybrid.runtime.sampling import SamplingParams

TEXT = ("The cost model decides, per batch and per layer, whether to ship an expert's activations to the CPU or "
        "its weights over PCIe to the GPU. A batch of tokens each choosing a few experts makes many assignments; "
        "compute is fixed by that number, weight traffic by how many distinct experts are touched.")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # bench.hf_to_gguf.TYPES, without importing gguf
DEFAULT_SETTINGS = ("cpu:int8,cpu:q8_0,cpu:q4_0,cpu:int4:32,cpu:int4:64,cpu:int4:128,cpu:mxfp4,cpu:q2_k,cpu:q3_k,cpu:q4_k,cpu:q5_k,cpu:q6_k,cpu:iq4_xs,cpu:iq2_xxs,defer:1,defer:2,"
                    "gpu:int8,gpu:int4,gpu:fp8,kv:fp8")


def parse_setting(text: str) -> dict:
    """'cpu:int4:64' -> {"cpu_dtype": "int4", "group": 64}; 'defer:1'; 'gpu:fp8'; 'kv:fp8'; 'gguf:q8_0'; 'ref'."""
    parts = text.split(":")
    kind = parts[0]
    if kind == "ref" and len(parts) == 1:
        return {}
    if kind == "cpu" and len(parts) in (2, 3) and parts[1] in CPU_DTYPE_NAMES:
        out = {"cpu_dtype": parts[1]}
        if len(parts) == 3:
            if parts[1] != "int4" or not parts[2].isdigit():
                raise UsageError(f"{text!r}: only int4 takes a group size (32, 64 or 128)")
            out["group"] = int(parts[2])
        return out
    if kind == "defer" and len(parts) == 2 and parts[1].isdigit():
        return {"defer": int(parts[1])}
    if kind == "gpu" and len(parts) == 2 and parts[1] in ("int8", "int4", "fp8"):
        return {"gpu_dtype": parts[1]}
    if kind == "kv" and len(parts) == 2 and parts[1] == "fp8":
        return {"kv_dtype": parts[1]}
    if kind == "gguf" and len(parts) == 2 and parts[1] in GGUF_TYPES:
        return {"gguf": parts[1]}
    raise UsageError(f"unknown setting {text!r} (see --help)")


def cpu_format(model_dir: str, setting: dict) -> tuple[str, int]:
    """(CPU expert dtype, int4 group): the setting's, else for a GGUF file the format its experts default to
    under `hybrid --model X.gguf` (hybrid.loading.parse.gguf_cpu_format), else bf16."""
    if "cpu_dtype" in setting:
        return setting["cpu_dtype"], setting.get("group", 128)
    from hybrid.loading.parse import gguf_cpu_format

    fmt = gguf_cpu_format(model_dir)
    return (fmt.dtype, fmt.group or 128) if fmt is not None else ("bf16", 128)


def load(model_dir: str, device: str, setting: dict):
    from hybrid.models.gpu_weights import PARTS

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cpu_dtype, group = cpu_format(model_dir, setting)
    hcfg = HybridConfig(gpu_experts=0, schedule="cpu", cpu_dtype=cpu_dtype, cpu_group=group,
                        defer_experts=setting.get("defer", 0))
    gpu = setting.get("gpu_dtype")
    model, _ = load_hybrid(model_dir, device, dtype, hcfg, progress=False,
                           gpu_dtypes={p: gpu for p in PARTS} if gpu else None)
    return model


@torch.no_grad()
def nll(model, ids: list[int], window: int, kv_dtype: str = "bf16") -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] (teacher-forced, windows of `window` tokens) and its count."""
    total, count = 0.0, 0
    cache = StaticKVCache.for_model(model, 1, window + 1, kv_dtype)
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        x = torch.tensor([chunk], device=model.device)
        logits = model(x, torch.arange(len(chunk), device=model.device)[None], torch.tensor([0], device=model.device),
                       cache).float()[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        count += len(chunk) - 1
    return total, count


def run(model_dir: str, device: str, setting: dict, text_ids, prompts, new: int, window: int) -> dict:
    """Perplexity and greedy tokens of the model at `model_dir` (a gguf:TYPE setting's converted file at
    setting["path"]) under `setting`."""
    model = load(setting.get("path", model_dir), device, setting)
    kv = setting.get("kv_dtype", "bf16")
    total, count = nll(model, text_ids, window, kv)
    eng = Engine(model, None, config=RuntimeConfig(max_batch=len(prompts), max_context=max(map(len, prompts)) + new + 1,
                                                   eager=device != "cuda", kv_dtype=kv))
    outs = eng.generate(prompts, max_new_tokens=new, sampling=SamplingParams(temperature=0), stop_token_ids=[])
    return {"perplexity": math.exp(total / count), "tokens": [o.token_ids for o in outs]}


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, list]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    first = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(ref, got)]
    return same / max(1, sum(len(r) for r in ref)), first


def encoder(model_dir: str):
    if (Path(model_dir) / "tokenizer.json").is_file():
        from hybrid.runtime.tokenizer import Tokenizer

        return Tokenizer(model_dir).encode
    from hybrid.models.checkpoints import read_config

    vocab = read_config(model_dir)[1].vocab_size
    print(f"# no tokenizer.json in {model_dir}: token ids are the text's bytes modulo the vocabulary ({vocab})")
    return lambda s: [b % vocab for b in s.encode()]


def gguf_file(model_dir: str, qtype: str, folder: Path, text: str, ids: list[int]) -> str:
    """The checkpoint as a GGUF file of `qtype` in `folder` (converted on first use), checked to carry a tokenizer
    that encodes `text` to `ids`, the checkpoint tokenizer's: the file is then measured on the same tokens."""
    from bench.hf_to_gguf import convert

    path = folder / f"{qtype}.gguf"
    if not path.is_file():
        convert(model_dir, path, qtype)
    got = gguf_encoder(path, folder / f"{qtype}-tokenizer")(text)
    if got != ids:
        at = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
        raise ValueError(f"{path.name}: the GGUF file's tokenizer encodes the text to other ids than the "
                         f"checkpoint's ({len(got)} vs {len(ids)} tokens, first difference at token {at})")
    return str(path)


def gguf_encoder(path: Path, tokenizer_dir: Path):
    """The encode of the tokenizer a GGUF file carries, as `hybrid --model X.gguf` builds it (its metadata
    written as tokenizer files, here into `tokenizer_dir` rather than the user's cache)."""
    from hybrid.models.gguf import open_gguf, write_tokenizer_files
    from hybrid.runtime.tokenizer import Tokenizer

    return Tokenizer(str(write_tokenizer_files(open_gguf(path), tokenizer_dir))).encode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated settings (default: all of them)")
    p.add_argument("--text", help="held-out UTF-8 text (default: a corpus folder's held-out part if --corpus, else a "
                   "built-in paragraph)")
    p.add_argument("--corpus", help="a bench.corpus folder: its held-out text")
    p.add_argument("--tokens", type=int, default=4096, help="text tokens for the perplexity")
    p.add_argument("--window", type=int, default=256, help="positions per teacher-forced window")
    p.add_argument("--prompts", type=int, default=16, help="greedy prompts cut from the text")
    p.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    a = p.parse_args(argv)
    settings = [s for s in a.settings.split(",") if s]
    parsed = [parse_setting(s) for s in settings]  # every setting checked before anything is loaded
    if a.model is None:
        from hybrid.runtime.demo import demo_checkpoint

        a.model = str(demo_checkpoint())
    if a.corpus:
        from bench.corpus import load_corpus

        text = "\n\n".join(d.text for d in load_corpus(a.corpus)[1])
    else:
        text = Path(a.text).read_text(encoding="utf-8") if a.text else TEXT
    ids = encoder(a.model)(text)
    text_ids = ids[:a.tokens]
    step = max(32, (len(ids) - 32) // max(1, a.prompts))
    prompts = [ids[i:i + 32] for i in range(0, len(ids) - 32, step)][:a.prompts] or [ids[:32]]
    print(f"# quality | {a.model} | {a.device} | {len(text_ids)} text tokens, {a.new} greedy tokens x "
          f"{len(prompts)} prompts")
    ref = run(a.model, a.device, {}, text_ids, prompts, a.new, a.window)
    rows = [dict(setting="ref", perplexity=ref["perplexity"], same_tokens=1.0, first_difference=None)]
    print(f"ref: perplexity {ref['perplexity']:.3f}")

    def save() -> None:  # after every row: a run stopped by a time limit keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps(dict(model=a.model, device=a.device, text_tokens=len(text_ids),
                                                   prompts=len(prompts), new=a.new, rows=rows), indent=1) + "\n")
    save()
    failed = 0
    folder = tempfile.TemporaryDirectory(prefix="quality-gguf-")
    for name, setting in zip(settings, parsed):
        try:
            if "gguf" in setting:
                setting = {**setting, "path": gguf_file(a.model, setting["gguf"], Path(folder.name), text, ids)}
            r = run(a.model, a.device, setting, text_ids, prompts, a.new, a.window)
        except Exception as exc:  # one setting's failure is reported in its row; the others still run
            failed += 1
            rows.append(dict(setting=name, error=f"{type(exc).__name__}: {exc}"))
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})", file=sys.stderr)
            save()
            continue
        same, first = agreement(ref["tokens"], r["tokens"])
        rows.append(dict(setting=name, perplexity=r["perplexity"], same_tokens=same, first_difference=first))
        print(f"{name}: perplexity {r['perplexity']:.3f} ({100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}%), "
              f"{100 * same:.0f}% of greedy tokens unchanged (first difference per prompt: {first})")
        save()
    folder.cleanup()
    if failed:
        print(f"quality: {failed} of {len(settings)} settings failed (their rows say why)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
