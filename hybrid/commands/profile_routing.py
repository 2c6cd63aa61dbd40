"""`hybrid profile-routing`: run prompts through the model and record tokens per expert per MoE layer.

Prompts: `--prompts FILE` (one prompt per line; a line that is a JSON object uses its "prompt" field;
blank lines are skipped), else a built-in synthetic set (prose, code, numbers, other languages, chat).
Each prompt is prefilled into a fresh KV slot, in chunks that end on window boundaries, then
`--decode-tokens` tokens are generated greedily one step at a time (decode routing can differ from
prefill routing, and the planner optimises decode), so the series below is exact. Hooks on every MoE
layer's expert executor read the routing ids [T, K] the router chose; any executor works (plain or
hybrid: pass the hybrid flags, e.g. --gpu-experts 0, to make a big model fit). Decoding is eager here:
hooks do not run inside replayed CUDA graphs.

Output (`--out FILE`, else stdout), JSON, read back by placement.routing_stats.load_stats:

    {
      "schema_version": 1,
      "kind": "hybrid-routing-stats",
      "num_experts": E,                      # routed experts per MoE layer
      "topk": K,                             # experts per token
      "tokens": N,                           # tokens run (each counted once per layer)
      "window_tokens": W,                    # tokens per entry of "series"
      "source": {"model": DIR, "prompts": "builtin" | FILE, "prompt_count": n, "kind": "measured",
                 "decode_tokens_per_prompt": n},
      "layers": [{"layer": i,                # model layer index of each MoE layer, in order
                  "counts": [c_0, ..., c_{E-1}]}, ...],   # tokens routed to each expert; sums to N * K
      "series": [{"tokens": n_w,             # tokens in this window (W, the last may be fewer)
                  "counts": [[...E...], ...]}, ...]      # [MoE layer][expert] counts within the window
    }

The runtime's own cheap online counts are HybridExperts.stats.routed (cumulative [E] per layer).
"""

from __future__ import annotations

import json
import sys

from hybrid.errors import UsageError

DEFAULT_WINDOW = 256
DEFAULT_DECODE = 32
BUILTIN_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n    return out + a + b",
    "Photosynthesis converts light energy into chemical energy stored in glucose; chlorophyll absorbs red and blue light.",
    "3.14159 * r ** 2 = area; 2 + 2 = 4; 17 * 23 = 391; the derivative of x^3 is 3x^2; sqrt(144) = 12.",
    "Il pleut sur la ville comme il pleut sur mon coeur. Bonjour, comment allez-vous? Es regnet in Berlin.",
    "SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;",
    "User: Can you summarise the quarterly report? Assistant: Revenue was $4.2 million, up 12% year over year.",
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; } printf(\"%d\\n\", sum); return 0;",
    "Mount Everest is 8,849 metres above sea level; the Mariana Trench reaches about 10,935 metres below it.",
    "Once upon a time there was a small village near a river, where the miller's daughter kept bees.",
)


def register(subparsers) -> None:
    from hybrid.runtime.session import add_model_arguments

    p = subparsers.add_parser("profile-routing", help="record tokens per expert per layer (for `hybrid plan`)",
                              description="Run prompts through the model and write routing statistics: tokens per "
                              "expert per MoE layer, and the same per window of tokens. Schema: see "
                              "hybrid/commands/profile_routing.py.")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: a built-in synthetic set)")
    p.add_argument("--out", metavar="FILE", help="write the statistics here (default: print the JSON)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                   help="tokens per window of the series (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="run the prompt set this many times (default 1)")
    p.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE, metavar="N",
                   help="greedy tokens generated after each prompt, counted too (default %(default)s)")
    add_model_arguments(p)
    p.set_defaults(func=run)


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(BUILTIN_PROMPTS)
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise UsageError(f"--prompts {path}: {exc.strerror}") from None
    prompts = []
    for line in lines:
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
                line = obj["prompt"] if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) else line
            except json.JSONDecodeError:
                pass
        prompts.append(line)
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts in it")
    return prompts


