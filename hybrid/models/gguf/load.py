"""load_gguf: a GGUF checkpoint into a MoETransformer, de-quantized to the model's dtype.

Every tensor is de-quantized (hybrid.models.gguf.dequant) to float32 and stored in the model's dtype, tensor by
tensor, a layer's expert stacks a slice at a time, so neither the file nor a layer's experts are ever held twice
in float32. The exception: with `cpu_format` (the CPU executor's dtype and int4 group the experts factory packs
into), a layer's expert weights whose blocks that format holds exactly (Q4_0 in q4_0 or int4 group 32, Q8_0 in q8_0,
Q4_K in q4_k, MXFP4 in mxfp4) reach the factory as the file's blocks (hybrid.models.gguf.repack), never de-quantized; any
other reaches it as ExpertChunks (expert_chunks), de-quantized a few experts at a time as the executor packs them,
so no layer is staged whole in floats.

Before anything is allocated, every parameter of the model the config describes is matched to its GGUF
tensors on a meta-device skeleton: a missing tensor, a shape that differs, a tensor type without a
de-quantizer, or a tensor that belongs to nothing is one ModelLoadError line naming the tensor. The load takes
the same expert hooks as hybrid.models.loader.load_model (expert_device / expert_dtype / experts_factory, and
gpu_dtypes for quantized GPU matrices).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch

from cpu_kernels.knobs import knobs
from hybrid.models.errors import ModelLoadError
from hybrid.models.gguf import repack
from hybrid.models.gguf.checkpoint import GgufCheckpoint, display_name, open_gguf
from hybrid.models.gguf.dequant import SUPPORTED, chunks, dequantize, dequantize_into, nbytes, type_name
from hybrid.models.gguf.names import (ExpertTensor, Source, expert_tensors, is_plain, param_source, same_shape,
                                     skipped, template)
from hybrid.models.gpu_weights import quantized
from hybrid.models.loader import ExpertsFactory, build_empty
from hybrid.models.transformer import MoETransformer

log = logging.getLogger("hybrid.models")


class Plan(NamedTuple):
    """Our parameter name -> its Source; MoE layer -> the GGUF tensors of its experts."""

    params: dict[str, Source]
    experts: dict[int, list[ExpertTensor]]


def _missing(names: list[str], ckpt: GgufCheckpoint) -> ModelLoadError:
    more = ""
    if len(names) > 1:
        more = f" (also {', '.join(names[1:3])}" + (f" and {len(names) - 3} more)" if len(names) > 3 else ")")
    return ModelLoadError(f"missing tensor {names[0]!r} in {ckpt.path.name}{more}; a {ckpt.arch} model with this "
                          "metadata needs it")


def _check_tensor(ckpt: GgufCheckpoint, name: str, expected: tuple[int, ...], what: str) -> None:
    t = ckpt.tensors[name]
    if not same_shape(t.shape, expected):
        raise ModelLoadError(f"tensor {name!r} in {t.file.name} ({what}): shape mismatch, expected {list(expected)}, "
                             f"found {list(t.shape)}")
    if t.ggml_type not in SUPPORTED:
        raise ModelLoadError(f"tensor {name!r} in {t.file.name}: type {type_name(t.ggml_type)} is not supported "
                             f"(supported: {', '.join(type_name(s) for s in SUPPORTED)})")


def plan(ckpt: GgufCheckpoint, params: dict[str, tuple[int, ...]]) -> Plan:
    """Matches our parameters (name -> shape, experts excluded) and every MoE layer's experts to the file's
    tensors; raises on a missing, mis-shaped, unsupported or unexpected tensor. Reads no tensor data."""
    cfg, have = ckpt.config, ckpt.tensors.__contains__
    sources = {n: param_source(ckpt.arch, cfg, n, s, have) for n, s in params.items()}
    experts = {i: expert_tensors(cfg, i, have) for i in cfg.moe_layer_indices}
    wanted = [n for s in sources.values() for n in s.names] + [e.name for es in experts.values() for e in es]
    missing = [n for n in dict.fromkeys(wanted) if n not in ckpt.tensors]
    if missing:
        raise _missing(missing, ckpt)
    for ours, s in sources.items():
        for name, shape in zip(s.names, s.shapes):
            _check_tensor(ckpt, name, shape, f"for {ours}")
    for es in experts.values():
        for e in es:
            _check_tensor(ckpt, e.name, e.shape, f"experts {e.which}")
    used = set(wanted)
    unexpected = [n for n in ckpt.tensors if n not in used and _skipped(ckpt, n) is None]
    if unexpected:
        raise ModelLoadError(f"unexpected tensor {unexpected[0]!r} in {ckpt.tensors[unexpected[0]].file.name}"
                             + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                             + f"; not part of a {ckpt.family.model_type} model with this metadata")
    return Plan(sources, experts)


def _skipped(ckpt: GgufCheckpoint, name: str) -> str | None:
    mtp = int(ckpt.metadata.get(f"{ckpt.arch}.nextn_predict_layers") or 0)
    return skipped(name, ckpt.config, ckpt.tensors.__contains__, mtp)


def _log_skipped(ckpt: GgufCheckpoint) -> None:
    reasons: dict[str, int] = defaultdict(int)
    for n in ckpt.tensors:
        why = _skipped(ckpt, n)
        if why is not None:
            reasons[why] += 1
    for why, count in reasons.items():
        log.info("skipping %d tensor(s): %s", count, why)


def _finite(name: str, ckpt: GgufCheckpoint):
    """A check for de-quantized values: a NaN or Inf loads silently and turns every output into NaN. One float32
    sum finds both (they propagate); only a flagged chunk is counted exactly (a sum of large values overflows)."""
    file = ckpt.tensors[name].file.name

    def check(values: torch.Tensor) -> None:
        if values.numel() == 0 or bool(torch.isfinite(values.sum(dtype=torch.float32))):
            return
        bad = int(values.numel() - torch.isfinite(values).sum())
        if bad:
            raise ModelLoadError(f"tensor {name!r} in {file}: {bad} NaN/Inf value(s); the checkpoint is corrupt")
    return check


def read_source(ckpt: GgufCheckpoint, source: Source) -> torch.Tensor:
    """The float32 values of one of our parameters: its GGUF tensors de-quantized, checked, transformed."""
    parts = []
    for name in source.names:
        t = ckpt.tensors[name]
        values = dequantize(t.raw(), t.ggml_type, t.shape)
        _finite(name, ckpt)(values)
        parts.append(values)
    return source.build(parts)


def _stack(cfg, device, dtype, weights: bool = True) -> list:
    """An empty expert stack [gate, up, down(, b_gate, b_up, b_down fp32)] for an experts_factory (weights=False:
    None for gate, up and down, whose blocks go to the factory as they are)."""
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    out = [torch.empty(E, F_, D, device=device, dtype=dtype), torch.empty(E, F_, D, device=device, dtype=dtype),
           torch.empty(E, D, F_, device=device, dtype=dtype)] if weights else [None] * 3
    if cfg.expert_fn.bias:  # fp32, as StackedExperts and the CPU executor keep them
        out += [torch.empty(E, n, device=device, dtype=torch.float32) for n in (F_, F_, D)]
    return out


_SLOT = {"w_gate": 0, "w_up": 1, "w_down": 2, "gate": 3, "up": 4, "down": 5}


def fill_experts(ckpt: GgufCheckpoint, stack: list[torch.Tensor], tensors: list[ExpertTensor]) -> None:
    """De-quantizes one layer's expert tensors into `stack` [gate, up, down(, biases)] a slice at a time."""
    F_ = ckpt.config.expert_intermediate_size
    for e in tensors:
        t = ckpt.tensors[e.name]
        check = _finite(e.name, ckpt)
        if e.which == "gate_up":  # [E, 2F, D]: gate rows, then up rows
            for start, stop, values in chunks(t.raw(), t.ggml_type, e.shape):
                check(values)
                stack[0][start:stop].copy_(values[:, :F_])
                stack[1][start:stop].copy_(values[:, F_:])
        else:
            dst = stack[_SLOT[e.which]]
            dequantize_into(dst, t.raw(), t.ggml_type, check)


