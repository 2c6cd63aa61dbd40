"""How long loading a checkpoint takes: the first load (the experts converted for the CPU executor) and a restart
that copies them back from the packed cache, from a profile's disk, packer, copy and link figures.

What a first load does (hybrid.offload.build.load_hybrid), and so what is priced, in this order:

    read      every tensor of the checkpoint comes off the disk: the non-expert weights are read and copied to
              the device tensor by tensor; a MoE layer's experts are memory-mapped views that the packer faults in
              as it converts them (so in the load's own line their disk time shows under "convert")
    convert   the compiled packer converts (quantizes) each layer's experts into the executor's node-local
              buffers: expert weights x 2 bytes / the profile's pack rate of the CPU dtype
    upload    the non-expert bytes cross the link as the checkpoint stores them (a quantized GPU dtype is
              quantized on the GPU after the copy)

These add up: the loader is one thread that reads a tensor, then copies it, and reaches the next layer only after
the packer (whose threads fault the current layer in) has returned; kernel read-ahead may hide a little of the
disk time. The packed cache is written by a background thread the load does not wait for (hybrid.offload.
packed_cache): its seconds (packed bytes / the disk's write rate) are reported apart, not added.

A restart from the packed cache reads and uploads the non-expert weights as before and copies every layer's
packed bytes into the executor: from the page cache at the copy rate while it still holds the cache's files (the
cache keeps them there), else from the disk, where the cache reads ahead (MADV_WILLNEED) while the node threads
copy, so the slower of the two counts, not their sum.

The disk figures are the cache folder's file system (where `hybrid calibrate` measures them); a checkpoint on
another disk reads at that disk's rate. A checkpoint already in the page cache reads at about the copy rate: the
JSON's first_page_cache_s. The pack rates are those of each CPU dtype's usual path (the compiled packer; mxfp4:
published MXFP4 blocks re-ordered); a conversion off that path (a bf16 checkpoint quantized to mxfp4 by the PyTorch
reference, MXFP4 experts de-quantized for another dtype) is slower than priced.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from placement.hardware import BUILTIN_PROFILES, FALLBACK_PROFILE, LOAD_DEFAULTS, HardwareProfile

WEIGHT_BYTES = 2  # the pack rates count every expert weight as 2 bytes (bf16), whatever the checkpoint stores
_SRC_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # config.json's torch_dtype
_FP8_BYTES = 1 + 4 / (128 * 128)  # block FP8: one byte a weight, one fp32 scale per 128 x 128 block
_MXFP4_BYTES = 0.5 + 1 / 32  # MXFP4: a nibble a weight, one exponent byte per 32
_EXPERT = re.compile(r"(^|\.)experts\.")  # routed experts (a shared expert is "shared_expert(s).")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointBytes:
    """Bytes a load reads: the routed experts' and everything else's, from the safetensors headers ("files") or
    from config.json's sizes and dtypes ("config")."""

    experts: int
    non_expert: int
    source: str


def _quant_method(raw: dict) -> str | None:
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config") or {}
    return q.get("quant_method")


def config_checkpoint_bytes(cfg, raw: dict) -> CheckpointBytes:
    """A checkpoint's bytes estimated from config.json: its torch_dtype per weight, block FP8's matrices (the
    embedding and head stay bf16) and MXFP4 experts at their stored sizes."""
    text = raw.get("text_config") or {}
    src = _SRC_BYTES.get(str(raw.get("torch_dtype") or text.get("torch_dtype") or "bfloat16"), 2)
    counts = cfg.param_counts()
    method = _quant_method(raw)
    expert_bpw = {"fp8": _FP8_BYTES, "mxfp4": _MXFP4_BYTES}.get(method, src)
    non_expert = counts["non_expert"] * src
    if method == "fp8":  # attention, shared experts and dense MLPs are stored in fp8
        mats = cfg.gpu_matrices()
        fp8_params = sum(c * n * k for part in ("attention", "shared", "dense") for n, k, c in mats[part])
        non_expert -= fp8_params * (src - _FP8_BYTES)
    return CheckpointBytes(experts=round(counts["experts"] * expert_bpw), non_expert=round(non_expert), source="config")


def file_checkpoint_bytes(index: dict, num_layers: int) -> CheckpointBytes:
    """A checkpoint's bytes from its safetensors headers (index: tensor name -> (file, header entry), as
    hybrid.models.loader.checkpoint_index gives it): routed experts by name, tensors of layers past num_layers
    (DeepSeek-V3's multi-token-prediction layer, which the loader skips) left out."""
    experts = other = 0
    for name, (_, entry) in index.items():
        layer = _LAYER.search(name)
        if layer and int(layer.group(1)) >= num_layers:
            continue
        start, end = entry["data_offsets"]
        if _EXPERT.search(name):
            experts += end - start
        else:
            other += end - start
    return CheckpointBytes(experts=experts, non_expert=other, source="files")


