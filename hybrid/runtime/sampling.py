"""Token sampling: greedy (temperature 0), temperature, top-k, top-p, min-p, with a per-request seed; logit bias,
the OpenAI presence / frequency penalties, the HF / vLLM repetition penalty, min_tokens, and logprobs.

Safe for every accepted value: a temperature of 1e-40, a top_p of 1e-300 or a top_k larger than the
vocabulary never overflow, never produce NaN and always keep at least the most likely token, so
`torch.multinomial` always gets a valid distribution. The work is done in float64 after subtracting the
row's maximum: scaled logits are then <= 0 (the best token exactly 0), so dividing by a tiny
temperature can only push the others towards -inf, never the sum of exp() to inf or 0.

Two entry points:

- `sample(logits, params, generators)`: stateless (the CLI's loop). Options that need a sequence's history
  (penalties, min_tokens) or hand something back (logprobs) are refused with a ValueError, never ignored.
- `BatchSampler`: one per engine, for the server. `open(params, prompt_ids, end_ids)` gives each sequence its
  `SequenceSampler`; `sample(logits, samplers)` applies every option per row. Each sequence's generated-token
  counts live in one device tensor [rows, V] (a row per penalized sequence), so the penalties of a whole batch
  are a few vectorised ops after the decode step and no host sync beyond reading the tokens. A batch where no
  row uses an option takes exactly the stateless path: options off cost nothing.

Order per row (vLLM's): logit bias and the min_tokens mask, then the penalties, then the grammar's mask
(constrained decoding: last, so nothing re-allows a token it forbids), then temperature, min_p, top-k, top-p and
the draw. Logprobs are the raw model's: log_softmax of the logits before any of that.

Constrained decoding keeps the grammar's work off the step's critical path. A mask depends only on the tokens
consumed so far, so the next one is computed as soon as a token is consumed (and the first when the sequence
opens), on the BatchSampler's few threads (llguidance drops the GIL while it computes), while the next forward
step runs. Sampling then waits for it (an error in its computation raises there, never an unmasked row). Masks
stay llguidance's packed int32 bitmask ([rows, ceil(V / 32)], pinned on CUDA): one small copy to the device per
step, unpacked there by a bitwise AND with each bit's value.

All of it runs on the logits a decode step returned, never inside a captured CUDA graph. Only rows that are
`SamplingParams.greedy` (temperature 0 and no option that changes or reads the logits) may be decided on the
device by a queued-ahead step (hybrid.runtime.batching's decode ahead).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch


SEED_MOD = 1 << 64  # torch.Generator.manual_seed takes 0..2**64-1; other seeds wrap (two's complement for negatives)
SCORE_ROWS = 128  # prompt positions whose log-softmax is held at once when scoring a prompt (echo)
# threads computing grammar masks in the background: a mask is a small job (tens of microseconds inside a JSON
# schema's string over a 152 K vocabulary), and the CPU also runs the model's cold experts during the step it overlaps
GRAMMAR_THREADS = 2


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling, for the CLI and the server alike. The defaults are the CLI's (greedy); the
    server's request parsing passes its own (temperature 1, as OpenAI's API) explicitly."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request torch.Generator (same seed + prompt -> same tokens, batched or alone)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the earliest one
    min_p: float = 0.0  # 0 = off; else tokens less likely than min_p x the most likely one are dropped
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # 1 = off; tokens of the prompt or the output: logit / p if > 0, else x p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    stop_token_ids: tuple[int, ...] = ()  # end the completion like EOS (the caller's loop stops on them)
    ignore_eos: bool = False  # EOS does not end the completion (the caller's loop)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    logprobs: int | None = None  # None = off; k: each sampled token's logprob and the k most likely tokens'
    prompt_logprobs: int | None = None  # None = off; k: the same for every prompt token (the first: none)
    # a llguidance grammar (e.g. llguidance.LLMatcher.grammar_from_json_schema): every sampled token keeps the text
    # inside it, and once it is complete only an end id is allowed (constrained decoding, the server's
    # response_format); None = off
    grammar: str | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # (NaN fails this too)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if any(t < 0 or not math.isfinite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias needs token ids >= 0 and finite biases")
        if any(t < 0 for t in self.stop_token_ids) or self.min_tokens < 0:
            raise ValueError("stop_token_ids must be >= 0 and min_tokens >= 0")
        if any(k is not None and k < 0 for k in (self.logprobs, self.prompt_logprobs)):
            raise ValueError("logprobs and prompt_logprobs must be >= 0")

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs the sequence's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stateful(self) -> bool:
        """Whether sampling needs the sequence's history or hands something back (a SequenceSampler)."""
        return (self.penalized or self.min_tokens > 0 or self.logprobs is not None
                or self.prompt_logprobs is not None or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        """The plain argmax of the model's logits: temperature 0 and nothing that changes or reads the logits
        (min_p cannot change the argmax). Only such rows may be decided on the device (decode ahead)."""
        return self.temperature == 0 and not (self.logit_bias or self.stateful)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed % SEED_MOD)
        return g


