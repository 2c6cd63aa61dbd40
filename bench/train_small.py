"""Train a small MoE model of one of our families on bench.corpus's English text and save it as a Hugging Face
checkpoint that hybrid loads: a model that has learned something, for quality figures that random weights cannot
give (what int8 / int4 experts or expert deferral cost in perplexity and greedy agreement).

    python -m bench.train_small --family qwen3_moe --out /tmp/q3-small                     # GPU: --size small
    python -m bench.train_small --family deepseek_v3 --size tiny --device cpu --out /tmp/ds-tiny
    python -m bench.train_small --family qwen3_moe --corpus DIR --steps 2000 --out DIR      # a carried corpus

transformers' own model classes are the trainer (Qwen3MoeForCausalLM: fine-grained experts, 64 of them top-8
in --size small; DeepseekV3ForCausalLM: MLA, one shared expert, sigmoid routing limited to topk_group of n_group
groups, a dense first layer, routed_scaling_factor), with a byte-level BPE tokenizer trained here by the
`tokenizers` library. Training: AdamW, linear warmup then cosine decay, gradient clipping, bf16 autocast and TF32
on CUDA (fp32 master weights); Qwen3-MoE adds transformers' load-balancing loss, DeepSeek-V3 balances its experts
the way DeepSeek-V3 does, without a loss: each step moves every router's e_score_correction_bias towards the
experts that got fewer tokens. --size small (and wide, Qwen3-30B-A3B's widths in 4 layers) trains for a time
budget (--budget-s, measured on the first steps) and keeps the weights of the step with the best loss on a
validation slice cut from the end of the training text; held-out documents are only read for the final report.

The report (stdout and OUT/training.json) gives the held-out perplexity and the unigram baseline's (a unigram
model of the training tokens with add-one smoothing, on the same held-out tokens). OUT holds config.json,
model.safetensors (bf16; DeepSeek-V3's e_score_correction_bias in fp32, as published), tokenizer.json (padded
with placeholder tokens <idN> up to the vocabulary, as bench.make_checkpoint does), tokenizer_config.json (the
demo's ChatML template), generation_config.json and training.json. compare_logits() checks that hybrid's loader
and transformers give the same logits from OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybrid.errors import UsageError

FAMILIES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma) for its auxiliary-loss-free balancing


@dataclass(frozen=True)
class Size:
    """A model size and how it trains. steps=None: as many as budget_s allows (at most max_steps)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    experts: int
    top_k: int
    expert_ffn: int
    seq_len: int
    batch: int
    lr: float
    warmup: int
    steps: int | None
    max_steps: int = 100_000
    max_epochs: float = 1e9  # a cap on steps: passes over the training tokens (more only overfit a small corpus)
    budget_s: float = 0.0
    val_tokens: int = 0  # the validation slice for keeping the best weights (0: keep the last ones)
    eval_every: int = 0
    eval_tokens: int = 1 << 30  # held-out tokens read for the final report (at most)
    # CPU threads while training (None: torch's default). Tiny's 64-wide matrices gain little from a second
    # thread, and on a busy machine a pool of 2 waits on its descheduled thread at every op (10x slower, measured).
    cpu_threads: int | None = None
    qwen3: dict = field(default_factory=dict)
    deepseek: dict = field(default_factory=dict)