def expert_chunks(ckpt: GgufCheckpoint, tensors: list[ExpertTensor]) -> dict:
    """{"w_gate", "w_up", "w_down"} -> the expert weights among `tensors` (one layer's) as cpu_kernels ExpertChunks
    over the file: a few experts' values de-quantized (and checked) when the packer reaches them, so the layer is
    never held whole in floats; a fused gate_up's two row halves read the same blocks."""
    from cpu_kernels.moe import ExpertChunks

    F_ = ckpt.config.expert_intermediate_size
    out = {}
    for e in tensors:
        if e.which not in repack.WEIGHTS:
            continue
        t, check = ckpt.tensors[e.name], _finite(e.name, ckpt)
        E, R, K = e.shape
        per = nbytes(t.ggml_type, (R, K))  # one expert's bytes

        def read(e0, e1, t=t, check=check, R=R, K=K, per=per):
            values = dequantize(t.raw()[e0 * per:e1 * per], t.ggml_type, (e1 - e0, R, K))
            check(values)
            return values

        if e.which == "gate_up":  # [E, 2F, D]: gate rows, then up rows
            whole = ExpertChunks(read, (E, R, K))
            out["w_gate"], out["w_up"] = whole[:, :F_], whole[:, F_:]
        else:
            out[e.which] = ExpertChunks(read, (E, R, K))
    return out