class TokenLogprob(NamedTuple):
    """One token's log-probability under the raw model and the `top` most likely tokens' [(id, logprob)];
    logprob None for a prompt's first token (nothing predicts it)."""

    token: int
    logprob: float | None
    top: list


def _sanitized(logits: torch.Tensor) -> torch.Tensor:
    """float64 copy where NaN is -inf and, if any logit is +inf, those tokens share all the mass."""
    x = logits.to(torch.float64)
    if bool(torch.isfinite(x).all()):
        return x
    pos = torch.isposinf(x)
    if bool(pos.any()):
        return torch.where(pos, 0.0, float("-inf")).to(torch.float64)
    return torch.nan_to_num(x, nan=float("-inf"), posinf=float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> float64 temperature-scaled logits, everything outside min-p / top-k / top-p at -inf.
    The most likely token always stays finite (0), whatever the parameters."""
    x = _sanitized(logits)
    best = int(torch.argmax(x))
    if not math.isfinite(float(x[best])):
        raise ValueError("the model produced no finite logit (NaN or -inf everywhere)")
    x = (x - x[best]) / params.temperature  # <= 0; -inf stays -inf; 0 / t = 0 for the best token
    x[best] = 0.0  # exact, even if the subtraction rounded
    if params.min_p > 0:  # x = log(p / p_best): keep p >= min_p * p_best (the best token: 0 >= log(min_p))
        x = x.masked_fill(x < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it
        # already does. The first token is never dropped (the mass before it is 0, and a top_p below
        # float64's range must not make "0 >= top_p" true).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False
        x = x.clone()
        x[idx[drop]] = float("-inf")
    return x


def _choose(x: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """x [V] (already biased / penalized) -> the token as a 0-dim tensor on x's device: argmax at temperature 0,
    else a draw from the filtered distribution."""
    if params.temperature == 0:
        return torch.argmax(x)
    probs = torch.softmax(filter_logits(x, params), dim=-1)  # sums to >= 1 term of exp(0)
    return torch.multinomial(probs, 1, generator=generator)[0]


def _biased(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """float64 copy of logits [V] with each (token id, bias) added."""
    x = logits.to(torch.float64)
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=x.device)
    vals = torch.tensor([b for _, b in bias], dtype=torch.float64, device=x.device)
    return x.index_put_((ids,), vals, accumulate=True)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] -> one token id (stateless options only: logit bias, temperature, min-p, top-k, top-p)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = _biased(logits, params.logit_bias) if params.logit_bias else logits
    return int(_choose(x, params, generator))


def _draw(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """logits [B, V] -> one token id per row by the stateless options. Greedy rows share one argmax."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, generators[i])
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] -> one token id per row. Options that need a SequenceSampler are refused, not ignored."""
    for p in params:
        if p.stateful:
            raise ValueError("penalties, min_tokens and logprobs need per-sequence state: sample through a "
                             "BatchSampler (hybrid.runtime.sampling)")
    return _draw(logits, params, generators)


class SequenceSampler:
    """One sequence's sampling state: its params and generator, its row of token counts (penalties), the ids
    masked until min_tokens, its logit bias on the device, and the logprob records not yet taken."""

    def __init__(self, params: SamplingParams, generator, end_ids: torch.Tensor | None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None):
        self.params = params
        self.generator = generator
        self.row: int | None = None  # its row in BatchSampler's counts (penalized sequences)
        self.end_ids = end_ids  # [n] long: masked while n_sampled < min_tokens (None: nothing to mask)
        self.bias = bias  # ([n] long ids, [n] float64 biases)
        self.n_sampled = 0
        self.records: list[TokenLogprob] = []  # sampled tokens' logprobs, oldest first, until taken
        self.prompt_len = 0  # prompt tokens (what score_prompt has to cover)
        self.prompt_records: list[TokenLogprob] = []  # the prompt's, committed by commit_prompt
        self.prompt_carry: torch.Tensor | None = None  # log_softmax after the last scored prompt token [V]
        self.matcher = None  # llguidance.LLMatcher of params.grammar: where the text is in the grammar
        # the packed mask of the matcher's next token ([W] int32), being computed in the background; the matcher
        # is busy until it is done, so only BatchSampler touches either (after waiting)
        self.next_mask: Future | None = None

    def __getitem__(self, i):
        """s[0], s[1]: params and generator, as in the (params, generator) pair EngineSteps.sampler gives, so
        code written against either reads both."""
        return (self.params, self.generator)[i]

    @property
    def masking(self) -> bool:
        return self.end_ids is not None and self.n_sampled < self.params.min_tokens

    @property
    def shaping(self) -> bool:
        """Whether this step's logits must be changed before choosing (bias, penalties, the min_tokens mask)."""
        return bool(self.bias is not None or self.params.penalized or self.masking or self.matcher is not None)

    def take_records(self) -> list[TokenLogprob]:
        out, self.records = self.records, []
        return out

    def score_prompt(self, ids: list[int], logits: torch.Tensor, carry: torch.Tensor | None):
        """Logprob records of prompt tokens `ids` from logits [T, V] after each of them. carry: the log-softmax
        after the token before ids[0] (None: ids[0] is the prompt's first token, whose logprob is None).
        -> (records, the carry for the next tokens); nothing is kept until commit_prompt."""
        k = self.params.prompt_logprobs or 0
        out: list[TokenLogprob] = []
        for lo in range(0, len(ids), SCORE_ROWS):
            lsm = _log_softmax(logits[lo : lo + SCORE_ROWS])  # [t, V]
            targets = ids[lo : lo + SCORE_ROWS]
            if carry is None:  # the prompt's very first token: nothing predicts it
                out.append(TokenLogprob(targets[0], None, []))
                prev, targets = lsm[:-1], targets[1:]
            else:
                prev = torch.cat([carry[None], lsm[:-1]])  # row r predicts targets[r]
            if targets:
                out.extend(_records(prev, torch.tensor(targets, device=prev.device), k))
            carry = lsm[-1]
        return out, carry

    def commit_prompt(self, records: list[TokenLogprob], carry: torch.Tensor) -> None:
        self.prompt_records.extend(records)
        self.prompt_carry = carry

    @property
    def prompt_scored(self) -> bool:
        return len(self.prompt_records) >= self.prompt_len


