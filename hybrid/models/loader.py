"""Load a Hugging Face MoE checkpoint directory (config.json + safetensors) into a MoETransformer.

Every tensor's name, shape and dtype is checked against the family's weight map from the safetensors
headers before a byte of data is read, so a bad checkpoint fails fast with a message naming the
tensor. Data then streams tensor by tensor (memory-mapped) into parameters pre-allocated on their
target device, so the model is never held twice. Only safetensors is read (no pickle).

Expert placement hook: `expert_device`/`expert_dtype` choose where the stacked expert tensors
w_gate, w_up [E, F, D], w_down [E, D, F] are allocated (e.g. "cpu" while the rest sits on the GPU), and
`experts_factory(layer, w_gate, w_up, w_down) -> executor` (optional) builds each MoE layer's executor
from them once loaded (with expert biases, gpt-oss: also `biases=(b_gate [E, F], b_up [E, F], b_down [E, D])`
fp32); by default a StackedExperts wraps them without a copy. `mxfp4_experts=True` (with a factory): an
MXFP4 checkpoint's experts reach the factory as (blocks, scales) pairs instead (gate and up rows selected
on the packed bytes; cpu_kernels.CpuMoE.from_mxfp4 packs them without a float copy). `expert_views=True` (with a
factory that packs them, cpu_kernels.CpuMoE): a layer's float or block-FP8 experts reach it as
cpu_kernels.moe.ExpertRows of the memory-mapped tensors as read, no stack, no copy (their NaN/Inf check is the
packer's, NonFiniteWeights, reported here against the tensor).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from cpu_kernels.knobs import knobs
from hybrid.models import checks, fp8, mxfp4
from hybrid.models.config import ModelConfig
from hybrid.models.errors import ModelLoadError
from hybrid.models.families import Family, family_for
from hybrid.models.gpu_weights import quantize_skeleton_, quantized
from hybrid.models.qweight import FP8_BLOCK, QWeight
from hybrid.models.moe import StackedExperts
from hybrid.models.rope import Rotary
from hybrid.models.transformer import MoETransformer

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Tensors some checkpoints carry that are recomputed, never loaded.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
log = logging.getLogger("hybrid.models")
ExpertsFactory = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], nn.Module]


def read_config(path: str | Path) -> tuple[Family, ModelConfig, dict]:
    """config.json (+ generation_config.json's eos ids) -> (family, ModelConfig, raw dict)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"missing file: {cfg_file}")
    raw = checks.read_json_object(cfg_file)
    checks.check_config_fields(raw)
    family = family_for(raw)
    try:
        cfg = family.parse_config(raw)
    except ModelLoadError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        # a field of a type or value check_config_fields does not know about (a family's own fields)
        raise ModelLoadError(f"{cfg_file}: a field has a wrong type or value ({type(exc).__name__}: {exc})") from None
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = checks.read_json_object(gen_file)
        checks.check_token_ids(gen.get("eos_token_id"), "eos_token_id", str(gen_file))
        from hybrid.models.families.common import token_ids
        extra = [t for t in token_ids(gen.get("eos_token_id")) if t not in cfg.eos_token_ids]
        if extra:
            from dataclasses import replace
            cfg = replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(extra))
    return family, cfg, raw


read_header = checks.read_header  # the safetensors header, every entry checked against the file