class RoutingRecorder:
    """Forward pre-hooks on every MoE layer's executor: counts [L, E] since the last window cut."""

    def __init__(self, model):
        import numpy as np

        cfg = model.cfg
        self.layers = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
        self.E = cfg.num_experts
        self.total = np.zeros((len(self.layers), self.E), dtype=np.int64)
        self.window = np.zeros_like(self.total)
        self._handles = []
        for row, i in enumerate(self.layers):
            self._handles.append(model.layers[i].moe.experts.register_forward_pre_hook(self._hook(row)))

    def _hook(self, row):
        from placement.layer_model import histogram

        def hook(_module, args):
            ids = args[1]  # topk_ids [T, K]
            self.window[row] += histogram(ids.cpu().numpy(), self.E)
        return hook

    def cut(self):
        w = self.window.copy()
        self.total += w
        self.window[:] = 0
        return w

    def close(self):
        for h in self._handles:
            h.remove()


def profile(engine, token_lists: list[list[int]], window: int, decode_tokens: int = 0):
    """Prefill every prompt (fresh slot each) in chunks ending on window boundaries, then decode
    `decode_tokens` greedy tokens one step at a time.
    -> (layers, total counts [L, E], tokens, series [(tokens, counts [L, E])])."""
    rec = RoutingRecorder(engine.model)
    series, in_window, tokens = [], 0, 0

    def count(n):
        nonlocal in_window, tokens
        in_window += n
        tokens += n
        if in_window == window:
            series.append((window, rec.cut()))
            in_window = 0

    try:
        for ids in token_lists:
            ids = ids[: max(1, engine.max_context - decode_tokens)]
            slot = engine.allocate_slot()
            try:
                pos = 0
                while pos < len(ids):
                    n = min(window - in_window, len(ids) - pos)
                    logits = engine.prefill(slot, ids[pos:pos + n])
                    pos += n
                    count(n)
                for _ in range(min(decode_tokens, engine.max_context - len(ids))):
                    logits = engine.decode_step([slot], [int(logits.reshape(-1, logits.shape[-1])[-1].argmax())])
                    count(1)
            finally:
                engine.free_slot(slot)
        if in_window:
            series.append((in_window, rec.cut()))
    finally:
        rec.close()
    return rec.layers, rec.total, tokens, series


def run(args) -> int:
    from hybrid.runtime.session import open_session
    from placement.routing_stats import RoutingStats

    if args.window < 1:
        raise UsageError("--window must be >= 1")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    if args.decode_tokens < 0:
        raise UsageError("--decode-tokens must be >= 0")
    prompts = read_prompts(args.prompts) * args.repeat
    args.eager = True  # the recorder's hooks do not run inside replayed CUDA graphs
    s = open_session(args)
    token_lists = [t for t in (s.tokenizer.encode(p) for p in prompts) if t]
    if not token_lists:
        raise UsageError("the prompts encode to no tokens")
    layers, counts, tokens, series = profile(s.engine, token_lists, args.window, args.decode_tokens)
    cfg = s.engine.model.cfg
    stats = RoutingStats(cfg.num_experts, cfg.experts_per_token, tuple(layers), counts, tokens, args.window,
                         tuple(series), {"kind": "measured", "model": s.model_dir, "demo_random_weights": s.demo,
                                         "prompts": args.prompts or "builtin", "prompt_count": len(token_lists),
                                         "decode_tokens_per_prompt": args.decode_tokens})
    if args.out:
        stats.save(args.out)
        top = counts.max(axis=1) / max(tokens, 1)
        print(f"routing statistics of {tokens} tokens over {len(layers)} MoE layers written to {args.out} "
              f"({len(series)} windows of {args.window}); busiest expert per layer takes "
              f"{top.min():.0%}..{top.max():.0%} of tokens (uniform: {cfg.experts_per_token / cfg.num_experts:.0%})",
              file=sys.stderr)
    else:
        print(json.dumps(stats.to_json()))
    return 0
