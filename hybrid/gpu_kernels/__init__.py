"""Fused GPU kernels of the decode step, written in Triton.

Why by hand: a batch-1 decode layer on the GPU is a chain of ~30 tiny kernels (norms, q/k/v split, q/k
norm, rotary, cache write, cache gather, masks, attention, layout copies, residual adds), each a few
microseconds even inside a CUDA graph, and nothing of it overlaps the CPU experts it waits for. Fused here:

- `add_rms_norm`: residual add + RMSNorm in one pass (two per layer; the MoE output's add moves into the next
  layer's input norm);
- `qk_rope_write`: per-head q/k RMSNorm, rotary (whole or partial), q/k/v clipping, the K/V cache write and
  the query's layout, from the fused q/k/v GEMM's output, in one kernel;
- `decode_attention`: one query per row attending to its own cache slot up to its position (sliding
  windows skip the keys before the window, gpt-oss sinks join the softmax denominator), grouped-query heads
  sharing each K/V tile; split over the keys in fixed 256-position chunks plus one combine kernel when a
  context bucket holds more than one chunk. The splits' boundaries do not depend on the bucket, so eager and
  captured decode give the same values;
- `router_topk` / `router_sigmoid_topk`: the routers' top-k (softmax; DeepSeek/GLM's group-limited sigmoid) in
  one kernel each instead of 3 and ~12; `router_gemv_topk`: at decode sizes the softmax router's logits GEMV
  in the same kernel, which in captured steps also writes the CPU lane's inputs into its page-locked block;
- `gemv.linear_small`: the q/k/v and o_proj projections of a one-row decode step (cuBLAS's batch-1 GEMMs
  leave most of the memory bandwidth unused there).

Each kernel has a pure-PyTorch reference (the model's own layers) and is tested against it over ragged shapes
with Triton's interpreter on the CPU (tests/test_gpu_kernels.py) and compiled on the GPU box.

Chosen once per process: on when the device is CUDA (compute capability 8.0 or later) and Triton imports;
`HYBRID_FUSED_DECODE=0` turns it off (the unfused torch chain, a fallback), `=1` insists (an error if Triton is
missing). The choice is logged once; a CUDA run without Triton says so loudly (a warning) and runs the
unfused chain.
"""

from __future__ import annotations

import logging

import torch

from cpu_kernels.knobs import knobs

log = logging.getLogger("hybrid.gpu_kernels")

ENV = "HYBRID_FUSED_DECODE"  # named in the log lines (cpu_kernels.knobs parses it)
_STATE: dict[str, object] = {}


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def fused_enabled(x: torch.Tensor) -> bool:
    """Whether the step that `x` belongs to runs the fused kernels (CUDA tensors only; decided and logged once)."""
    if not x.is_cuda:
        return False
    on = _STATE.get("on")
    if on is None:
        want = knobs().fused_decode  # "auto" | "0" | "1"
        version = _triton_version()
        if want == "0":
            on, why = False, f"off ({ENV}=0)"
        elif version is None:
            if want == "1":
                raise RuntimeError(f"{ENV}=1 but Triton does not import: install triton (torch's CUDA builds ship it)")
            on, why = False, "unavailable: Triton does not import; decode runs the unfused torch chain"
            log.warning("fused decode kernels %s", why)
        elif torch.cuda.get_device_capability(x.device)[0] < 8:
            # the kernels' dot products take bf16 tensor-core operands (Ampere and later)
            on, why = False, (f"off: {torch.cuda.get_device_name(x.device)} is older than compute capability 8.0; "
                              "decode runs the unfused torch chain")
            log.warning("fused decode kernels %s", why)
        else:
            on, why = True, f"on (Triton {version}; {ENV}=0 turns them off)"
        _STATE["on"] = on
        log.info("fused decode kernels: %s", why)
    return bool(on)


def describe() -> str:
    """One line for status output: what fused_enabled decided (or 'not decided yet')."""
    on = _STATE.get("on")
    return "not decided yet" if on is None else ("on" if on else "off")
