"""Opening a model for the CLI: resolve --model (or build the demo), pick device and dtype, load,
wrap in an Engine. Shared by `hybrid generate` and `hybrid chat` (and usable by the server)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hybrid.errors import UsageError
from hybrid.runtime.config import RuntimeConfig

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def add_model_arguments(p) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json). Default: a small built-in demo model with random weights.")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--max-context", type=int, default=RuntimeConfig.max_context,
                   help=f"KV-cache positions per sequence (default {RuntimeConfig.max_context})")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs for decode (always eager on the CPU)")
    p.add_argument("--no-decode-ahead", action="store_true",
                   help="greedy decode waits for each step's tokens before queueing the next (by default, with CUDA "
                        "graphs, step n+1 is queued fed on the GPU before the host reads step n's tokens; same tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, help="seed for sampling (reproducible output)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    from hybrid.offload.build import add_hybrid_arguments

    add_hybrid_arguments(p)


@dataclass
class Session:
    engine: object
    tokenizer: object
    model_dir: str
    demo: bool
    device: torch.device
    dtype: torch.dtype
    offload: object = None  # hybrid.offload.Offload when cold experts live on the CPU


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    return dev


def open_session(args, max_batch: int = 1, log=lambda m: print(m, file=sys.stderr)) -> Session:
    from hybrid.models import load_model
    from hybrid.runtime.demo import DEMO_NOTICE, ensure_demo_checkpoint
    from hybrid.runtime.engine import Engine
    from hybrid.runtime.tokenizer import Tokenizer

    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    demo = not args.model
    model_dir = str(ensure_demo_checkpoint(progress_print=log)) if demo else args.model
    if demo:
        log(DEMO_NOTICE.format(path=model_dir))
    if args.max_context < 2:
        raise UsageError("--max-context must be at least 2")
    from hybrid.offload.build import hybrid_config_from_args, load_hybrid, open_hybrid

    hcfg = hybrid_config_from_args(args)
    # config.json against the headers, then the KV cache's size, before minutes of loading weights
    from hybrid.models.loader import check_checkpoint
    from hybrid.runtime.engine import check_kv_cache_fits

    cfg = check_checkpoint(model_dir)
    check_kv_cache_fits(cfg, max_batch, args.max_context, dtype, device)
    offload = None
    eager = args.eager or device.type != "cuda"
    if hcfg is not None:
        check_before_load(model_dir, hcfg, args.max_context, max_batch, dtype)
        if hcfg.replace == "online" and not eager:
            log("hybrid: --replace online changes residency between calls, which decode graphs cannot: "
                "decoding eagerly")
            eager = True
    if hcfg is None:
        model = load_model(model_dir, device=device, dtype=dtype, progress=not demo)
    else:
        model, offload = load_hybrid(model_dir, device, dtype, hcfg, progress=not demo)
    tokenizer = Tokenizer(model_dir)
    warn_vocab_mismatch(cfg.vocab_size, tokenizer.vocab_size, log)
    ahead = False if getattr(args, "no_decode_ahead", False) else None  # None: the engine's default (on with graphs)
    engine = Engine(model, tokenizer, config=RuntimeConfig(max_batch=max_batch, max_context=args.max_context,
                                                           eager=eager, decode_ahead=ahead))
    if offload is not None:
        open_hybrid(engine, offload, hcfg, log)
    engine.warmup()  # keep start-up (CUDA context, graph capture, oneDNN kernel JIT) out of the printed tokens/s
    return Session(engine, tokenizer, model_dir, demo, device, dtype, offload)


def warn_vocab_mismatch(model_vocab: int, tokenizer_vocab: int, log) -> None:
    """Real checkpoints pad the embedding a little past the tokenizer (Qwen3: 151936 vs 151669 ids) and never
    generate the padding; a model whose vocabulary is much larger than its tokenizer's (a random checkpoint
    of a real shape with a small tokenizer) generates ids that decode to nothing: empty text, silently."""
    if tokenizer_vocab > model_vocab:  # a prompt could encode to ids the embedding does not have
        log(f"warning: the tokenizer has {tokenizer_vocab} token ids but the model only {model_vocab}: a prompt "
            "that encodes to the extra ids cannot run (not this model's tokenizer?)")
    if tokenizer_vocab < 0.9 * model_vocab:  # the demo pads 1027 tokens to 1088 ids (multiple of 64)
        log(f"warning: the model has {model_vocab} token ids but its tokenizer only {tokenizer_vocab}; generated ids "
            f">= {tokenizer_vocab} have no text and are dropped from the output (a tokenizer from another model?)")


def check_before_load(model_dir, hcfg, max_context: int, max_batch: int, dtype) -> None:
    """Fail before any weight is read: a plan made for another model, or a --gpu-budget below the
    non-expert weights + KV cache (placement.memory computes both from config.json alone)."""
    from hybrid.models import ModelLoadError
    from hybrid.models.loader import read_config

    try:
        _, cfg, _ = read_config(model_dir)
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if hcfg.plan is not None:
        hcfg.plan.check_model(cfg, origin="--plan")
    if hcfg.gpu_budget is not None:
        from placement.memory import MemorySettings, breakdown, gib

        mem = breakdown(cfg, MemorySettings(max_context=max_context, max_batch=max_batch, cpu_dtype=hcfg.cpu_dtype,
                                            gpu_dtype_bytes=torch.empty((), dtype=dtype).element_size(), reserve=0))
        need = mem.non_expert + mem.kv_cache
        if need > hcfg.gpu_budget:
            raise UsageError(f"--gpu-budget {gib(hcfg.gpu_budget)} is below the non-expert weights and KV cache alone "
                             f"({gib(need)}: weights {gib(mem.non_expert)}, KV {gib(mem.kv_cache)} for --max-context "
                             f"{max_context} x {max_batch}); raise --gpu-budget or lower --max-context")


def sampling_from_args(args):
    from hybrid.runtime.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
