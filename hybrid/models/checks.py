"""Checks that run on a checkpoint's files before anything is allocated for it.

Everything here reads only config.json and the safetensors headers and raises ModelLoadError with one line
naming the file, the field or the tensor. The order matters: sizes in config.json are bounded by what the
headers hold (layer count, expert count, largest dimension) before a meta-device skeleton of the model is
built, so a config that says num_hidden_layers 100000 or hidden_size 10**9 is refused in milliseconds
instead of allocating for minutes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from hybrid.models.errors import ModelLoadError

# Every dtype the safetensors format defines with a whole number of bytes per element.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
# config.json fields read as integers by some family, with their smallest sensible value.
INT_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
    "head_dim": 1, "num_experts": 1, "num_local_experts": 1, "n_routed_experts": 1, "num_experts_per_tok": 1,
    "moe_intermediate_size": 1, "intermediate_size": 0, "shared_expert_intermediate_size": 0,
    "decoder_sparse_step": 1, "max_position_embeddings": 1, "original_max_position_embeddings": 1,
    "n_shared_experts": 0, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 1, "q_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1,
}
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "use_sliding_window", "attention_bias", "use_qk_norm")
# floats that must be > 0 (a zero or negative rms_norm_eps loads and then divides by ~0 or takes a root of < 0)
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "clip_qkv", "routed_scaling_factor", "swiglu_alpha",
                         "swiglu_limit")


def read_text(file: Path) -> str:
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{file}: not UTF-8 text (byte {exc.start})") from None


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object (config.json, generation_config.json, the shard index)."""
    try:
        data = json.loads(read_text(file))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ModelLoadError(f"{file}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def _is_int(v) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def check_config_fields(raw: dict, origin: str = "config.json") -> None:
    """The types and ranges of the fields the families read; names the first bad field."""
    for name in ("model_type",):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise ModelLoadError(f"{origin}: {name} must be a string, got {raw[name]!r}")
    arch = raw.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise ModelLoadError(f"{origin}: architectures must be a list of strings, got {arch!r}")
    for name, low in INT_FIELDS.items():
        v = raw.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise ModelLoadError(f"{origin}: {name} must be an integer, got {v!r}")
        if v < low:
            raise ModelLoadError(f"{origin}: {name} must be >= {low}, got {v!r}")
    for name in BOOL_FIELDS:
        if raw.get(name) is not None and not isinstance(raw[name], bool):
            raise ModelLoadError(f"{origin}: {name} must be true or false, got {raw[name]!r}")
    for name in POSITIVE_FLOAT_FIELDS:
        v = raw.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ModelLoadError(f"{origin}: {name} must be a positive finite number, got {v!r}")
    # 0 appears in configs that turn the window off with use_sliding_window: false (transformers writes it)
    sw, off = raw.get("sliding_window"), raw.get("use_sliding_window") is False
    if sw is not None and not (_is_int(sw) and (sw >= 1 or (sw == 0 and off))):
        raise ModelLoadError(f"{origin}: sliding_window must be a positive integer or null, got {sw!r}")
    dense = raw.get("mlp_only_layers")
    if dense is not None and not (isinstance(dense, list) and all(_is_int(i) and i >= 0 for i in dense)):
        raise ModelLoadError(f"{origin}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    for name in ("rope_scaling", "rope_parameters"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise ModelLoadError(f"{origin}: {name} must be an object or null, got {raw[name]!r}")
    check_token_ids(raw.get("eos_token_id"), "eos_token_id", origin)
    check_token_ids(raw.get("bos_token_id"), "bos_token_id", origin, single=True)


def check_token_ids(value, name: str, origin: str, single: bool = False) -> None:
    ok = value is None or (_is_int(value) and value >= 0) or (
        not single and isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value))
    if not ok:
        raise ModelLoadError(f"{origin}: {name} must be a token id{'' if single else ' or a list of them'}, "
                             f"got {value!r}")


# -- safetensors headers -----------------------------------------------------------------------------
def read_header(file: Path) -> dict:
    """The safetensors header of `file` (without __metadata__), every entry checked: dtype known, shape a
    list of non-negative integers, offsets inside the data, their span exactly the shape's bytes, entries
    back to back without overlap or gap (as the safetensors library requires when it reads them)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise ModelLoadError(f"{file}: not a safetensors file (header length {n} > {MAX_HEADER_BYTES})")
            if 8 + n > size:
                raise ModelLoadError(f"{file}: truncated safetensors file (header needs {8 + n} bytes, file has {size})")
            raw = fh.read(n)
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot read it ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ModelLoadError(f"{file}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    spans = []
    for name, e in header.items():
        where = f"{file}: tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise ModelLoadError(f"{where}: header entry needs dtype, shape and data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ModelLoadError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ModelLoadError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise ModelLoadError(f"{where}: data_offsets must be two integers, got {offs!r}")
        begin, end = int(offs[0]), int(offs[1])
        if not 0 <= begin <= end:
            raise ModelLoadError(f"{where}: data_offsets {offs} are reversed or negative")
        if end > data_size:
            last = max(x["data_offsets"][1] for x in header.values() if isinstance(x, dict) and
                       isinstance(x.get("data_offsets"), list) and len(x["data_offsets"]) == 2 and
                       all(_is_int(o) for o in x["data_offsets"]))
            raise ModelLoadError(f"{file}: truncated safetensors file (expected {8 + n + int(last)} bytes, found {size})"
                                 f"; tensor {name!r} ends beyond it")
        need = math.prod(int(d) for d in shape) * DTYPE_BYTES[dtype]
        if end - begin != need:
            raise ModelLoadError(f"{where}: {dtype} {list(shape)} is {need} bytes but its data_offsets span "
                                 f"{end - begin} (wrong dtype or shape in the header)")
        e["shape"], e["data_offsets"] = [int(d) for d in shape], [begin, end]
        spans.append((begin, end, name))
    spans.sort()
    at = 0
    for begin, end, name in spans:
        if begin < at:
            raise ModelLoadError(f"{file}: tensor {name!r} overlaps the tensor before it (data_offsets)")
        if begin > at:
            raise ModelLoadError(f"{file}: a gap of {begin - at} bytes before tensor {name!r} (data_offsets)")
        at = end
    return header


# -- shard paths -------------------------------------------------------------------------------------
def shard_path(root: Path, name, index_name: str) -> Path:
    """A shard named by the index: a relative path inside the checkpoint directory. A symlink may leave
    the directory only the way the Hugging Face hub cache lays snapshots out (snapshots/REV/x ->
    ../../blobs/SHA, inside the same models--ORG--NAME folder)."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"{root / index_name}: weight_map values must be file names, got {name!r}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ModelLoadError(f"{root / index_name}: shard {name!r} is outside the checkpoint directory")
    return inside(root, root / rel)


def inside(root: Path, file: Path) -> Path:
    real_root, real = root.resolve(), file.resolve()
    if real.is_relative_to(real_root):
        return file
    hub = real_root.parent.parent if real_root.parent.name == "snapshots" else None
    if hub is not None and real.is_relative_to(hub / "blobs"):
        return file
    raise ModelLoadError(f"{file}: resolves to {real}, outside the checkpoint directory {real_root}; refused")


# -- config.json against the headers -----------------------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _count_experts(template: str, layer: int, names) -> int:
    pre, _, post = template.format(i=layer, e="\0").partition("\0")
    pattern = re.compile(re.escape(pre) + r"(\d+)" + re.escape(post) + "$")
    found = {int(m.group(1)) for n in names if (m := pattern.match(n))}
    return max(found) + 1 if found else 0


def check_sizes(cfg, family, ckpt: dict) -> None:
    """config.json's counts and sizes against what the tensors hold, before a skeleton is built: no more
    layers than the checkpoint has, no more experts than its first MoE layer has, no size larger than the
    largest dimension of any tensor. The exact shapes are compared afterwards on the meta skeleton."""
    layers = {int(m.group(1)) for n in ckpt if (m := _LAYER.search(n))}
    have = max(layers) + 1 if layers else 0
    if cfg.num_layers > have:
        raise ModelLoadError(f"config.json: num_hidden_layers is {cfg.num_layers} but the checkpoint's tensors hold "
                             f"{have} decoder layers")
    largest = max((max(e["shape"], default=1) for _, e in ckpt.values()), default=0)
    for name in ("vocab_size", "hidden_size", "head_dim", "num_heads", "num_kv_heads", "expert_intermediate_size",
                 "dense_intermediate_size", "shared_expert_intermediate_size"):
        v = getattr(cfg, name, 0) or 0
        if name == "dense_intermediate_size" and all(cfg.moe_layers):
            continue  # Qwen configs carry intermediate_size without any dense layer using it
        if v > largest:
            raise ModelLoadError(f"config.json: {name} is {v} but no tensor of the checkpoint has a dimension that "
                                 f"large (largest: {largest})")
    moe = cfg.moe_layer_indices
    if not moe or not ("w_gate" in family.experts or family.fused_experts):
        return
    first = moe[0]
    fused = family.fused_experts.get("gate_up", "").format(i=first) if family.fused_experts else ""
    fused = next((f for f in (fused, fused + "_blocks") if f in ckpt and ckpt[f][1]["shape"]), None)
    if fused is None and "w_gate" not in family.experts:
        return  # stored fused only and missing: the loader names the missing tensor
    n = ckpt[fused][1]["shape"][0] if fused else _count_experts(family.experts["w_gate"], first, ckpt)
    if cfg.num_experts > n:
        raise ModelLoadError(f"config.json: {cfg.num_experts} experts per layer, but layer {first} of the checkpoint "
                             f"has {n}")
