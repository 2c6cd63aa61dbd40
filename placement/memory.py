"""Bytes a hybrid model needs, computed from its ModelConfig alone (no weight is loaded).

The planner checks budgets with these figures before anything is read from disk, so every size here
mirrors what the runtime allocates (the code each function mirrors is named in its docstring):

GPU (VRAM):
    non-expert weights  attention, norms, routers, shared experts, dense MLPs, embeddings, head; the matrices of
                        each part in its GPU dtype (gpu_weight_bytes: bf16, or hybrid.models.qweight's int8 /
                        int4 / fp8 bytes + fp32 scales), everything else in the compute dtype
    KV cache            hybrid.runtime.kv_cache.StaticKVCache: B x (C + 1) x the attention kind's values per
                        token (ModelConfig.kv_values_per_token: grouped-query 2 x layers x Hkv x hd; MLA
                        layers x (kv_lora_rank + qk_rope_head_dim), the latent and the rope key), each value
                        in the compute dtype, or 1 byte with --kv-dtype fp8 (kv_value_bytes)
    staging             hybrid.offload.lanes.ShipLane: n_slots x chunk experts, dense (+ packed raw
                        buffers when the packed layout is not the dense one); `hybrid plan` sizes it by
                        what it saves (placement.planner.choose_staging)
    graph buffers       decode-graph activations of the largest bucket and the graph CPU lane's output; with
                        quantized parts, the de-quantized row chunk a prefill GEMM reads (qweight.dequant_linear)
    resident experts    3 x D x F each in the residents' GPU dtype (the "experts" entry of gpu_dtypes): de-quantized
                        to the compute dtype, or int8 / int4 bytes + fp32 scales (hybrid.offload.resident), whose
                        larger batches de-quantize one chunk at a time (counted with the graph buffers)
    prefill activations one prefill pass of min(prefill_chunk, C) tokens attending C keys (hybrid.runtime.Engine.prefill):
                        the hidden states, the widest attention or dense-MLP temporaries, the fp32 MoE merge and
                        router logits, one expert group's gathered rows, outputs and fp32 products
                        (HybridExperts._gpu_lane), MLA's keys and values expanded per head for all C keys, a
                        later pass's mask over the cache; an upper estimate from the tensors live at once
    reserve             CUDA context, cuBLAS workspaces, loaded Triton modules, allocator slack: what nvidia-smi
                        counts beyond the tensors above (1 GiB: on an H100 with CUDA 13 the context alone was 700-790
                        MiB after warm-up, and a run's whole-process peak 570-900 MiB above the modeled tensors)

DRAM: every expert, packed in the CPU dtype (cpu_kernels.CpuMoE: rows and K padded, int8 per-row scales
and row sums, int4 group scales, mxfp4 one exponent byte per 32 values, q8_0 and q4_0 one fp16 scale per 32, q4_k a 16-byte
head per 256, q5_k a 48-byte one, q6_k an 18-byte one, q2_k a 20-byte one, q3_k a 14-byte one, iq4_xs an 8-byte one, iq2_xxs, iq3_xxs, iq3_s and iq1_s a 2-byte one, iq1_m an 8-byte one), including the resident ones: the runtime keeps one packed copy of
every expert so that eviction and re-placement never reload from disk; plus the CPU lanes' pinned
activation buffers.

Shapes: E experts, D hidden, F expert intermediate, K experts per token, B batch rows, C context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpu_kernels.dtypes import CPU_DTYPES as CPU_DTYPE_TABLE, NAMES as CPU_DTYPES  # the one table of CPU dtypes
from placement.errors import UsageError

MXFP4_BLOCK = 32  # cpu_kernels.quant.MXFP4_BLOCK: values per shared exponent
ROW_ALIGN = 32  # cpu_kernels.moe._ROW_ALIGN
INT4_GROUP = CPU_DTYPE_TABLE["int4"].default_group  # hybrid.offload.Offload default group size
DEFAULT_RESERVE = 2**30  # CUDA context, workspaces, modules, allocator slack (measured: see the docstring)
GRAPH_MAX_ROWS = 512  # hybrid.offload.host_lane.HostFnLane.MAX_ROWS
GPU_KINDS = ("bf16", "int8", "int4", "fp8")  # per part: the compute dtype, or hybrid.models.qweight's kinds
KV_DTYPES = ("bf16", "fp8")  # --kv-dtype: the compute dtype, or float8 e4m3 (hybrid.runtime.kv_cache)
GPU_PARTS = ("attention", "shared", "dense", "embed", "head")  # hybrid.models.gpu_weights.PARTS
RESIDENT_PART = "experts"  # gpu_dtypes' entry for the resident experts (hybrid.offload.resident)
RESIDENT_KINDS = ("bf16", "int8", "int4")  # hybrid.offload.resident.RESIDENT_KINDS
QUANT_GROUP = 128  # hybrid.models.qweight.GROUP (int8 / int4 inputs per scale); fp8: 128 x 128 blocks
DEQUANT_CHUNK_VALUES = 32 * 2**20  # hybrid.models.qweight.DEQUANT_CHUNK_VALUES


def kv_value_bytes(kv_dtype: str, compute_bytes: int = 2) -> int:
    """Bytes of one KV-cache value: the compute dtype's, or 1 for fp8 (hybrid.runtime.kv_cache.StaticKVCache)."""
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return 1 if kv_dtype == "fp8" else compute_bytes