def fill_mask(matcher, out: torch.Tensor) -> torch.Tensor:
    """Compute the matcher's next-token mask into out [W] int32 (CPU, contiguous, W = ceil(tokenizer vocabulary
    / 32): llguidance's packed bitmask) -> out. llguidance drops the GIL meanwhile, so other threads run."""
    matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
    return out


def bit_values(device) -> torch.Tensor:
    """[32] int32 on device: the value of each bit of an int32 word (1 << i; bit 31 is the sign bit)."""
    return torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


def allowed_tokens(bits: torch.Tensor, width: int, values: torch.Tensor) -> torch.Tensor:
    """Packed masks bits [c, W] int32 (token 32 w + i allowed iff bit i of word w is set; values: bit_values on
    bits' device) -> bool [c, width], True for the tokens allowed. Columns past 32 W, the model's rows past the
    tokenizer's vocabulary, are not. (A cast to bool, not a comparison with 0: several times faster on the CPU.)"""
    c, words = bits.shape
    allowed = (bits[:, :, None] & values).bool().view(c, words * 32)
    if width <= words * 32:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros(c, width - words * 32)], dim=1)


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    """The raw model's log-probabilities (float32 at least, the logits' own dtype if wider)."""
    return torch.log_softmax(x if x.dtype in (torch.float32, torch.float64) else x.float(), dim=-1)