SIZES = {
    # CI: seconds on 2 CPU cores.
    "tiny": Size(vocab=1024, hidden=64, layers=2, heads=4, experts=16, top_k=4, expert_ffn=32, seq_len=64,
                 batch=16, lr=3e-3, warmup=20, steps=300, eval_tokens=16384, cpu_threads=1,
                 qwen3=dict(num_key_value_heads=2, head_dim=16),
                 deepseek=dict(n_group=4, topk_group=2, intermediate_size=128, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # The built-in demo (hybrid/runtime/demo_model, shipped in the package): small enough to ship (~4 MB in bf16),
    # large enough to print English-like text; minutes on 2 CPU cores.
    "demo": Size(vocab=2048, hidden=128, layers=4, heads=4, experts=16, top_k=4, expert_ffn=64, seq_len=128,
                 batch=32, lr=2e-3, warmup=50, steps=1500, val_tokens=16384, eval_every=250, eval_tokens=32768,
                 qwen3=dict(num_key_value_heads=2, head_dim=32),
                 deepseek=dict(n_group=4, topk_group=2, intermediate_size=256, q_lora_rank=64, kv_lora_rank=64,
                               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)),
    # One H200 for ~5 minutes: 64 fine-grained experts top-8, a budget of 240 s of steps.
    "small": Size(vocab=8192, hidden=512, layers=8, heads=8, experts=64, top_k=8, expert_ffn=256, seq_len=512,
                  batch=16, lr=1e-3, warmup=100, steps=None, max_steps=6000, max_epochs=8, budget_s=240.0,
                  val_tokens=32768, eval_every=250,
                  qwen3=dict(num_key_value_heads=4, head_dim=64),
                  deepseek=dict(n_group=8, topk_group=4, intermediate_size=1024, q_lora_rank=256, kv_lora_rank=128,
                                qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)),
}
# Qwen3-30B-A3B's MoE and attention widths (hidden 2048, 128 experts of 768 top-8, 32 query / 4 KV heads of 128) in 4
# layers, trained as small is: experts of the real size, so that decode on it reads DRAM as the full model's does
# (4.5 GiB of bf16 experts, far past a last-level cache), with routing that was learned (bench.resident_trained).
# ~40 GiB of GPU memory with AdamW's state; one H100 for a budget of 100 s of steps.
SIZES["wide"] = replace(SIZES["small"], hidden=2048, layers=4, heads=32, experts=128, expert_ffn=768, lr=6e-4,
                        warmup=50, budget_s=100.0, qwen3=dict(num_key_value_heads=4, head_dim=128),
                        deepseek=dict(n_group=8, topk_group=4, intermediate_size=6144, q_lora_rank=768,
                                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))


# -- tokenizer and data ---------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer of at most vocab_size tokens (the demo's special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from hybrid.runtime.demo import SPECIALS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_documents(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """One stream of token ids: every document followed by the end-of-text token."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows of `stream` at random offsets (inputs and shifted targets in one)."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None]
    return stream[idx.to(stream.device)]


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """[n, seq_len + 1] consecutive windows whose targets tile the stream once (at most max_tokens targets)."""
    n = min((stream.numel() - 1) // seq_len, max(1, max_tokens // seq_len))
    if n < 1:
        raise UsageError(f"held-out text has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None]
    return stream[idx.to(stream.device)]


def unigram_perplexity(train: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    """Perplexity on `targets` of the add-one-smoothed unigram distribution of the `train` tokens."""
    counts = torch.bincount(train.flatten().cpu(), minlength=vocab).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return math.exp(-logp[targets.flatten().cpu()].mean().item())


# -- model ------------------------------------------------------------------------------------------------------------
def hf_config(family: str, size: Size, vocab: int, eos_id: int, max_positions: int):
    """transformers config of `family` at `size` (the fields our loader reads; see hybrid/models/families)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                  num_attention_heads=size.heads, num_experts_per_tok=size.top_k, moe_intermediate_size=size.expert_ffn,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=0.02,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, norm_topk_prob=True)
    if family == "qwen3_moe":
        kw = dict(common, num_experts=size.experts, intermediate_size=4 * size.hidden, router_aux_loss_coef=1e-3,
                  **size.qwen3)
    else:  # MLA expands keys and values for every head: kv heads = heads
        kw = dict(common, n_routed_experts=size.experts, n_shared_experts=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, num_key_value_heads=size.heads, **size.deepseek)
    return getattr(transformers, FAMILIES[family][0])(**kw)


def build_model(family: str, cfg, device: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    return getattr(transformers, FAMILIES[family][1])(cfg).to(device)


def param_counts(model, top_k: int, experts: int) -> dict[str, int]:
    """Total parameters and those one token uses (a routed expert's share is top_k / experts)."""
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "active": total - routed + routed * top_k // experts}


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: counts each router's chosen experts during the step, then moves
    its e_score_correction_bias by `rate` up for experts below the mean load and down for those above."""

    def __init__(self, model, rate: float = BIAS_UPDATE_RATE):
        self.rate, self.counts = rate, {}
        self.hooks = [m.register_forward_hook(self._count) for m in model.modules()
                      if hasattr(m, "e_score_correction_bias")]

    def _count(self, router, _inputs, outputs):
        if router.training:
            ids = outputs[-1].detach().flatten()
            c = torch.bincount(ids, minlength=router.e_score_correction_bias.numel())
            self.counts[router] = self.counts.get(router, 0) + c

    @torch.no_grad()
    def update(self) -> None:
        for router, c in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(c.float().mean() - c.float())
        self.counts = {}

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def lr_at(step: int, size: Size, total: int) -> float:
    """Linear warmup over size.warmup steps, then cosine decay to a tenth of size.lr at step `total`."""
    if step < size.warmup:
        return size.lr * (step + 1) / size.warmup
    frac = min(1.0, (step - size.warmup) / max(1, total - size.warmup))
    return size.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def make_optimizer(model, size: Size):
    """AdamW with weight decay on matrices only (not on norms, biases or the router's bias buffer)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=size.lr, betas=(0.9, 0.95), eps=1e-8, **fused)


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext()


def _forward(model, batch: torch.Tensor, aux: bool):
    """Next-token cross-entropy over the window (labels shifted here, so every target is predicted once)."""
    import torch.nn.functional as F

    kw = {"output_router_logits": True} if aux else {}
    out = model(input_ids=batch[:, :-1], **kw)
    loss = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    total = loss
    if aux and getattr(out, "aux_loss", None) is not None:
        total = loss + model.config.router_aux_loss_coef * out.aux_loss
    return total, loss


@torch.no_grad()
def mean_nll(model, windows: torch.Tensor, device: str, batch: int) -> float:
    """Mean next-token negative log-likelihood (nats) over every target of `windows`."""
    import torch.nn.functional as F

    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        with autocast(device):
            logits = model(input_ids=w[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n += w[:, 1:].numel()
    model.train(was)
    return total / n


def pick_experts_implementation(model, batch: torch.Tensor, device: str, aux: bool, log=print) -> str:
    """The experts implementation transformers chose (grouped_mm where it runs), or eager if a forward and
    backward with it fail on this device and dtype (grouped GEMM kernels differ between builds)."""
    chosen = getattr(model.config, "_experts_implementation", None) or "eager"
    try:
        _forward_backward(model, batch, device, aux)
        return chosen
    except Exception as exc:  # noqa: BLE001 - any failure of the probe step; eager's own failure is raised
        if chosen == "eager" or not hasattr(model, "set_experts_implementation"):
            raise
        log(f"experts implementation {chosen!r} failed here ({str(exc).splitlines()[0][:120]}); using eager")
        model.set_experts_implementation("eager")
        _forward_backward(model, batch, device, aux)
        return "eager"
    finally:
        model.zero_grad(set_to_none=True)


def _forward_backward(model, batch, device, aux):
    with autocast(device):
        total, lm = _forward(model, batch, aux)
    total.backward()
    return lm


class BestWeights:
    """The model's weights (and buffers) at its lowest validation loss so far."""

    def __init__(self):
        self.loss, self.state = None, None

    def offer(self, loss: float, model) -> bool:
        if self.loss is not None and loss >= self.loss:
            return False
        self.loss, self.state = loss, {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    def restore(self, model) -> None:
        if self.state is not None:
            model.load_state_dict(self.state)


@dataclass
class TrainResult:
    steps: int
    tokens: int
    epochs: float
    seconds: float
    train_loss: float
    best_val_nll: float | None
    experts_implementation: str


def step_cap(size: Size, train_tokens: int) -> int:
    """size.max_steps, or fewer where that would pass over the training tokens more than size.max_epochs times."""
    return max(1, min(size.max_steps, int(size.max_epochs * train_tokens / (size.batch * size.seq_len))))


def train(model, family: str, size: Size, train_ids: torch.Tensor, val_windows: torch.Tensor | None, device: str,
          seed: int, log=print) -> TrainResult:
    """Trains `model` in place on random windows of `train_ids` for size.steps steps (or as many as size.budget_s
    seconds hold, timed on steps 5-15); with validation windows, ends with the best validated weights."""
    gen = torch.Generator().manual_seed(seed)
    aux = family == "qwen3_moe"
    balancer = BiasBalancer(model) if family == "deepseek_v3" else None
    model.train()
    impl = pick_experts_implementation(model, sample_batch(train_ids, 2, size.seq_len, gen), device, aux, log)
    if balancer:
        balancer.counts = {}  # the probe's routes
    opt = make_optimizer(model, size)
    cap = step_cap(size, train_ids.numel())
    total = size.steps or cap
    best, recent, t0, t_timed = BestWeights(), [], time.perf_counter(), None
    step = 0
    while step < total:
        step += 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, size, total)
        lm = _forward_backward(model, sample_batch(train_ids, size.batch, size.seq_len, gen), device, aux)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if balancer:
            balancer.update()
        recent = [*recent[-19:], lm.detach()]  # read back only when logged: no device sync per step
        if size.steps is None and step in (5, 15):  # the budget's step count, from the time of steps 6-15
            _sync(device)
            if step == 5:
                t_timed = time.perf_counter()
            else:
                per_step = (time.perf_counter() - t_timed) / 10
                total = max(step + 1, min(cap, int(size.budget_s / per_step)))
                log(f"{per_step * 1e3:.1f} ms per step: {total} steps in the {size.budget_s:.0f} s budget")
        if step % 50 == 0 or step == total:
            log(f"step {step}/{total} loss {torch.stack(recent).mean().item():.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {time.perf_counter() - t0:.0f} s")
        if val_windows is not None and size.eval_every and (step % size.eval_every == 0 or step == total):
            val = mean_nll(model, val_windows, device, size.batch)
            log(f"step {step}: validation loss {val:.3f}{' (best)' if best.offer(val, model) else ''}")
    _sync(device)
    seconds = time.perf_counter() - t0
    if balancer:
        balancer.remove()
    best.restore(model)
    tokens = total * size.batch * size.seq_len
    return TrainResult(steps=total, tokens=tokens, epochs=tokens / train_ids.numel(), seconds=seconds,
                       train_loss=torch.stack(recent).mean().item(), best_val_nll=best.loss,
                       experts_implementation=impl)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- checkpoint -------------------------------------------------------------------------------------------------------
def save_checkpoint(model, tok, out: Path, eos_ids: list[int]) -> Path:
    """config.json + model.safetensors (bf16; router score biases fp32) + tokenizer files + generation config."""
    import shutil
    import tempfile

    from hybrid.runtime.demo import CHAT_TEMPLATE, pad_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    biases = {n: b.detach().float().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    model.to(torch.bfloat16)
    for n, b in biases.items():  # published DeepSeek-V3 checkpoints keep the score bias in fp32
        owner, attr = n.rsplit(".", 1)
        setattr(model.get_submodule(owner), attr, b.to(next(model.parameters()).device))
    model.config.use_cache = True
    model.save_pretrained(str(out))
    model.float()  # bf16 values in fp32 from here on: what a loader of `out` computes with
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "tokenizer.json"
        tok.save(str(raw))
        pad_tokenizer(raw, model.config.vocab_size, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": model.config.max_position_embeddings}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids, "do_sample": False}, indent=2))
    shutil.rmtree(out / "__pycache__", ignore_errors=True)
    return out


@torch.no_grad()
def compare_logits(path: Path, ids: list[int]) -> tuple[float, float]:
    """(max |hybrid - transformers|, max |transformers|) of the fp32 logits for `ids`: hybrid's loader and
    transformers' from_pretrained both read the checkpoint at `path` on the CPU."""
    import transformers

    from hybrid.models.loader import load_model
    from hybrid.runtime import Engine

    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    hf = getattr(transformers, raw["architectures"][0]).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    ref = hf(torch.tensor([ids])).logits[0].float()
    ours = Engine(load_model(path, progress=False), max_batch=1, max_context=len(ids) + 1, eager=True).forward(
        torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]))[0].float()
    return (ours - ref).abs().max().item(), ref.abs().max().item()


# -- the run ----------------------------------------------------------------------------------------------------------
def run(family: str, out: Path, size: Size, corpus: Path, device: str, seed: int = 0, log=print) -> dict:
    """Tokenizer, training, held-out report and checkpoint; returns the report (also OUT/training.json)."""
    with math_settings(size, device):
        return _run(family, out, size, corpus, device, seed, log)


@contextlib.contextmanager
def math_settings(size: Size, device: str):
    """size.cpu_threads on the CPU, TF32 for the fp32 matmuls outside autocast on CUDA (the loss, the router);
    both restored afterwards."""
    threads, tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    if device == "cpu" and size.cpu_threads:
        torch.set_num_threads(size.cpu_threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32 = tf32


@dataclass
class Data:
    """The tokenizer and the token streams of one corpus: training windows are drawn from `train`, `val` (or None)
    chooses the kept weights, `heldout` windows are read once for the report."""

    tok: object
    eos: int
    vocab: int
    train: torch.Tensor
    val: torch.Tensor | None
    heldout: torch.Tensor


def prepare_data(corpus: Path, size: Size, device: str) -> Data:
    """Trains the tokenizer on the training documents and cuts the validation slice off their end."""
    from bench.corpus import load_corpus
    from hybrid.runtime.demo import SPECIALS

    train_docs, heldout_docs = load_corpus(corpus)
    tok = train_tokenizer([d.text for d in train_docs], size.vocab)
    eos = tok.token_to_id(SPECIALS[0])
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64  # the model's rows: whole tiles
    stream = encode_documents(tok, [d.text for d in train_docs], eos)
    heldout = encode_documents(tok, [d.text for d in heldout_docs], eos)
    val = None
    if size.val_tokens:
        if stream.numel() < 4 * size.val_tokens:
            raise UsageError(f"{corpus}: {stream.numel()} training tokens are too few for a validation slice of "
                             f"{size.val_tokens}; use a larger corpus or --size tiny")
        stream, val_stream = stream[:-size.val_tokens], stream[-size.val_tokens:]
        val = eval_windows(val_stream, size.seq_len, size.val_tokens).to(device)
    if stream.numel() <= size.seq_len + 1:
        raise UsageError(f"{corpus}: {stream.numel()} training tokens, fewer than one window of {size.seq_len + 1}")
    report_windows = eval_windows(heldout, size.seq_len, size.eval_tokens).to(device)
    return Data(tok, eos, vocab, stream.to(device), val, report_windows)


def _run(family: str, out: Path, size: Size, corpus: Path, device: str, seed: int, log) -> dict:
    from bench.corpus import read_manifest
    from hybrid.runtime.demo import SPECIALS

    t_start = time.perf_counter()
    data = prepare_data(corpus, size, device)
    log(f"corpus {corpus}: {data.train.numel()} training tokens, {data.heldout[:, 1:].numel()} held out for the "
        f"report, vocabulary {data.vocab}")
    model = build_model(family, hf_config(family, size, data.vocab, data.eos, max(2048, size.seq_len)), device, seed)
    counts = param_counts(model, size.top_k, size.experts)
    log(f"{family}: {counts['total'] / 1e6:.2f} M parameters, {counts['active'] / 1e6:.2f} M active per token")
    result = train(model, family, size, data.train, data.val, device, seed, log)
    # Saving rounds the weights to bf16 in place: the report measures the checkpoint as written.
    save_checkpoint(model, data.tok, out, [data.eos, data.tok.token_to_id(SPECIALS[2])])
    manifest = read_manifest(corpus) or {}
    report = dict(
        family=family, device=device, steps=result.steps, tokens=result.tokens, epochs=round(result.epochs, 2),
        train_seconds=round(result.seconds, 1), tokens_per_s=round(result.tokens / max(result.seconds, 1e-9)),
        train_loss=round(result.train_loss, 4), best_validation_nll=result.best_val_nll,
        heldout_tokens=int(data.heldout[:, 1:].numel()),
        heldout_perplexity=math.exp(mean_nll(model, data.heldout, device, size.batch)),
        unigram_perplexity=unigram_perplexity(data.train, data.heldout[:, 1:], data.vocab),
        params=counts, vocab=data.vocab, experts_implementation=result.experts_implementation, seed=seed,
        size=dict(vars(size)), corpus={k: manifest.get(k) for k in ("source", "license", "heldout")})
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"held-out perplexity {report['heldout_perplexity']:.2f} (unigram baseline "
        f"{report['unigram_perplexity']:.2f}) on {report['heldout_tokens']} tokens; {result.steps} steps, "
        f"{result.tokens} tokens in {result.seconds:.0f} s; wrote {out}")
    return report


def pick_device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"--device {name!r}: use cuda, cuda:N or cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here; use --device cpu (with --size tiny)")
    return name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    p.add_argument("--size", choices=sorted(SIZES), help="default: small on CUDA, tiny on the CPU")
    p.add_argument("--steps", type=int, help="training steps (default: the size's, or small's time budget)")
    p.add_argument("--budget-s", type=float, help="seconds of training steps when --steps is not given (small, wide)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if there is one)")
    p.add_argument("--corpus", type=Path, help="corpus folder from bench.corpus (default $HYBRID_CACHE/corpus, "
                   "built on first use)")
    p.add_argument("--source", default="shakespeare", choices=("shakespeare", "stdlib"),
                   help="what the corpus is built from when --corpus is not given")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = pick_device(args.device)
    size = SIZES[args.size or ("small" if device.startswith("cuda") else "tiny")]
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        size = replace(size, steps=args.steps)
    if args.budget_s is not None:
        if args.steps is not None:
            raise UsageError("give --steps or --budget-s, not both")
        if not args.budget_s > 0:
            raise UsageError(f"--budget-s must be > 0, got {args.budget_s}")
        size = replace(size, steps=None, budget_s=args.budget_s)
    from bench.corpus import ensure_corpus

    corpus = args.corpus if args.corpus is not None else ensure_corpus(source=args.source)
    run(args.family, args.out, size, corpus, device, args.seed)
    return 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
