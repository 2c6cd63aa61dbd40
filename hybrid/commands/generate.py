"""`hybrid generate`: complete one prompt, streaming the text, then print prefill/decode tokens/s."""

from __future__ import annotations

import json
import sys
import time

from hybrid.errors import UsageError


def register(subparsers) -> None:
    from hybrid.loading.parse import add_model_arguments

    p = subparsers.add_parser("generate", help="generate text from a prompt",
                              description="Generate a completion. Without --model the built-in demo runs: a small "
                              "Qwen3-MoE model trained on Shakespeare's plays, shipped in the package.")
    p.add_argument("--prompt", default="The capital of France is", help="prompt text")
    p.add_argument("-n", "--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt and generated token ids, "
                   "text, prefill and decode tokens/s, and whether the model is the built-in demo")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from hybrid.loading.parse import sampling_from_args
    from hybrid.loading.session import open_session

    if args.max_new_tokens < 1:
        raise UsageError("-n must be at least 1")
    sampling = sampling_from_args(args)
    t0 = time.perf_counter()
    s = open_session(args)
    load_s = time.perf_counter() - t0  # reading weights, packing, warm-up: never part of the prefill figure
    warmup_s = getattr(s.engine, "warmup_s", 0.0)
    tok = s.tokenizer
    prompt_ids = (tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
                  else tok.encode(args.prompt))
    if not prompt_ids:
        raise UsageError("the prompt encodes to no tokens")
    if len(prompt_ids) >= args.max_context:
        raise UsageError(f"the prompt has {len(prompt_ids)} tokens; --max-context is {args.max_context}")

    def stream(_i, _token, delta):
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    if not args.json:
        sys.stdout.write(args.prompt if not args.chat else "")
        sys.stdout.flush()
    try:
        out = s.engine.generate([prompt_ids], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                stop_strings=args.stop, stream=None if args.json else stream)[0]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    st = s.engine.stats
    if args.json:
        from hybrid.loading.session import vram_mark

        vram_mark(s.device, "generated", s.vram)
        print(json.dumps({
            "model": s.model_dir, "demo": s.demo, "device": str(s.device),
            "dtype": str(s.dtype).replace("torch.", ""), "prompt": args.prompt,
            "prompt_token_ids": out.prompt_token_ids, "generated_token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "prefill_tokens": st.prefill_tokens,
            "prefill_tokens_per_s": round(st.prefill_tps, 2), "decode_tokens": st.decode_tokens,
            "decode_tokens_per_s": round(st.decode_tps, 2),
            "cuda_graphs": s.engine.graphs is not None, "load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3),
            **device_fields(s), **({"vram": s.vram} if s.vram else {}),
        }, ensure_ascii=False))
    else:
        print()
        print(f"loaded in {load_s:.1f} s (warm-up {warmup_s:.2f} s, so the prompt runs at warm speed)", file=sys.stderr)
        print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}] prefill: {st.prefill_tokens} tokens at "
              f"{st.prefill_tps:.1f} tok/s | decode: {st.decode_tokens} tokens at {st.decode_tps:.1f} tok/s "
              f"({s.device}, {str(s.dtype).replace('torch.', '')}"
              f"{', CUDA graphs' if s.engine.graphs is not None else ''})", file=sys.stderr)
    return 0


def device_fields(s) -> dict:
    """--json's account of who played the GPU's part: on a machine without CUDA the 'GPU' side is
    torch on the CPU, and the hybrid layer's 'resident' experts are DRAM copies, its ship lane a DRAM copy."""
    from hybrid.runtime.device_role import CPU_ONLY_NOTE, gpu_role, is_cuda

    cuda = is_cuda(s.device)
    out = {"gpu_role": gpu_role(s.device)}
    if not cuda:
        out["cpu_only_note"] = CPU_ONLY_NOTE
    off = getattr(s, "offload", None)
    if off is not None:
        mem = off.memory()
        out["hybrid"] = {
            "resident_experts_per_layer": [int(layer.is_resident.sum()) for layer in off.layers],
            "resident_memory": "vram" if cuda else "dram (torch on the CPU)",
            "resident_bytes": int(mem["vram_resident_bytes"]), "dram_expert_bytes": int(mem["dram_expert_bytes"]),
            "ship_lane": "pcie host->device" if cuda else "copy within dram (no pcie)",
            "schedule": str(off.scheduler.strategy), "profile": str(off.profile_name),
            "cpu_dtype": off.cpu_dtype, **({"int4_group": off.group_size} if off.cpu_dtype == "int4" else {}),
        }
    return out