def _records(lsm: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """lsm [n, V] log-probabilities, tokens [n] -> each token's logprob and the k most likely [(id, logprob)]."""
    chosen = lsm.gather(1, tokens[:, None])[:, 0].tolist()
    ids = tokens.tolist()
    if k == 0:
        return [TokenLogprob(t, lp, []) for t, lp in zip(ids, chosen)]
    top = torch.topk(lsm, min(k, lsm.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, list(zip(ti, tv)))
            for t, lp, ti, tv in zip(ids, chosen, top.indices.tolist(), top.values.tolist())]


class BatchSampler:
    """Sampling for a batch of sequences, each with its own options (see the module docstring). `rows`: the
    penalized sequences expected at once (the counts grow past it if need be)."""

    def __init__(self, vocab_size: int, device, rows: int = 1):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.rows = max(1, rows)
        self.counts: torch.Tensor | None = None  # [rows, V] int32: times each token was generated
        self.in_prompt: torch.Tensor | None = None  # [rows, V] bool: the prompt's tokens (repetition penalty)
        self._free: list[int] = []
        # -> llguidance.LLTokenizer of the model's vocabulary (set by whoever knows the tokenizer: the server's
        # Runtime); built on the first grammar, once (about a second for a 150 K vocabulary)
        self.grammar_tokenizer = None
        self._ll_tokenizer = None
        self._mask_words = 0  # int32 words of one packed grammar mask: ceil(the tokenizer's vocabulary / 32)
        self._mask_pool: ThreadPoolExecutor | None = None  # computes grammar masks (made on the first grammar)
        self._bit_values: torch.Tensor | None = None  # bit_values on the device (made on the first mask)
        self._pin = self.device.type == "cuda"  # packed masks in pinned memory: non-blocking copies to the device

    # --- per sequence -------------------------------------------------------------------------------
    def open(self, params: SamplingParams, prompt_ids=(), end_ids=()) -> SequenceSampler:
        """A sequence's sampler. prompt_ids: what the repetition penalty covers besides the output; end_ids: the
        ids that would end it (EOS and stop ids), masked until params.min_tokens."""
        dev = self.device
        ends = sorted(set(end_ids)) if params.min_tokens > 0 else []
        bias = None
        if params.logit_bias:
            bias = (torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=dev),
                    torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64, device=dev))
        s = SequenceSampler(params, params.generator(dev),
                            torch.tensor(ends, dtype=torch.long, device=dev) if ends else None, bias)
        s.prompt_len = len(prompt_ids)
        if params.grammar is not None:
            s.matcher = self._matcher(params.grammar)
            self._start_mask(s)  # the first token's mask, while the prompt is prefilled
        if params.penalized:
            s.row = self._take_row()
            self.counts[s.row].zero_()
            if params.repetition_penalty != 1:
                if self.in_prompt is None:
                    self.in_prompt = torch.zeros(self.counts.shape, dtype=torch.bool, device=dev)
                self.in_prompt[s.row].zero_()
                if len(prompt_ids):
                    self.in_prompt[s.row, torch.tensor(list(prompt_ids), dtype=torch.long, device=dev)] = True
        return s

    def grammar_vocab(self):
        """The llguidance.LLTokenizer grammars are matched with (built on first use, once); ValueError if this
        sampler was given no tokenizer."""
        if self._ll_tokenizer is None:
            if self.grammar_tokenizer is None:
                raise ValueError("constrained decoding needs the model's tokenizer, which this sampler was not given")
            self._ll_tokenizer = self.grammar_tokenizer()
            self._mask_words = (self._ll_tokenizer.vocab_size + 31) // 32
        return self._ll_tokenizer

    def _matcher(self, grammar: str):
        import llguidance

        m = llguidance.LLMatcher(self.grammar_vocab(), grammar)
        if m.is_error():
            raise ValueError(f"the grammar cannot be used: {m.get_error()}")
        return m

    def close(self, s: SequenceSampler) -> None:
        """Give the sequence's counts row back and drop its pending mask (idempotent); its records stay readable."""
        if s.row is not None:
            self._free.append(s.row)
            s.row = None
        if s.next_mask is not None:
            s.next_mask.cancel()  # not started yet: never computed (one being computed ends on its own)

    def shutdown(self) -> None:
        """Stop the grammar mask threads, after the masks being computed (idempotent; the next grammar starts new
        ones). Masks not started are cancelled: waiting for one raises CancelledError."""
        pool, self._mask_pool = self._mask_pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # --- grammar masks (constrained decoding) ------------------------------------------------------
    def _start_mask(self, s: SequenceSampler) -> None:
        """Compute s's next-token mask in the background: its matcher is where the next token starts from."""
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="hybrid-grammar")
        out = torch.empty(self._mask_words, dtype=torch.int32, pin_memory=self._pin)
        s.next_mask = self._mask_pool.submit(fill_mask, s.matcher, out)

    def _packed_masks(self, samplers: list[SequenceSampler]) -> torch.Tensor:
        """[c, W] int32 on the CPU (pinned on CUDA): each sampler's next-token mask, waited for. An error of its
        computation raises here, and again at each later wait (a retry never samples the row unmasked)."""
        masks = []
        for s in samplers:
            if s.next_mask is None:  # (a matcher given after open)
                self._start_mask(s)
            masks.append(s.next_mask.result())
        if len(masks) == 1:
            return masks[0][None]
        out = torch.empty(len(masks), self._mask_words, dtype=torch.int32, pin_memory=self._pin)
        return torch.stack(masks, out=out)

    def _mask_grammar(self, y: torch.Tensor, rows: list[int], samplers: list[SequenceSampler]) -> torch.Tensor:
        """y [b, V] with -inf in each of `rows` (samplers[k]'s row is rows[k]) where its grammar forbids the token:
        one copy of the packed masks to the device, one batched unpack and one fill."""
        dev = y.device
        if self._bit_values is None or self._bit_values.device != dev:
            self._bit_values = bit_values(dev)
        bits = self._packed_masks(samplers).to(dev, non_blocking=True)
        allowed = allowed_tokens(bits, y.shape[-1], self._bit_values)  # [c, V]
        if len(rows) == y.shape[0]:  # every row constrained (rows are distinct and sorted: 0..b-1)
            return torch.where(allowed, y, float("-inf"))
        idx = torch.tensor(rows, device=dev)
        return y.index_copy_(0, idx, torch.where(allowed, y.index_select(0, idx), float("-inf")))

    def _consume(self, samplers: list[SequenceSampler], tokens: list[int]) -> None:
        """Advance each constrained row's matcher by its token and start its next mask at once, so the mask is
        computed while the next forward step runs."""
        for s, t in zip(samplers, tokens):
            if s.matcher is not None:
                s.next_mask = None  # spent: were consume_token to raise, the next wait computes a fresh one
                ok = s.matcher.consume_token(t)
                self._start_mask(s)
                if not ok:  # the mask allowed it: a bug if not
                    raise RuntimeError(f"token {t} left the grammar: {s.matcher.get_error()}")

    def _take_row(self) -> int:
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self._free = list(range(self.rows - 1, -1, -1))
        if not self._free:  # more penalized sequences at once than expected: double the rows
            n = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            if self.in_prompt is not None:
                self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    # --- per step -----------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, samplers: list[SequenceSampler]) -> list[int]:
        """logits [B, V] -> one token id per row, each row by its own sampler's options. Commits the state
        (counts, n_sampled, logprob records) only once every row has its token, so a failed call changes
        nothing and can be retried row by row."""
        if not any(s.shaping or s.params.logprobs is not None for s in samplers):
            tokens = _draw(logits, [s.params for s in samplers], [s.generator for s in samplers])
            for s in samplers:
                s.n_sampled += 1
            return tokens
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns; the sampler was made for {self.vocab_size}")
        tok = self._choose_all(logits, samplers)  # [B] long, on the device
        self._count(tok, samplers)
        want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
        records = []
        if want:
            idx = torch.tensor(want, device=logits.device)
            k = max(samplers[i].params.logprobs for i in want)
            records = _records(_log_softmax(logits.index_select(0, idx)), tok.index_select(0, idx), k)
        tokens = tok.tolist()
        self._consume(samplers, tokens)
        for i, r in zip(want, records):
            samplers[i].records.append(r._replace(top=r.top[: samplers[i].params.logprobs]))
        for s in samplers:
            s.n_sampled += 1
        return tokens

    def _choose_all(self, logits: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
        """Every row's token [B] on the device: the shaped rows' logits changed in one batch, then argmax, or a
        draw for rows with a temperature."""
        shaped = [i for i, s in enumerate(samplers) if s.shaping]
        y, where = None, {}
        if len(shaped) == len(samplers):  # every row shaped (a lone constrained sequence, say): no raw argmax
            y = self.shape(logits, samplers)  # [B, V] float64
            tok, where = torch.argmax(y, dim=-1), {i: i for i in shaped}
        else:
            tok = torch.argmax(logits, dim=-1)  # [B]
            if shaped:
                idx = torch.tensor(shaped, device=logits.device)
                y = self.shape(logits.index_select(0, idx), [samplers[i] for i in shaped])  # [b, V] float64
                tok = tok.index_copy(0, idx, torch.argmax(y, dim=-1))
                where = {i: j for j, i in enumerate(shaped)}
        for i, s in enumerate(samplers):
            if s.params.temperature > 0:
                row = y[where[i]] if i in where else logits[i]
                tok[i] = _choose(row, s.params, s.generator)
        return tok

    def shape(self, x: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
        """Rows x [b, V] of the given samplers -> float64 logits after logit bias, the min_tokens mask, the
        penalties (vLLM's order) and the grammar's mask, each row by its own sampler."""
        y = x.to(torch.float64, copy=True)
        dev = y.device
        biased = [(j, s.bias) for j, s in enumerate(samplers) if s.bias is not None]
        if biased:
            rows = torch.cat([torch.full_like(b[0], j) for j, b in biased])
            y.index_put_((rows, torch.cat([b[0] for _, b in biased])), torch.cat([b[1] for _, b in biased]),
                         accumulate=True)
        masked = [(j, s.end_ids) for j, s in enumerate(samplers) if s.masking]
        if masked:
            rows = torch.cat([torch.full_like(e, j) for j, e in masked])
            y.index_put_((rows, torch.cat([e for _, e in masked])), torch.tensor(float("-inf"), dtype=y.dtype,
                                                                                  device=dev))
        pen = [j for j, s in enumerate(samplers) if s.params.penalized]
        if pen:
            sub = [samplers[j] for j in pen]
            jdx = torch.tensor(pen, device=dev)
            y.index_copy_(0, jdx, self._penalize(y.index_select(0, jdx), sub))
        constrained = [j for j, s in enumerate(samplers) if s.matcher is not None]
        if constrained:  # last: nothing after may re-allow a token
            y = self._mask_grammar(y, constrained, [samplers[j] for j in constrained])
        return y

    def _penalize(self, y: torch.Tensor, samplers: list[SequenceSampler]) -> torch.Tensor:
        """y [b, V] float64 -> the penalties applied: repetition (prompt + output tokens: positive logits divided
        by it, the others multiplied), then frequency x count and presence once per generated token."""
        dev = y.device
        rows = torch.tensor([s.row for s in samplers], device=dev)
        counts = self.counts.index_select(0, rows)  # [b, V] int32
        generated = counts > 0

        def column(name):
            return torch.tensor([getattr(s.params, name) for s in samplers], dtype=torch.float64, device=dev)[:, None]

        if any(s.params.repetition_penalty != 1 for s in samplers):
            rp = column("repetition_penalty")
            seen = generated if self.in_prompt is None else (generated | self.in_prompt.index_select(0, rows))
            y = torch.where(seen, torch.where(y > 0, y / rp, y * rp), y)
        return y - column("frequency_penalty") * counts - column("presence_penalty") * generated

    def _count(self, tok: torch.Tensor, samplers: list[SequenceSampler]) -> None:
        """Add each penalized row's token to its counts, on the device."""
        pen = [i for i, s in enumerate(samplers) if s.row is not None]
        if not pen:
            return
        dev = tok.device
        rows = torch.tensor([samplers[i].row for i in pen], device=dev)
        ones = torch.ones(len(pen), dtype=torch.int32, device=dev)
        self.counts.index_put_((rows, tok.index_select(0, torch.tensor(pen, device=dev))), ones, accumulate=True)