def checkpoint_index(path: Path) -> dict[str, tuple[Path, dict]]:
    """tensor name -> (file, header entry) over one file or the shards of an index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = checks.read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
        files = sorted({checks.shard_path(path, f, index.name) for f in weight_map.values()})
    else:
        files = sorted(checks.inside(path, f) for f in path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded; convert to safetensors)" if pickles else ""
        raise ModelLoadError(f"missing file: no *.safetensors in {path}{hint}")
    out = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing file: {f} (listed in {index.name})")
        for name, entry in read_header(f).items():
            out[name] = (f, entry)
    return out


def _template(name: str) -> tuple[str, int | None]:
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (f"layers.{{i}}.{m.group(2)}", int(m.group(1))) if m else (name, None)


def _materialize(model: nn.Module, device, dtype) -> None:
    """Replace meta parameters by uninitialised ones on `device` (no init pass, no second copy)."""
    for module in model.modules():
        keep32 = getattr(module, "fp32_params", ())  # e.g. the sigmoid router: at least fp32, as its reference
        for pname, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                dt = torch.promote_types(dtype, torch.float32) if pname in keep32 else dtype
                module._parameters[pname] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dt),
                                                         requires_grad=False)


def build_empty(cfg: ModelConfig, device, dtype, expert_device=None, expert_dtype=None,
                build_experts: bool = True, gpu_dtypes: dict[str, str] | None = None) -> MoETransformer:
    """An uninitialised model: non-expert weights on `device`, experts on `expert_device`; the parts named in
    `gpu_dtypes` (hybrid.models.gpu_weights: part -> int8 / int4 / fp8) as empty quantized weights."""
    with torch.device("meta"):
        model = MoETransformer(cfg, build_experts=False)
    quantize_skeleton_(model, gpu_dtypes or {}, device)
    _materialize(model, device, dtype)
    model.rotary = Rotary(cfg.rope, cfg.head_dim).to(device)
    if build_experts:
        for i, layer in enumerate(model.layers):
            if layer.moe is not None:
                layer.moe.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size,
                                                   device=expert_device or device, dtype=expert_dtype or dtype,
                                                   fn=cfg.expert_fn)
    return model.eval()


class _Slot(NamedTuple):
    """Where an expert tensor goes in its layer's stack (allocated when the layer is streamed): which = 0 gate,
    1 up, 2 down, "gate_up" (the fused tensor), "gate_up_bias" or "down_bias"; expert None = the whole stack."""

    layer: int
    which: int | str
    expert: int | None


def _plan(model: MoETransformer, family: Family, ckpt: dict, scaled=frozenset(), mx=frozenset()) -> dict[str, tuple]:
    """checkpoint name -> (destination tensor or _Slot, expected shape). Raises on missing/unexpected/shape.
    `scaled`: names of float8 weights with block scales (hybrid.models.fp8), de-quantized as they are read;
    `mx`: names of MXFP4 blocks (hybrid.models.mxfp4)."""
    cfg = model.cfg
    plan: dict[str, tuple[torch.Tensor, tuple]] = {}
    named = [(n, p) for n, p in model.named_parameters() if ".moe.experts." not in n]
    for name, p in named + list(quantized(model).items()):
        key, layer = _template(name)
        if key not in family.weights:
            raise AssertionError(f"no checkpoint name for parameter {name} in {family.model_type}")
        plan[family.weights[key].format(i=layer)] = (p, tuple(p.shape))
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    inter = family.fused_layout == "interleaved"
    for i in cfg.moe_layer_indices:
        fused = {k: v.format(i=i) for k, v in family.fused_experts.items()}
        if cfg.expert_fn.bias:
            plan[fused["gate_up_bias"]] = (_Slot(i, "gate_up_bias", None), (E, 2 * F_))
            plan[fused["down_bias"]] = (_Slot(i, "down_bias", None), (E, D))
        if fused and fused["gate_up"] + mxfp4.BLOCKS in mx:
            gu, dn = fused["gate_up"] + mxfp4.BLOCKS, fused["down"] + mxfp4.BLOCKS
            plan[gu] = (_Slot(i, "gate_up", None), mxfp4.blocks_shape(E, 2 * F_, D, gu))
            plan[dn] = (_Slot(i, 2, None), mxfp4.blocks_shape(E, D, F_, dn))
            continue
        if fused and (fused["gate_up"] in ckpt or not family.experts):
            plan[fused["gate_up"]] = (_Slot(i, "gate_up", None), (E, D, 2 * F_) if inter else (E, 2 * F_, D))
            plan[fused["down"]] = (_Slot(i, 2, None), (E, F_, D) if inter else (E, D, F_))
            continue
        for e in range(E):
            for k, (w, shape) in enumerate((("w_gate", (F_, D)), ("w_up", (F_, D)), ("w_down", (D, F_)))):
                plan[family.experts[w].format(i=i, e=e)] = (_Slot(i, k, e), shape)
    missing = [n for n in plan if n not in ckpt]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"missing tensor {missing[0]!r}" + (f" (also {', '.join(missing[1:3])}{more})"
                                                                   if len(missing) > 1 else ""))
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [n for n in ckpt if n not in plan and n not in allowed_extra and not IGNORED.match(n)]
    if unexpected:
        raise ModelLoadError(f"unexpected tensor {unexpected[0]!r} in {ckpt[unexpected[0]][0].name}"
                             + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                             + f"; not part of a {family.model_type} model with this config")
    for n, (_, shape) in plan.items():
        found = tuple(ckpt[n][1]["shape"])
        if found != shape:
            raise ModelLoadError(f"tensor {n!r}: shape mismatch, expected {list(shape)}, found {list(found)}")
        if n in mx:
            continue  # U8 blocks, checked against their scales by mxfp4.pair_scales
        if ckpt[n][1]["dtype"] not in DTYPES and n not in scaled:
            raise ModelLoadError(f"tensor {n!r}: dtype {ckpt[n][1]['dtype']} not supported "
                                 f"(supported: {', '.join(DTYPES)}; quantized checkpoints are not)")
    return plan


def _skip(family: Family, cfg: ModelConfig, ckpt: dict) -> None:
    """Drops the tensors the family deliberately does not load, one log line per reason."""
    if family.skipped is None:
        return
    reasons: dict[str, int] = defaultdict(int)
    for n in list(ckpt):
        why = family.skipped(n, cfg)
        if why is not None:
            del ckpt[n]
            reasons[why] += 1
    for why, count in reasons.items():
        log.info("skipping %d tensor(s): %s", count, why)


def _layer_of(name: str) -> int:
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _on_gpu(dst, src: torch.Tensor) -> bool:
    """A non-expert matrix bound for the GPU (a parameter or a quantized weight of the same shape) read on the
    host: _fill_on_device's case."""
    if isinstance(dst, QWeight):
        return dst.device.type == "cuda" and src.dim() == 2 and tuple(src.shape) == (dst.n, dst.k)
    return (isinstance(dst, torch.Tensor) and dst.device.type == "cuda" and src.device.type == "cpu"
            and src.dim() == 2 and src.shape == dst.shape)