def gpu_weight_bytes(kind: str, n: int, k: int, compute_bytes: int = 2) -> int:
    """VRAM of one [n, k] matrix in GPU dtype `kind` (hybrid.models.qweight's formats, fp32 scales)."""
    if kind == "bf16":
        return compute_bytes * n * k
    if kind == "int8":
        return n * k + 4 * n * -(-k // QUANT_GROUP)
    if kind == "int4":
        return n * -(-k // 2) + 4 * n * -(-k // QUANT_GROUP)
    if kind == "fp8":
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    raise UsageError(f"GPU dtype must be one of {', '.join(GPU_KINDS)}, got {kind!r}")


def non_expert_bytes(cfg, gpu_dtypes: dict, compute_bytes: int) -> dict[str, int]:
    """VRAM of the non-expert weights per part (GPU_PARTS, + "other": norms, routers, gates, biases, in the
    compute dtype), each part's matrices in its dtype from `gpu_dtypes` (missing: bf16)."""
    out, matrix_params = {}, 0
    for part, mats in cfg.gpu_matrices().items():
        kind = gpu_dtypes.get(part, "bf16")
        out[part] = sum(c * gpu_weight_bytes(kind, n, k, compute_bytes) for n, k, c in mats)
        matrix_params += sum(c * n * k for n, k, c in mats)
    out["other"] = (cfg.param_counts()["non_expert"] - matrix_params) * compute_bytes
    return out


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


def _kpad(cpu_dtype: str, group: int) -> int:
    return max(64, group) if cpu_dtype == "int4" else 256 if cpu_dtype in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs",
                                                                               "iq2_xxs", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m") else 64  # CpuMoE._kpad


def f_slices(F: int, node_threads: list[int], cpu_dtype: str = "bf16", group: int = INT4_GROUP) -> list[tuple[int, int]]:
    """cpu_kernels.CpuMoE._f_slices: F split over the nodes in proportion to their threads, in multiples
    of the K padding (so each node's slice of the down matrix needs no tail handling)."""
    step = _kpad(cpu_dtype, group)
    total = sum(node_threads)
    bounds, acc = [0], 0
    for n in node_threads[:-1]:
        acc += n
        bounds.append(min(F, _align(round(F * acc / total), step)))
    bounds.append(F)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def packed_matrix_bytes(rows: int, k: int, cpu_dtype: str, row_align: int, group: int = INT4_GROUP) -> int:
    """One expert's matrix [rows, k] as CpuMoE._mat packs it (padded to [rows_p, ldk])."""
    rows_p, ldk = _align(rows, row_align), _align(k, _kpad(cpu_dtype, group))
    if cpu_dtype == "bf16":
        return rows_p * ldk * 2
    if cpu_dtype == "int8":
        return rows_p * ldk + rows_p * 4 + rows_p * 4  # int8 values, fp32 scale and int32 row sum per row
    if cpu_dtype == "int4":
        return rows_p * ldk // 2 + rows_p * (ldk // group) * 4  # nibbles, fp32 scale per group
    if cpu_dtype == "mxfp4":
        return rows_p * ldk // 2 + rows_p * (ldk // MXFP4_BLOCK)  # e2m1 nibbles, uint8 exponent per 32: 0.53125 B
    if cpu_dtype == "q8_0":
        return rows_p * ldk + rows_p * (ldk // MXFP4_BLOCK) * 2  # int8 values, fp16 scale per 32: 1.0625 B
    if cpu_dtype == "q4_0":
        return rows_p * ldk // 2 + rows_p * (ldk // MXFP4_BLOCK) * 2  # nibbles, fp16 scale per 32: 0.5625 B
    if cpu_dtype == "q4_k":
        return rows_p * ldk // 2 + rows_p * (ldk // 256) * 16  # nibbles, a 16-byte head per 256: 0.5625 B
    if cpu_dtype == "q5_k":
        return rows_p * ldk // 2 + rows_p * (ldk // 256) * 48  # nibbles, a 48-byte head with fifth bits: 0.6875 B
    if cpu_dtype == "q2_k":
        return rows_p * ldk // 4 + rows_p * (ldk // 256) * 20  # 2-bit values, a 20-byte head per 256: 0.3281 B
    if cpu_dtype == "q3_k":
        return rows_p * (ldk // 256) * (96 + 14)  # 3-bit values, a 14-byte head per 256: 0.4297 B
    if cpu_dtype == "q6_k":
        return rows_p * ldk // 4 * 3 + rows_p * (ldk // 256) * 18  # 6-bit values, an 18-byte head per 256: 0.8203 B
    if cpu_dtype == "iq4_xs":
        return rows_p * ldk // 2 + rows_p * (ldk // 256) * 8  # codebook indices, an 8-byte head per 256: 0.53125 B
    if cpu_dtype == "iq2_xxs":
        return rows_p * ldk // 4 + rows_p * (ldk // 256) * 2  # 64 bytes of qs, fp16 d per 256: 0.2578 B
    if cpu_dtype == "iq3_xxs":
        return rows_p * (ldk // 256) * 98  # 96 bytes of qs, fp16 d per 256: 0.3828 B
    if cpu_dtype == "iq3_s":
        return rows_p * (ldk // 256) * 110  # 108 bytes of qs, qh, signs and scales, fp16 d per 256: 0.4297 B
    if cpu_dtype == "iq1_s":
        return rows_p * (ldk // 256) * 50  # 48 bytes of qs and qh, fp16 d per 256: 0.1953 B
    if cpu_dtype == "iq1_m":
        return rows_p * (ldk // 256) * 56  # 48 bytes of qs and qh, 8 of scales (d's nibbles) per 256: 0.2188 B
    raise UsageError(f"cpu dtype must be one of {', '.join(CPU_DTYPES)}, got {cpu_dtype!r}")


def packed_slice_bytes(D: int, f0: int, f1: int, cpu_dtype: str, group: int = INT4_GROUP) -> int:
    """One expert's share on one node: gate and up rows f0:f1 and down columns f0:f1."""
    Fn, kp = f1 - f0, _kpad(cpu_dtype, group)
    return (2 * packed_matrix_bytes(Fn, D, cpu_dtype, kp, group)
            + packed_matrix_bytes(D, Fn, cpu_dtype, ROW_ALIGN, group))


def packed_expert_bytes(D: int, F: int, cpu_dtype: str, node_threads: list[int] | None = None,
                        group: int = INT4_GROUP) -> int:
    """DRAM bytes of one expert in the CPU executor, summed over the nodes' slices."""
    return sum(packed_slice_bytes(D, a, b, cpu_dtype, group)
               for a, b in f_slices(F, node_threads or [1], cpu_dtype, group))


def down_bytes(D: int, F: int, cpu_dtype: str, node_threads, group: int = INT4_GROUP) -> int:
    """Packed bytes of one expert's down projection [D, F] in cpu_dtype, over the NUMA nodes' F slices."""
    return sum(packed_matrix_bytes(D, b - a, cpu_dtype, ROW_ALIGN, group)
               for a, b in f_slices(F, list(node_threads), cpu_dtype, group))


def dense_layout(D: int, F: int, cpu_dtype: str, nodes: int) -> bool:
    """ShipLane.direct: the packed bytes are the dense bf16 weights (no staging of raw bytes needed)."""
    return cpu_dtype == "bf16" and nodes == 1 and D % 64 == 0 and F % 64 == 0 and D % ROW_ALIGN == 0


def resident_expert_bytes(D: int, F: int, kind: str, compute_bytes: int = 2) -> int:
    """VRAM of one resident expert in `kind` (RESIDENT_KINDS): gate and up as one [2F, D] matrix and down [D, F]
    (hybrid.offload.resident.QuantResidents; bf16: three copies in the compute dtype)."""
    if kind not in RESIDENT_KINDS:
        raise UsageError(f"resident experts' GPU dtype must be one of {', '.join(RESIDENT_KINDS)}, got {kind!r}")
    return gpu_weight_bytes(kind, 2 * F, D, compute_bytes) + gpu_weight_bytes(kind, D, F, compute_bytes)


@dataclass(frozen=True)
class MemorySettings:
    """What besides the model decides the fixed part of VRAM and DRAM."""

    max_context: int = 4096  # C
    max_batch: int = 1  # B (KV slots = decode rows)
    cpu_dtype: str = "bf16"
    gpu_dtype_bytes: int = 2  # bf16 on the GPU
    staging_slots: int = 4  # HybridConfig.staging_slots; `hybrid plan` picks it unless given (choose_staging)
    ship_chunk: int = 8  # experts per staging slot, HybridConfig.ship_chunk; picked the same way
    reserve: int = DEFAULT_RESERVE
    node_threads: tuple[int, ...] = (1,)  # threads per NUMA node of the CPU executor
    group: int = INT4_GROUP
    # part (GPU_PARTS) -> GPU_KINDS, and RESIDENT_PART -> RESIDENT_KINDS; missing parts: bf16
    gpu_dtypes: dict = field(default_factory=dict)
    kv_dtype: str = "bf16"  # KV_DTYPES: the KV cache's values
    # the CPU dtype of each MoE layer's down that has one of its own (a GGUF file's mixed types:
    # hybrid.models.gguf.repack.down_format), one entry per such layer; the others' downs are in cpu_dtype
    down_dtypes: tuple[str, ...] = ()
    # the CPU dtype of each MoE layer's gate and up that has one of its own (a GGUF file of mixed types loaded in its
    # own formats: hybrid.models.gguf.repack.layer_format), one entry per such layer; their downs are in down_dtypes
    layer_dtypes: tuple[str, ...] = ()
    prefill_chunk: int = 8192  # hybrid.runtime.RuntimeConfig.prefill_chunk: tokens of one prefill pass

    def __post_init__(self):
        if self.max_context < 2:
            raise UsageError(f"--max-context must be at least 2, got {self.max_context}")
        if self.max_batch < 1:
            raise UsageError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.cpu_dtype not in CPU_DTYPES:
            raise UsageError(f"--cpu-dtype must be one of {', '.join(CPU_DTYPES)}, got {self.cpu_dtype!r}")
        if self.gpu_dtype_bytes not in (2, 4):
            raise UsageError(f"GPU dtype must be 2 or 4 bytes, got {self.gpu_dtype_bytes}")
        if self.staging_slots < 1:
            raise UsageError(f"--staging-slots must be at least 1, got {self.staging_slots}")
        if self.ship_chunk < 1:
            raise UsageError(f"--ship-chunk must be at least 1 expert, got {self.ship_chunk}")
        if self.kv_dtype not in KV_DTYPES:
            raise UsageError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.reserve < 0:
            raise UsageError(f"--reserve must be >= 0, got {self.reserve}")
        if self.prefill_chunk < 1:
            raise UsageError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if not self.node_threads or any(int(t) < 1 for t in self.node_threads):
            raise UsageError(f"every NUMA node needs >= 1 thread, got {self.node_threads}")
        object.__setattr__(self, "node_threads", tuple(int(t) for t in self.node_threads))
        for what, dtypes in (("a down's", self.down_dtypes), ("a layer's", self.layer_dtypes)):
            if any(d not in CPU_DTYPES for d in dtypes):
                raise UsageError(f"{what} CPU dtype must be one of {', '.join(CPU_DTYPES)}, got {dtypes}")
        object.__setattr__(self, "down_dtypes", tuple(self.down_dtypes))
        object.__setattr__(self, "layer_dtypes", tuple(self.layer_dtypes))
        for part, kind in self.gpu_dtypes.items():
            if part == RESIDENT_PART and kind not in RESIDENT_KINDS:
                raise UsageError(f"resident experts' GPU dtype must be one of {', '.join(RESIDENT_KINDS)}, got {kind!r}")
            if part != RESIDENT_PART and (part not in GPU_PARTS or kind not in GPU_KINDS):
                raise UsageError(f"GPU dtype {part}={kind!r}: parts are {', '.join(GPU_PARTS)}, dtypes "
                                 f"{', '.join(GPU_KINDS)}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes; `gpu_fixed` is everything on the GPU except resident experts."""

    non_expert: int
    kv_cache: int
    staging: int
    graph_buffers: int
    reserve: int
    resident_expert: int  # VRAM bytes of ONE resident expert
    dram_expert: int  # DRAM bytes of ONE expert (packed)
    dram_experts_all: int  # every expert of every MoE layer
    pinned_buffers: int
    parts: dict = field(default_factory=dict)  # non_expert split by part (non_expert_bytes), for reports
    prefill_activations: int = 0

    @property
    def gpu_fixed(self) -> int:
        return (self.non_expert + self.kv_cache + self.staging + self.graph_buffers + self.prefill_activations
                + self.reserve)

    @property
    def cpu_total(self) -> int:
        return self.dram_experts_all + self.pinned_buffers


def expert_bias_bytes(cfg) -> int:
    """VRAM of the routed experts' biases (gpt-oss): kept on the GPU in fp32 for every expert, resident or not
    (hybrid.offload.experts.HybridExperts.bias_dev; the ship and resident lanes read them). 0 without biases."""
    if not cfg.expert_fn.bias:
        return 0
    return cfg.num_moe_layers * cfg.num_experts * (2 * cfg.expert_intermediate_size + cfg.hidden_size) * 4


def prefill_activation_bytes(cfg, tokens: int, gb: int, ship_chunk: int, context: int | None = None) -> int:
    """VRAM of one prefill pass's activations: `tokens` tokens attending `context` keys (None: the pass is the whole
    prompt). Per token of the pass (pass_bytes) the hidden states (6 x D: input, normed, residual, attention output
    and its projection, layer output), the wider of the attention's own temporaries (grouped-query q/k/v/output;
    MLA's q and output) and a dense or shared MLP's gate/up/activation, the fp32 MoE merge and router logits, and
    one expert group's rows (the ship lane's chunk of experts at uniform routing, at least one expert's, at most K
    per token) gathered, computed (gate, up, activation) and merged in fp32; plus what grows with the keys
    (context_bytes)."""
    L = tokens if context is None else max(context, tokens)
    return pass_bytes(cfg, tokens, gb, ship_chunk) + context_bytes(cfg, tokens, L, gb)


def pass_bytes(cfg, tokens: int, gb: int, ship_chunk: int) -> int:
    """The part of prefill_activation_bytes that grows with the pass's tokens alone."""
    D, F, K, E, H = cfg.hidden_size, cfg.expert_intermediate_size, cfg.experts_per_token, cfg.num_experts, cfg.num_heads
    if cfg.mla is None:
        attn = (2 * H + 2 * cfg.num_kv_heads) * cfg.head_dim
    else:
        m = cfg.mla
        attn = H * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    mlp = 3 * max(cfg.dense_intermediate_size, cfg.shared_expert_intermediate_size)
    per_token = gb * (6 * D + max(attn, mlp)) + 4 * D + 4 * E
    rows = tokens * min(K, max(1.0, K * ship_chunk / E))
    return int(tokens * per_token + rows * (gb * (2 * D + 3 * F) + 4 * D))


# hybrid.models.layers.ATTENTION_BLOCK_BYTES: the most one attention call over a long context holds beyond its inputs
ATTENTION_BLOCK_BYTES = 256 << 20
SINK_SCORE_BYTES = 7  # hybrid.models.layers.SINK_SCORE_BYTES: a sink-attention score's bytes at the most


def _blocked(units: int, per_unit: int) -> int:
    """Bytes of one attention call that takes as many `units` (queries, MLA heads) as fit ATTENTION_BLOCK_BYTES at
    `per_unit` bytes each (at least one; none when there are none): hybrid.models.layers.query_block's split."""
    return min(units, max(1, ATTENTION_BLOCK_BYTES // max(1, per_unit))) * per_unit


def context_bytes(cfg, tokens: int, context: int, gb: int) -> int:
    """What grows with the keys a pass attends (hybrid.models.layers.Attention._attend, hybrid.models.mla), one
    attention call's worth: the runtime splits a long pass over a long context into calls of at most
    ATTENTION_BLOCK_BYTES (query blocks; MLA head groups). MLA expands keys and values per head for every key
    (kv_b_proj's output, k, v padded to k's width); a pass over the cache (context > tokens) builds a boolean mask
    and SDPA its additive form, grouped-query heads folded into the query axis (H / Hkv per query and key);
    attention sinks (gpt-oss) add fp32 scores per head, fresh passes too (layers.SINK_SCORE_BYTES)."""
    H = cfg.num_heads
    expand = 0
    if cfg.mla is not None:
        m = cfg.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        expand, rep = _blocked(H, context * (m.qk_nope_head_dim + m.v_head_dim + 2 * qk) * gb), 1
    else:
        rep = H // cfg.num_kv_heads
    if cfg.attention_sinks:
        return expand + _blocked(tokens, rep * context * (1 + cfg.num_kv_heads * SINK_SCORE_BYTES))
    return expand + (_blocked(tokens, rep * context * (1 + gb)) if context > tokens else 0)


PREFILL_CHUNKS = (8192, 4096, 2048, 1024, 512)  # the prefill passes fit_prefill_chunk chooses from, largest first
ACTIVATION_SHARE = 1 / 16  # of --gpu-budget that one prefill pass's activations may take (a rule of thumb)


def fit_prefill_chunk(cfg, s: "MemorySettings", gpu_budget: int | None) -> int:
    """The prefill pass (tokens of one prompt per model pass) for a budget: the largest of PREFILL_CHUNKS whose
    activations (prefill_activation_bytes) take at most ACTIVATION_SHARE of the budget, else the smallest; without
    a budget, s.prefill_chunk. Larger passes amortize each pass's expert copies over more tokens (faster prefill),
    smaller ones leave the VRAM to resident experts (faster decode): a sixteenth of the card keeps DeepSeek-V3's
    passes at 4,096 tokens on 24 GiB and 8,192 on 140 GiB."""
    if gpu_budget is None:
        return s.prefill_chunk
    gb, C = s.gpu_dtype_bytes, s.max_context
    for chunk in PREFILL_CHUNKS:
        t = min(chunk, C)
        # what the pass's size decides: its own tokens' part and its mask over the cache (MLA's expansion over the
        # keys is the context's, whatever the pass)
        if pass_bytes(cfg, t, gb, s.ship_chunk) + context_bytes(cfg, t, C, gb) - context_bytes(cfg, 0, C, gb) \
                <= ACTIVATION_SHARE * gpu_budget:
            return chunk
    return PREFILL_CHUNKS[-1]


def router_fp32_bytes(cfg, gpu_dtype_bytes: int) -> int:
    """VRAM the sigmoid router (DeepSeek-V3, GLM-4.5) takes beyond the compute dtype: its weight and score bias
    are kept in fp32 (hybrid.models.moe.MoEBlock.fp32_params). 0 for the softmax router."""
    if cfg.router.kind != "sigmoid":
        return 0
    per_layer = cfg.num_experts * (cfg.hidden_size + int(cfg.router.score_bias))
    return cfg.num_moe_layers * per_layer * max(0, 4 - gpu_dtype_bytes)


def breakdown(cfg, s: MemorySettings) -> MemoryBreakdown:
    """The fixed memory of model `cfg` (a hybrid.models.ModelConfig) under settings `s`."""
    D, F, K = cfg.hidden_size, cfg.expert_intermediate_size, cfg.experts_per_token
    gb = s.gpu_dtype_bytes
    parts = non_expert_bytes(cfg, s.gpu_dtypes, gb)
    non_expert = sum(parts.values()) + expert_bias_bytes(cfg) + router_fp32_bytes(cfg, gb)
    kv = s.max_batch * (s.max_context + 1) * cfg.kv_values_per_token * kv_value_bytes(s.kv_dtype, gb)
    dense = 3 * D * F * gb
    resident_kind = s.gpu_dtypes.get(RESIDENT_PART, "bf16")
    resident = dense if resident_kind == "bf16" else resident_expert_bytes(D, F, resident_kind, gb)
    packed = packed_expert_bytes(D, F, s.cpu_dtype, list(s.node_threads), s.group)

    def gate_up(dtype: str) -> int:  # an expert's gate and up, packed in `dtype`
        return packed_expert_bytes(D, F, dtype, list(s.node_threads), s.group) - down_bytes(D, F, dtype, s.node_threads,
                                                                                            s.group)

    # raw staging holds the largest layout of any layer (a layer whose gate and up, or down, has a dtype of its own
    # differs): the largest gate and up beside the largest down, an upper bound
    own_down = max((down_bytes(D, F, d, s.node_threads, s.group) for d in s.down_dtypes), default=0)
    raw = 0 if dense_layout(D, F, s.cpu_dtype, len(s.node_threads)) and not s.layer_dtypes else \
        max(gate_up(d) for d in (s.cpu_dtype, *s.layer_dtypes)) + max(
            down_bytes(D, F, s.cpu_dtype, s.node_threads, s.group), own_down)
    staging = s.staging_slots * s.ship_chunk * (dense + raw)
    # Decode graphs: one private pool sized by the largest bucket B; within a captured step a layer's
    # temporaries are freed before the next layer's, so the peak is about one layer's worth: q/k/v and
    # MLP rows (~16 [B, max(D, H*hd)] tensors), fp32 attention scores and probabilities [B, H, C+1], fp32
    # logits [B, V] twice (head output + the copy returned), and the graph CPU lane's output [>=64, D].
    B = s.max_batch
    # widest per-row activation: q/k/v heads, or MLA's per-head queries in latent space (absorbed decode)
    width = max(D, cfg.num_heads * (cfg.head_dim if cfg.mla is None else cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim))
    rows = s.max_context * s.max_batch  # the largest batch a call sees: a whole prompt of C tokens
    # CPU lane (hybrid.offload.host_lane): pinned x and out [T, D], ids [T, K] int32, weights [T, K] fp32,
    # and the device copy of out [T, D]; decode-sized buffers kept across growth (graphs point at them:
    # at most 2 x GRAPH_MAX_ROWS rows in all), larger ones grown by doubling (at most 2 x rows).
    lane_rows = 2 * rows + 2 * GRAPH_MAX_ROWS
    # per head and key: fp32 scores and probabilities; MLA's absorbed decode (hybrid.models.mla) also holds the
    # inverted mask and the probabilities rounded to the compute dtype
    score = 8 if cfg.mla is None else 8 + 1 + gb
    graph = (16 * B * width * gb + B * cfg.num_heads * (s.max_context + 1) * score + 2 * B * cfg.vocab_size * 4
             + lane_rows * D * gb)
    if any(k != "bf16" for k in s.gpu_dtypes.values()):  # one de-quantized row chunk (or MLA's kv_b) at a time
        kv_b = 0 if cfg.mla is None else cfg.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim) * cfg.mla.kv_lora_rank
        # quantized residents de-quantize whole experts, at least one at a time (hybrid.offload.resident)
        one = 3 * D * F if resident_kind != "bf16" else 0
        graph += max(DEQUANT_CHUNK_VALUES, kv_b, one) * gb
    pinned = lane_rows * (2 * D * gb + K * 8)
    n_experts = cfg.num_moe_layers * cfg.num_experts
    # layers whose down has a dtype of its own hold that many more (or fewer) bytes per expert
    own_downs = sum(down_bytes(D, F, d, s.node_threads, s.group) - down_bytes(D, F, s.cpu_dtype, s.node_threads, s.group)
                    for d in s.down_dtypes) * cfg.num_experts
    # and layers whose gate and up have one
    own_downs += sum(gate_up(d) - gate_up(s.cpu_dtype) for d in s.layer_dtypes) * cfg.num_experts
    # one prompt's pass at a time (the server's batched prefill pads rows x chunk to at most its --prefill-chunk),
    # the last of a prompt that fills the context attending all of it
    acts = prefill_activation_bytes(cfg, min(s.prefill_chunk, s.max_context), gb, s.ship_chunk, s.max_context)
    return MemoryBreakdown(non_expert=non_expert, kv_cache=kv, staging=staging, graph_buffers=graph, reserve=s.reserve,
                           resident_expert=resident, dram_expert=packed, dram_experts_all=n_experts * packed + own_downs,
                           pinned_buffers=pinned, parts=parts, prefill_activations=acts)


def gib(n: float) -> str:
    """A size for messages: GiB from 1 GiB up, else MiB (enough digits to act on)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