def _opened(path: str | Path | GgufCheckpoint) -> GgufCheckpoint:
    """A path is opened; an open checkpoint is used as it is (gguf-py parses a header with a 150k-token
    vocabulary in seconds: callers that already opened one pass it on)."""
    return path if isinstance(path, GgufCheckpoint) else open_gguf(path)


def load_gguf(path: str | Path | GgufCheckpoint, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              expert_device: str | torch.device | None = None, expert_dtype: torch.dtype | None = None,
              experts_factory: ExpertsFactory | None = None, progress: bool = True,
              gpu_dtypes: dict[str, str] | None = None, cpu_format: tuple[str, int] | None = None,
              experts_cached=None, layer_formats: bool = False) -> MoETransformer:
    """The model in the GGUF checkpoint at `path` (a .gguf file, any part of a split one, or an open
    GgufCheckpoint), every
    parameter de-quantized to `dtype` on `device`; experts on `expert_device` in `expert_dtype` (default: the
    same), wrapped in StackedExperts or handed to `experts_factory(layer, w_gate, w_up, w_down[, biases=])` one
    layer at a time, as hybrid.models.loader.load_model does. cpu_format: (dtype, int4 group) of the CPU executor
    the factory packs for; a layer whose expert blocks it holds exactly gets weight sources over the file's blocks
    (cpu_kernels.moe.gguf_blocks) instead of float stacks, and one line is logged; a layer whose down is better
    held in a format of its own (repack.down_format) gets the factory's down_dtype= too; layer_formats (a file of
    mixed types loaded in its own formats, no --cpu-dtype given): a layer whose gate and up blocks another format
    holds exactly gets that format as the factory's dtype= (repack.layer_format). experts_cached(layer) True (a
    packed cache holds that layer's executor, hybrid.offload.packed_cache): its expert weights are not read, the
    factory gets None for them (and the biases, which the GPU lanes keep). See the module docstring."""
    from tqdm import tqdm

    if cpu_format is not None and experts_factory is None:
        raise ValueError("cpu_format hands expert blocks to an experts_factory; none was given")
    ckpt = _opened(path)
    cfg = ckpt.config
    with torch.device("meta"):
        skeleton = MoETransformer(cfg, build_experts=False)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    del skeleton
    work = plan(ckpt, shapes)
    _log_skipped(ckpt)
    fmt = None if cpu_format is None else repack.cpu_format(*cpu_format)
    choice = {} if fmt is None else repack.choose(ckpt, work.experts, fmt, layer_formats)
    if choice:
        log.info("%s", repack.describe(choice, fmt))
    model = build_empty(cfg, device, dtype, expert_device, expert_dtype, build_experts=experts_factory is None,
                        gpu_dtypes=gpu_dtypes)
    params, qweights = dict(model.named_parameters()), quantized(model)
    used = {n for s in work.params.values() for n in s.names} | {e.name for es in work.experts.values() for e in es}
    total = sum(nbytes(ckpt.tensors[n].ggml_type, ckpt.tensors[n].shape) for n in used)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {display_name(ckpt.path)}",
               disable=not progress or knobs().no_progress)
    edev, edt = expert_device or device, expert_dtype or dtype

    def size(names) -> int:
        return sum(nbytes(ckpt.tensors[n].ggml_type, ckpt.tensors[n].shape) for n in names)

    def load_experts(layer: int) -> None:
        tensors = work.experts[layer]
        cached = experts_factory is not None and experts_cached is not None and experts_cached(layer)
        # the weights that reach the factory as the file's blocks, as the format holds them
        keep = set() if cached or layer not in choice else set(choice[layer].kept)
        weights = [e for e in tensors if e.which in repack.WEIGHTS]
        kept = bool(keep) and all(e.which in keep for e in weights)
        # the CPU executor's factory (cpu_format given) packs from the file's blocks or from chunks of de-quantized
        # experts (or both: the kept weights and the others of a layer); any other factory, or none, gets float stacks
        chunked = cpu_format is not None and not cached and not kept
        no_stacks = cached or chunked or kept
        if experts_factory is None:
            ex = model.layers[layer].moe.experts
            stack = [ex.w_gate, ex.w_up, ex.w_down, *(ex.biases or ())]
        else:
            stack = _stack(cfg, edev, edt, weights=not no_stacks)
        if cached:  # the executor comes from the packed cache: only the biases are read
            stack[:3] = [None] * 3
            fill_experts(ckpt, stack, [e for e in tensors if e.which not in repack.WEIGHTS])
        elif chunked or kept:  # kept weights as the file's blocks, the others de-quantized a few experts at a time as
            # they are packed; biases (fp32 tensors) as usual
            mats = {**expert_chunks(ckpt, [e for e in weights if e.which not in keep]),
                    **repack.sources(ckpt, [e for e in weights if e.which in keep], cfg.expert_intermediate_size)}
            stack[:3] = [mats["w_gate"], mats["w_up"], mats["w_down"]]
            fill_experts(ckpt, stack, [e for e in tensors if e.which not in repack.WEIGHTS])
        else:
            fill_experts(ckpt, stack, tensors)
        if experts_factory is not None:
            extra = {"biases": tuple(stack[3:])} if cfg.expert_fn.bias else {}
            if layer in choice and choice[layer].fmt is not None:  # the layer in a format of its own
                extra["dtype"] = choice[layer].fmt[0]
            if layer in choice and choice[layer].down is not None:  # the down in a dtype of its own
                extra["down_dtype"] = choice[layer].down[0]
            model.layers[layer].moe.experts = experts_factory(layer, *stack[:3], **extra)
        bar.update(size(e.name for e in tensors))

    def load_param(name: str) -> None:
        source = work.params[name]
        if name in qweights:
            qweights[name].quantize_(read_source(ckpt, source).reshape(qweights[name].shape))
        elif is_plain(source):  # straight into the parameter, a slice at a time (a big embedding is never
            t = ckpt.tensors[source.names[0]]  # held whole in float32)
            dequantize_into(params[name].view(t.shape), t.raw(), t.ggml_type, _finite(t.name, ckpt))
        else:
            params[name].copy_(read_source(ckpt, source).reshape(params[name].shape))
        bar.update(size(source.names))

    by_layer: dict[int | None, list[str]] = defaultdict(list)
    for name in work.params:
        by_layer[template(name)[1]].append(name)
    with torch.no_grad():
        for name in by_layer[None]:
            load_param(name)
        for i in range(cfg.num_layers):  # a layer's experts right after its other tensors
            for name in by_layer[i]:
                load_param(name)
            if i in work.experts:
                load_experts(i)
        if cfg.mla is not None and cfg.mla.rope_interleave:
            for layer in model.layers:
                layer.attn.rope_rows_from_interleaved_()
    bar.close()
    return model


def check_gguf(path: str | Path | GgufCheckpoint):
    """The GGUF checkpoint's ModelConfig after every tensor is matched (no tensor data read, nothing allocated):
    what a caller runs before sizing anything by the config, as hybrid.models.loader.check_checkpoint."""
    ckpt = _opened(path)
    with torch.device("meta"):
        skeleton = MoETransformer(ckpt.config, build_experts=False)
    plan(ckpt, {n: tuple(p.shape) for n, p in skeleton.named_parameters()})
    return ckpt.config