# rows of one host-to-GPU slice (_fill_on_device): the checkpoint's bytes of a few MB cross at a time
DEVICE_SLICE_VALUES = 32 * 2**20


def _fill_on_device(name: str, file: Path, dst, src: torch.Tensor, scale_inv: torch.Tensor | None,
                    block: tuple[int, int] | None) -> None:
    """dst (a GPU parameter, or a QWeight quantized on the GPU) from src [R, C] on the host, a slice of rows at a
    time: the slice crosses to the GPU in the file's dtype (FP8: 1 byte a weight, with its block scales) and is
    de-quantized, checked for NaN/Inf and stored or quantized there, instead of the host converting float8 to fp32,
    checking it and sending four times the bytes; no float copy of a whole matrix is made."""
    R, C = src.shape
    b0 = block[0] if block is not None else 1
    step = max(FP8_BLOCK[0], DEVICE_SLICE_VALUES // max(1, C) // FP8_BLOCK[0] * FP8_BLOCK[0])
    step = -(-step // b0) * b0  # whole scale blocks (and whole 128-row quantization blocks)
    dev = dst.device
    for r in range(0, R, step):
        rows = src[r:r + step].to(dev, non_blocking=False)
        if scale_inv is not None:
            rows = fp8.dequantize(rows, scale_inv[r // b0:-(-(r + rows.shape[0]) // b0)].to(dev), block)
        if isinstance(dst, QWeight):
            _check_finite(name, file, rows)  # before rounding can hide a NaN inside a group's scale
            dst.quantize_(rows, row0=r)
        else:
            out = dst[r:r + rows.shape[0]]
            out.copy_(rows)
            _check_finite(name, file, out)


def _check_finite(name: str, file: Path, t: torch.Tensor) -> None:
    """A NaN or Inf in a weight loads silently and turns every output into NaN (or one token forever).
    One float32 sum per tensor finds both (they propagate); only a flagged tensor is counted exactly,
    since a sum of large finite values can overflow too."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16) or t.numel() == 0:
        return
    if bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return
    bad = int(t.numel() - torch.isfinite(t).sum())
    if bad:
        raise ModelLoadError(f"tensor {name!r} in {file.name}: {bad} NaN/Inf value(s) of {t.numel()}; "
                             "the checkpoint is corrupt")


def _check_fp8(name: str, file: Path, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """_check_finite for FP8 bytes kept as they are: e4m3fn's only non-finite codes are its NaNs (S.1111.111)."""
    _check_finite(name + fp8.SCALE_SUFFIX, file, scale_inv.float())
    bad = int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if bad:
        raise ModelLoadError(f"tensor {name!r} in {file.name}: {bad} NaN value(s) of {q.numel()}; the checkpoint is corrupt")


def _canonical(family: Family, ckpt: dict) -> dict[str, str]:
    """Renames ckpt's keys to our spelling in place; returns our spelling -> the file's (they differ only for
    family.aliases)."""
    original = {}
    for n in list(ckpt):
        canon = n
        for pattern, repl in family.aliases:
            canon = re.sub(pattern, repl, canon)
        original[canon] = n
        if canon != n:
            ckpt[canon] = ckpt.pop(n)
    return original


def _open(path: Path):
    """config.json and the headers, checked against each other (no tensor data, nothing allocated) ->
    (family, cfg, quant, ckpt with our spellings and the skipped tensors and block scales taken out,
    our spelling -> the file's, the block scales: fp8.pair_scales, the MXFP4 scales: mxfp4.pair_scales)."""
    family, cfg, raw = read_config(path)
    quant = fp8.quantization(raw)
    ckpt = checkpoint_index(path)
    original = _canonical(family, ckpt)
    _skip(family, cfg, ckpt)
    scales = fp8.pair_scales(ckpt, quant)
    mx = mxfp4.pair_scales(ckpt, mxfp4.declared(raw))
    # Every size in config.json against the headers before a byte is allocated: first the counts and sizes
    # that would make even the meta skeleton big, then (load_model) every tensor's shape on the meta skeleton.
    checks.check_sizes(cfg, family, ckpt)
    return family, cfg, quant, ckpt, original, scales, mx


def check_checkpoint(path: str | Path) -> ModelConfig:
    """config.json and the headers only (no tensor data, nothing allocated): the config's counts and sizes
    against what the tensors hold. What callers run before sizing anything else (the KV cache) by the config."""
    return _open(Path(path))[1]


def _fill_stack(stack: list, dst: _Slot, src: torch.Tensor, mx_scales, inter: bool, F_: int) -> list:
    """Copies one checkpoint tensor into its layer's expert stack [gate, up, down(, b_gate, b_up, b_down)];
    returns what to check for NaN/Inf. mx_scales: src is MXFP4 blocks with these scales (gate/up rows
    selected on the packed bytes, then de-quantized a few experts at a time). inter: gpt-oss's fused layout."""
    if mx_scales is not None:
        if dst.which == "gate_up":  # [E, 2F, D/32, 16]: even rows gate, odd rows up
            mxfp4.dequantize_into(stack[0], src, mx_scales, slice(0, None, 2))
            mxfp4.dequantize_into(stack[1], src, mx_scales, slice(1, None, 2))
            return stack[:2]
        mxfp4.dequantize_into(stack[dst.which], src, mx_scales)
        return [stack[dst.which]]
    if dst.which == "gate_up":
        if inter:  # [E, D, 2F]: even columns gate, odd columns up
            stack[0].copy_(src[:, :, 0::2].transpose(1, 2))
            stack[1].copy_(src[:, :, 1::2].transpose(1, 2))
        else:  # [E, 2F, D]: gate rows, then up rows
            stack[0].copy_(src[:, :F_])
            stack[1].copy_(src[:, F_:])
    elif dst.which == "gate_up_bias":
        stack[3].copy_(src[:, 0::2] if inter else src[:, :F_])
        stack[4].copy_(src[:, 1::2] if inter else src[:, F_:])
    elif dst.which == "down_bias":
        stack[5].copy_(src)
    elif dst.which == 2 and inter and dst.expert is None:  # [E, F, D]
        stack[2].copy_(src.transpose(1, 2))
    else:
        (stack[dst.which] if dst.expert is None else stack[dst.which][dst.expert]).copy_(src)
    return [src]


def _view_stack(stack: list, names: dict, n: str, dst: _Slot, src: torch.Tensor, scale_inv, inter: bool, F_: int):
    """expert_views: one checkpoint tensor's experts into the layer's per-expert lists [(matrix, scale_inv)] as views
    (names: (which, expert) -> checkpoint name)."""
    if dst.which == "gate_up":  # fused [E, 2F, D], or [E, D, 2F] with gate in the even columns
        parts = ((0, [src[e, :, 0::2].t() if inter else src[e, :F_] for e in range(src.shape[0])]),
                 (1, [src[e, :, 1::2].t() if inter else src[e, F_:] for e in range(src.shape[0])]))
    elif dst.expert is None:  # down [E, D, F], or [E, F, D] interleaved
        parts = ((dst.which, [src[e].t() if inter else src[e] for e in range(src.shape[0])]),)
    else:
        parts = ((dst.which, {dst.expert: src}),)
    for which, mats in parts:
        for e, t in (mats.items() if isinstance(mats, dict) else enumerate(mats)):
            stack[which][e], names[(which, e)] = (t, scale_inv), n


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               expert_device: str | torch.device | None = None, expert_dtype: torch.dtype | None = None,
               experts_factory: ExpertsFactory | None = None, progress: bool = True,
               mxfp4_experts: bool = False, gpu_dtypes: dict[str, str] | None = None,
               experts_cached: Callable[[int], bool] | None = None, expert_views: bool = False) -> MoETransformer:
    """Load the checkpoint in directory `path`; see the module docstring for the expert hook.

    Streams layer by layer: a MoE layer's expert stack is allocated when the layer is reached, filled, and
    handed to the factory before the next layer's, so at most one layer's experts exist un-packed (block-FP8
    weights are de-quantized tensor by tensor as they are read: hybrid.models.fp8). `gpu_dtypes` (part -> int8 /
    int4 / fp8, hybrid.models.gpu_weights) quantizes those parts' matrices one at a time as they arrive, so no
    full-precision copy of them is ever allocated; fp8 parts of a block-FP8 checkpoint keep its bytes and scales.
    `experts_cached(layer)` True (a packed cache holds that layer's executor, hybrid.offload.packed_cache): the
    layer's expert weights are not read at all and the factory gets None for them (biases are still read).
    `expert_views`: float and block-FP8 experts reach the factory as ExpertRows (module doc); an MXFP4 checkpoint's
    keep the stacks."""
    from safetensors import safe_open
    from tqdm import tqdm

    from cpu_kernels.moe import ExpertRows, NonFiniteWeights

    path = Path(path)
    if mxfp4_experts and experts_factory is None:
        raise ValueError("mxfp4_experts hands (blocks, scales) pairs to an experts_factory; none was given")
    family, cfg, quant, ckpt, original, scales, mx = _open(path)
    with torch.device("meta"):
        skeleton = MoETransformer(cfg, build_experts=False)
    _plan(skeleton, family, ckpt, frozenset(scales), frozenset(mx))
    del skeleton
    model = build_empty(cfg, device, dtype, build_experts=False, gpu_dtypes=gpu_dtypes)
    edev, edt = expert_device or device, expert_dtype or dtype
    E, F_, D = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    plan = _plan(model, family, ckpt, frozenset(scales), frozenset(mx))
    make = experts_factory or (lambda _i, g, u, d, biases=None: StackedExperts.from_weights(g, u, d, cfg.expert_fn,
                                                                                             biases))
    inter = family.fused_layout == "interleaved"
    views = expert_views and not mx
    view_names: dict = {}  # (which, expert) -> checkpoint name of a view in the stack

    # Layer order (non-layer tensors first), then file order within a layer: one pass over each shard's
    # part of a layer; file handles stay open (memory maps) because a layer may span shards.
    cached = {i for i in cfg.moe_layer_indices if experts_cached is not None and experts_cached(i)}

    def skipped(dst) -> bool:  # an expert weight of a layer the packed cache serves
        return isinstance(dst, _Slot) and dst.which in (0, 1, 2, "gate_up") and dst.layer in cached

    order = sorted(plan, key=lambda n: (_layer_of(n), str(ckpt[n][0]), ckpt[n][1]["data_offsets"][0]))
    total = sum(ckpt[n][1]["data_offsets"][1] - ckpt[n][1]["data_offsets"][0] for n in plan if not skipped(plan[n][0]))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
               disable=not progress or knobs().no_progress)
    handles: dict[Path, object] = {}

    def read(name: str, entry: tuple[Path, dict]) -> torch.Tensor:
        file = entry[0]
        if file not in handles:
            try:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # the library's own checks (safetensors raises its own error types)
                raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None
        return handles[file].get_tensor(original[name])

    stack, stack_layer = None, None

    def new_stack(layer: int) -> list:
        """A layer's expert stack: gate, up, down (None where they come as packed pairs or from the cache), then
        the biases (fp32, as the CPU executor keeps them)."""
        out = [None] * 3 if (mx and mxfp4_experts) or layer in cached else [[None] * E for _ in range(3)] if views else [
            torch.empty(E, F_, D, device=edev, dtype=edt), torch.empty(E, F_, D, device=edev, dtype=edt),
            torch.empty(E, D, F_, device=edev, dtype=edt)]
        if cfg.expert_fn.bias:
            out += [torch.empty(E, n_, device=edev, dtype=torch.float32) for n_ in (F_, F_, D)]
        return out

    def finish_layer():
        nonlocal stack, stack_layer
        if stack is not None:
            extra = {"biases": tuple(stack[3:])} if cfg.expert_fn.bias else {}
            block = quant.block if quant is not None else FP8_BLOCK
            mats = [ExpertRows(*zip(*m, strict=True), block) if isinstance(m, list) else m for m in stack[:3]]
            try:
                model.layers[stack_layer].moe.experts = make(stack_layer, *mats, **extra)
            except NonFiniteWeights if views else () as exc:  # name the tensor, as the check of a copy would
                which = ("gate", "up", "down").index(exc.matrix)
                rows, name = mats[which][exc.expert:exc.expert + 1], view_names[(which, exc.expert)]
                if rows.scales[0] is not None:
                    _check_fp8(name, ckpt[name][0], rows.mats[0], rows.scales[0])
                _check_finite(name, ckpt[name][0], rows.dense())
                raise ModelLoadError(f"tensor {name!r} in {ckpt[name][0].name}: NaN/Inf after de-quantization; the "
                                     "checkpoint is corrupt") from None
            stack, stack_layer = None, None
            view_names.clear()

    with torch.no_grad():
        for n in order:
            dst, _ = plan[n]
            if stack_layer is not None and _layer_of(n) != stack_layer:
                finish_layer()
            if skipped(dst):
                if stack is None:
                    stack_layer, stack = dst.layer, new_stack(dst.layer)
                continue
            src = read(n, ckpt[n])
            nbytes = src.numel() * src.element_size()
            if views and isinstance(dst, _Slot) and dst.which in (0, 1, 2, "gate_up"):
                if stack is None:
                    stack_layer, stack = dst.layer, new_stack(dst.layer)
                scale_inv = read(n + fp8.SCALE_SUFFIX, scales[n]) if n in scales else None
                _view_stack(stack, view_names, n, dst, src, scale_inv, inter, F_)
                bar.update(nbytes)
                continue
            if n in scales:
                scale_inv = read(n + fp8.SCALE_SUFFIX, scales[n])
                if isinstance(dst, QWeight) and dst.kind == "fp8" and tuple(quant.block) == FP8_BLOCK:
                    _check_fp8(n, ckpt[n][0], src, scale_inv)
                    dst.copy_fp8_(src, scale_inv)  # the checkpoint's bytes, as they are
                    bar.update(nbytes)
                    continue
            if _on_gpu(dst, src):  # the file's bytes cross to the GPU and are de-quantized there, a slice at a time
                _fill_on_device(n, ckpt[n][0], dst, src, scale_inv if n in scales else None,
                                quant.block if n in scales else None)
                bar.update(nbytes)
                bar.set_postfix_str(f"layer {max(_layer_of(n), 0)}/{cfg.num_layers}", refresh=False)
                del src
                continue
            if n in scales:
                src = fp8.dequantize(src, scale_inv, quant.block)
            if isinstance(dst, _Slot):
                if stack is None:
                    stack_layer, stack = dst.layer, new_stack(dst.layer)
                mx_scales = read(n[: -len(mxfp4.BLOCKS)] + mxfp4.SCALES, mx[n]) if n in mx else None
                if mx_scales is not None and mxfp4_experts:
                    mxfp4.check_scales(n, ckpt[n][0], mx_scales)
                    if dst.which == "gate_up":  # [E, 2F, D/32, 16]: even rows gate, odd rows up
                        stack[0], stack[1] = ((src[:, r::2].contiguous(), mx_scales[:, r::2].contiguous()) for r in (0, 1))
                    else:
                        stack[dst.which] = (src, mx_scales)
                    checked = []
                else:
                    checked = _fill_stack(stack, dst, src, mx_scales, inter, F_)
            elif isinstance(dst, QWeight):
                _check_finite(n, ckpt[n][0], src)  # before rounding can hide a NaN inside a group's scale
                dst.quantize_(src)
                checked = []
            else:
                dst.copy_(src)
                checked = [dst]
            for t in checked:
                _check_finite(n, ckpt[n][0], t)
            bar.update(nbytes)
            bar.set_postfix_str(f"layer {max(_layer_of(n), 0)}/{cfg.num_layers}", refresh=False)
            del src
        finish_layer()
        if cfg.mla is not None and cfg.mla.rope_interleave:
            for layer in model.layers:
                layer.attn.rope_rows_from_interleaved_()
    handles.clear()
    bar.close()
    return model