@dataclass(frozen=True)
class LoadFigures:
    """The rates a prediction uses (bytes/s); `defaults` names those taken from LOAD_DEFAULTS (not measured)."""

    disk_read_bw: float
    disk_write_bw: float
    packed_copy_bw: float
    pack_rate: float
    link_bw: float
    defaults: tuple[str, ...]


def load_figures(hw: HardwareProfile, cpu_dtype: str) -> LoadFigures:
    """hw's measured figures for a load in `cpu_dtype`; a figure it lacks, or any figure of a built-in profile,
    from LOAD_DEFAULTS (named in `defaults`). The link is the profile's B_L (the fallback's when it has none)."""
    measured = hw.source == "calibrated"
    out, defaults = {}, []
    for name in ("disk_read_bw", "disk_write_bw", "packed_copy_bw"):
        value = getattr(hw, name)
        if value is None or not measured:
            value = LOAD_DEFAULTS[name]
            defaults.append(name)
        out[name] = value
    rate = hw.pack_rates.get(cpu_dtype)
    if rate is None or not measured:
        rate = LOAD_DEFAULTS["pack_rates"][cpu_dtype]
        defaults.append(f"packer ({cpu_dtype})")
    link = hw.link_bw
    if link is None:
        link = BUILTIN_PROFILES[FALLBACK_PROFILE].link_bw
        defaults.append("link_bw")
    return LoadFigures(pack_rate=rate, link_bw=link, defaults=tuple(defaults), **out)


_LABELS = {"disk_read_bw": "disk read", "disk_write_bw": "disk write", "packed_copy_bw": "packed copy",
           "link_bw": "link"}


@dataclass(frozen=True)
class LoadPrediction:
    """Seconds of a first load from the disk (read + convert + upload) and of a restart from the packed cache, its
    files in the page cache (non-expert read + upload + packed copy) or on the disk (the copy or the disk read,
    whichever is slower, for the packed bytes), with what they came from."""

    cpu_dtype: str
    read_s: float
    convert_s: float
    upload_s: float
    first_s: float
    first_page_cache_s: float  # the same load with the checkpoint already in the page cache
    cache_write_s: float  # the background write of the packed cache (not part of first_s)
    cached_s: float
    cached_from_disk_s: float
    checkpoint: CheckpointBytes
    expert_weights: int
    packed_bytes: int
    figures: LoadFigures

    def line(self) -> str:
        f = self.figures
        text = (f"load: first ~{self.first_s:.1f} s (read {self.read_s:.1f} s from disk at {f.disk_read_bw / 1e9:.2f} "
                f"GB/s, convert {self.convert_s:.1f} s, upload {self.upload_s:.1f} s), from the packed cache "
                f"~{self.cached_s:.1f} s (~{self.cached_from_disk_s:.1f} s from disk)")
        if f.defaults:
            names = [_LABELS.get(d, d) for d in f.defaults]
            text += f" [figures are defaults, not measured: {', '.join(names)}; `hybrid calibrate` measures them]"
        return text

    def to_json(self) -> dict:
        out = asdict(self)
        out["figures"]["defaults"] = list(self.figures.defaults)
        out["overlap"] = ("first load: none (read, convert and upload add up; the packed cache is written in the "
                          "background); packed cache from disk: its read overlaps the copy (the slower counts)")
        return out


def predict_load(cfg, ckpt: CheckpointBytes, packed_bytes: int, cpu_dtype: str, hw: HardwareProfile) -> LoadPrediction:
    """The load time of model `cfg` (a hybrid.models.ModelConfig) whose checkpoint holds `ckpt`, its experts packed
    in `cpu_dtype` to `packed_bytes` in all (placement.memory.breakdown's dram_experts_all), priced with hw."""
    f = load_figures(hw, cpu_dtype)
    weights = cfg.param_counts()["experts"]
    convert = weights * WEIGHT_BYTES / f.pack_rate
    upload = ckpt.non_expert / f.link_bw
    read = (ckpt.experts + ckpt.non_expert) / f.disk_read_bw
    copy = packed_bytes / f.packed_copy_bw
    warm_read = ckpt.non_expert / f.packed_copy_bw  # the experts' page faults are inside the measured pack rate
    return LoadPrediction(
        cpu_dtype=cpu_dtype, read_s=read, convert_s=convert, upload_s=upload, first_s=read + convert + upload,
        first_page_cache_s=warm_read + convert + upload, cache_write_s=packed_bytes / f.disk_write_bw,
        cached_s=warm_read + upload + copy,
        cached_from_disk_s=ckpt.non_expert / f.disk_read_bw + upload + max(copy, packed_bytes / f.disk_read_bw),
        checkpoint=ckpt, expert_weights=weights, packed_bytes=int(packed_bytes), figures=f)
