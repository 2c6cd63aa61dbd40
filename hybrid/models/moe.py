"""The MoE block and its swappable expert executor.

MoEBlock.forward(hidden [T, D]) -> [T, D] routes (select_experts: the config's router kind over the E router
logits in fp32, top-K, optional renormalisation of the K weights), hands the routed work to `self.experts`,
and adds the shared expert (Qwen2-MoE: scaled by a sigmoid gate; DeepSeek-V3: as is) itself.

Expert executor interface (what the hybrid layer implements and swaps in per layer, e.g.
`model.layers[i].moe.experts = HybridExperts(...)`):

    experts(x [T, D], topk_ids [T, K] int64, topk_weights [T, K] float32) -> [T, D] in x.dtype

    out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]

(with the config's ExpertFn: gpt-oss's clamped SwiGLU and per-expert biases; `expert_forward`)

the same contract as cpu_kernels.reference.moe_forward. It must not synchronise with the host if it
is to run inside the captured decode graph. The default, StackedExperts, holds the expert weights
stacked as w_gate, w_up [E, F, D] and w_down [E, D, F] (rows of nn.Linear weights, as checkpoints
store them) on one device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import gpu_kernels
from hybrid.models.config import ExpertFn, ModelConfig, RouterConfig
from hybrid.models.layers import GatedMLP, param

SILU = ExpertFn()
Biases = tuple  # (b_gate [E, F], b_up [E, F], b_down [E, D]) of the experts a call computes, or None

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device/dtype (CUDA: bf16 on sm90+; CPU: recent torch).
    Probed once, because the fallback loop needs a host sync and so cannot be graph-captured."""
    key = (str(device), dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.ones(4, 16, device=device, dtype=dtype)
                b = torch.ones(2, 16, 16, device=device, dtype=dtype)
                offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
                y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                ok = bool((y == 16).all())
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def gated(fn: ExpertFn, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(gate, up) of ExpertFn `fn` (cpu_kernels.reference.gated_activation: the CPU executor's own)."""
    if fn.activation == "silu":
        return F.silu(g) * u
    from cpu_kernels.reference import gated_activation

    return gated_activation(g, u, fn.activation, fn.alpha, fn.limit)


def expert_forward(x: torch.Tensor, w_gate, w_up, w_down, fn: ExpertFn = SILU, b_gate=None, b_up=None,
                   b_down=None) -> torch.Tensor:
    """One expert: x [m, D] -> down(act(gate x + b_gate, up x + b_up)) + b_down [m, D] (biases optional)."""
    g, u = F.linear(x, w_gate, _cast(b_gate, x)), F.linear(x, w_up, _cast(b_up, x))
    return F.linear(gated(fn, g, u), w_down, _cast(b_down, x))


def _cast(b, x):
    return None if b is None else b.to(x.dtype)


def grouped_swiglu(rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   offs: torch.Tensor, fn: ExpertFn = SILU, biases: Biases | None = None) -> torch.Tensor:
    """rows [n, D] grouped by expert (offs [G] int32: end row of each group) through G experts'
    down(act(gate(x)) * up(x)); w_gate, w_up [G, F, D], w_down [G, D, F] -> [n, D]. Three grouped GEMMs;
    biases (b_gate, b_up [G, F], b_down [G, D]) are gathered per row by its group (no host sync)."""
    g = torch._grouped_mm(rows, w_gate.transpose(1, 2), offs=offs)  # [n, F]
    u = torch._grouped_mm(rows, w_up.transpose(1, 2), offs=offs)
    if biases is not None:
        # group of each row: how many groups end at or before it (rows past offs[-1] are not computed)
        grp = torch.searchsorted(offs, torch.arange(rows.shape[0], device=rows.device, dtype=offs.dtype), right=True)
        grp = grp.clamp(max=offs.shape[0] - 1)
        g, u = g + biases[0][grp].to(g.dtype), u + biases[1][grp].to(u.dtype)
    y = torch._grouped_mm(gated(fn, g, u), w_down.transpose(1, 2), offs=offs)
    return y if biases is None else y + biases[2][grp].to(y.dtype)


class StackedExperts(nn.Module):
    """All E experts of one layer on one device; see the module docstring for the contract.

    Tokens are sorted by expert so each expert sees one contiguous block of rows; with
    torch._grouped_mm that is three grouped GEMMs with no host sync (decode is graph-capturable).
    Without it, a loop over the experts that received tokens (host sync; eager only)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device=None, dtype=None,
                 fn: ExpertFn = SILU):
        super().__init__()
        E, D, F_ = num_experts, hidden, intermediate
        kw = {"device": device, "dtype": dtype}
        biases = None
        if fn.bias:  # fp32 whatever the weights' dtype, as the CPU executor keeps them
            biases = tuple(torch.empty(E, n, device=device, dtype=torch.float32) for n in (F_, F_, D))
        self._init(torch.empty(E, F_, D, **kw), torch.empty(E, F_, D, **kw), torch.empty(E, D, F_, **kw), fn, biases)

    def _init(self, w_gate, w_up, w_down, fn: ExpertFn, biases: Biases | None) -> None:
        self.w_gate = nn.Parameter(w_gate, requires_grad=False)  # [E, F, D]
        self.w_up = nn.Parameter(w_up, requires_grad=False)  # [E, F, D]
        self.w_down = nn.Parameter(w_down, requires_grad=False)  # [E, D, F]
        self.fn = fn
        self.gate_bias = self.up_bias = self.down_bias = None  # [E, F], [E, F], [E, D] fp32 (gpt-oss)
        if biases is not None:
            self.gate_bias, self.up_bias, self.down_bias = (nn.Parameter(b, requires_grad=False) for b in biases)
        self.num_experts = w_gate.shape[0]
        self.mode = "auto"

    @classmethod
    def from_weights(cls, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, fn: ExpertFn = SILU,
                     biases: Biases | None = None) -> "StackedExperts":
        """Wraps existing stacked tensors (and biases) without copying them."""
        ex = cls.__new__(cls)
        nn.Module.__init__(ex)
        ex._init(w_gate, w_up, w_down, fn, biases)
        return ex

    @property
    def biases(self) -> Biases | None:
        return None if self.gate_bias is None else (self.gate_bias, self.up_bias, self.down_bias)

    # mode: "grouped" (sort + grouped GEMMs; the default, "auto") or "dense" (every expert on every
    # token, weighted by a [T, E] matrix that is zero where a token did not route; plain batched
    # GEMMs that read each expert once). Dense measured no faster than grouped at small decode batches on
    # the GPU, and slower at some, so "auto" means grouped; dense stays as a second reference in the tests.
    def _dense(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        T, D, E = x.shape[0], x.shape[1], self.num_experts
        comb = torch.zeros(T, E, dtype=torch.float32, device=x.device)
        comb.scatter_(1, topk_ids, topk_weights.float())  # [T, E]
        xe = x.unsqueeze(0).expand(E, T, D)  # [E, T, D]
        g, u = torch.bmm(xe, self.w_gate.transpose(1, 2)), torch.bmm(xe, self.w_up.transpose(1, 2))  # [E, T, F]
        b = self.biases
        if b is not None:
            g, u = g + b[0][:, None].to(g.dtype), u + b[1][:, None].to(u.dtype)
        y = torch.bmm(gated(self.fn, g, u), self.w_down.transpose(1, 2))  # [E, T, D]
        if b is not None:
            y = y + b[2][:, None].to(y.dtype)
        return (y.float() * comb.t()[:, :, None]).sum(0)  # [T, D] fp32

    @property
    def capturable(self) -> bool:
        """True when forward runs without a host sync (grouped GEMMs), so decode can be graph-captured.
        On CUDA only bf16 qualifies: for other dtypes torch._grouped_mm falls back to a loop that
        reads the group offsets on the host."""
        dev, dt = self.w_gate.device, self.w_gate.dtype
        return grouped_mm_works(dev, dt) and (dev.type != "cuda" or dt == torch.bfloat16)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        T, K = topk_ids.shape
        D = x.shape[1]
        dev = self.w_gate.device
        xin = x.to(device=dev, dtype=self.w_gate.dtype)
        if self.mode == "dense":
            out = self._dense(xin, topk_ids.to(dev), topk_weights.to(dev))
            return out.to(device=x.device, dtype=x.dtype)
        flat = topk_ids.reshape(-1).to(dev)  # [T*K]
        order = torch.argsort(flat, stable=True)  # [T*K] assignments grouped by expert
        rows = xin[order // K]  # [T*K, D]
        if self.capturable:
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=dev)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = counts.cumsum(0, dtype=torch.int32)  # [E] end row of each expert's block
            y = grouped_swiglu(rows, self.w_gate, self.w_up, self.w_down, offs, self.fn, self.biases)  # [T*K, D]
        else:
            y = torch.empty(T * K, D, dtype=xin.dtype, device=dev)
            counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host sync
            start = 0
            for e, n in enumerate(counts):
                if n:
                    b = () if self.biases is None else tuple(t[e] for t in self.biases)
                    y[start:start + n] = expert_forward(rows[start:start + n], self.w_gate[e], self.w_up[e],
                                                        self.w_down[e], self.fn, *b)
                    start += n
        # Weight in fp32 and sum the K contributions of each token without atomics (deterministic).
        y = y.float() * topk_weights.reshape(-1).to(dev)[order, None]  # [T*K, D]
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(T, K, D).sum(1).to(device=x.device, dtype=x.dtype)


def select_experts(logits: torch.Tensor, router: RouterConfig, top_k: int, norm_topk_prob: bool,
                   score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (topk_ids [T, K] int64, topk_weights [T, K] fp32), the executor's input.

    softmax: top-K of the probabilities. sigmoid (DeepSeek-V3 "noaux_tc"; transformers'
    DeepseekV3TopkRouter): independent scores; `score_bias` [E] shifts them for the choice only; with
    n_group > 1 only the topk_group groups whose two best (biased) scores sum highest are eligible; the
    weights are the unbiased scores of the chosen experts. Then optional renormalisation, and the
    routed scaling factor."""
    if router.kind == "softmax" and norm_topk_prob:
        # softmax over all E, top-K, renormalised = softmax over the top-K logits (the same choice, since
        # softmax is monotonic, and the same weights up to rounding): 2 kernels instead of 4 per layer
        logit_k, ids = torch.topk(logits, top_k, dim=-1)  # [T, K]
        weights = torch.softmax(logit_k, dim=-1)
    elif router.kind == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)  # [T, K]
    else:
        scores = torch.sigmoid(logits)  # [T, E]
        choice = scores if score_bias is None else scores + score_bias
        if router.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, router.n_group, E // router.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_score, router.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
        ids = torch.topk(choice, top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # the reference's epsilon
    if router.scaling != 1.0:
        weights = weights * router.scaling
    return ids, weights


class MoEBlock(nn.Module):
    """Router + expert executor (+ shared expert). forward(hidden [T, D]) -> [T, D]."""

    def __init__(self, cfg: ModelConfig, experts: nn.Module | None):
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router_cfg = cfg.router
        self.router = param(cfg.num_experts, cfg.hidden_size)  # [E, D]
        self.score_bias = param(cfg.num_experts) if cfg.router.score_bias else None  # [E]
        self.router_bias = param(cfg.num_experts) if cfg.router_bias else None  # [E] (gpt-oss)
        # The sigmoid router scores in fp32 from fp32 weights, as its reference keeps them
        # (DeepseekV3 _keep_in_fp32_modules_strict); the loader allocates these names in fp32.
        self.fp32_params = ("router", "score_bias") if cfg.router.kind == "sigmoid" else ()
        self._router_scratch = None  # router_gemv_topk's buffers, made by its first call
        # None while loading with experts kept elsewhere; the loader installs the executor.
        self.experts = experts
        self.shared = self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_gate = param(1, cfg.hidden_size)  # [1, D]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, K] int64, topk_weights [T, K] fp32)."""
        if self.fp32_params:
            logits = F.linear(x.float(), self.router.float())  # [T, E]
            r = self.router_cfg
            if r.kind == "sigmoid" and gpu_kernels.fused_enabled(logits):
                from hybrid.gpu_kernels.router import router_sigmoid_topk  # ~12 kernels in one

                return router_sigmoid_topk(logits, self.score_bias, self.top_k, self.norm_topk_prob, r.n_group,
                                           r.topk_group, r.scaling)
        else:
            if self._gemv_router(x):
                return self._route_gemv(x)
            logits = F.linear(x, self.router, self.router_bias)
            if self.router_cfg.kind == "softmax" and gpu_kernels.fused_enabled(logits):
                from hybrid.gpu_kernels.router import router_topk  # cast, top-k and softmax in one kernel

                return router_topk(logits, self.top_k, self.norm_topk_prob, self.router_cfg.scaling)
            logits = logits.float()
        return select_experts(logits, self.router_cfg, self.top_k, self.norm_topk_prob, self.score_bias)

    def _gemv_router(self, x: torch.Tensor) -> bool:
        """Softmax routers at decode sizes with the fused kernels on: the logits GEMV joins the top-k kernel."""
        if self.router_cfg.kind != "softmax" or self.fp32_params or not gpu_kernels.fused_enabled(x):
            return False
        if self._router_scratch is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
            # buffers made inside a capture would hold their zeros only once the graph replays (the decode
            # graphs warm up eagerly first, so this is a safety net): route this capture the unfused way
            return False
        from hybrid.gpu_kernels.router import router_gemv_supported

        return router_gemv_supported(x, self.router)

    def _route_gemv(self, x: torch.Tensor, into: tuple | None = None):
        from hybrid.gpu_kernels.router import RouterScratch, router_gemv_topk

        if self._router_scratch is None:  # made once, by the first call (an eager one, before any capture)
            self._router_scratch = RouterScratch(self.router.shape[0], x.device)
        return router_gemv_topk(x, self.router, self.router_bias, self.top_k, self.norm_topk_prob,
                                self.router_cfg.scaling, self._router_scratch, into=into)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A captured step's CPU lane can take its inputs (the row, ids, weights) straight from the router
        # kernel, written into its page-locked buffers: then it needs no packing kernel of its own.
        gemv = self._gemv_router(x)
        ask = getattr(self.experts, "lane_inputs", None)
        into = ask(x, self.top_k) if ask is not None and gemv else None
        ids, weights = self._route_gemv(x, into) if gemv else self.route(x)
        return self._experts_out(x, ids, weights, into)

    def _experts_out(self, x, ids, weights, into) -> torch.Tensor:
        """The routed experts' output (+ the shared expert's) for rows x; into: where the router wrote the CPU
        lane's inputs (lane_inputs), or None."""
        if into is not None:
            out = self.experts(x, ids, weights, inputs_written=True)
        else:
            out = self.experts(x, ids, weights)  # [T, D]
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(F.linear(x, self.shared_gate)) * shared)
        return out
