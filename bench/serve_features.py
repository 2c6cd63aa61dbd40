"""Two server features measured as a client sees them, over HTTP against a spawned `hybrid serve`: the prefix
cache (time to first token of a long prompt sent again) and constrained decoding (decode rate with a
response_format against free text).

    python -m bench.serve_features --model DIR                        # both parts, JSON in a temporary file
    python -m bench.serve_features --model DIR --compare-off --out features.json
    python -m bench.serve_features --model DIR --server-arg=--gpu-experts=32 --batches 1,8 --rounds 2

The server is this process's child (bench.serve_load's spawn_server: `hybrid serve --port 0`, stopped and
reaped when the run ends, fails or is interrupted); --server-arg passes flags through to it.

1. Prefix cache. A prompt of --prefix-tokens tokens is built from words and its length checked with the
   server's POST /tokenize (words added or removed until the count is within 2% of the target). A different
   prompt of the same length is sent twice first (a miss, then a hit), so compilation, graph capture and the
   allocator's growth on either path are not billed to a measured request; then the prompt is sent 3 times in a
   row as a streamed /v1/completions request (temperature 0, --max-tokens, logprobs 0 so the chosen
   tokens and their logprobs come back). Reported: each request's time to first token (first streamed
   text), the ratios first/second and first/third, whether the three outputs are identical (text, tokens
   and the largest logprob difference), the server's hybrid_prefix_cache_* figures from /metrics before
   and after each request (so each request's reused tokens), and usage.prompt_tokens_details.cached_tokens
   when the server reports it. --compare-off restarts the server with --no-prefix-cache and runs the same
   requests, so the first request's TTFT is also seen against the cache off (and the outputs compared).
2. Constrained decoding. For each batch size of --batches, that many concurrent streamed chat requests
   (temperature 0, max_tokens --decode-tokens) are sent free, with response_format json_schema (a long
   free string field, at most --string-chars characters, then an integer and a boolean: generation can run
   long and still close the object) and with json_object. A request's decode rate is
   (completion_tokens - 1) / (latency - ttft); per setting the median over its requests, and
   cost = 1 - constrained / free. --rounds rounds alternate the order of the settings (free first, then
   last), so drift over the run does not favour one side; one short warm-up round per batch size comes
   first (the first grammar builds the tokenizer's token table). Every constrained output that finished
   (not cut by max_tokens) must parse as JSON, and the json_schema ones must have exactly the schema's keys
   with its types and bounds (a small check: jsonschema is not a dependency); those that do not are
   failures, those cut by max_tokens are counted as truncated.

Figures go to stdout and to a JSON file (--out FILE; default a new file in the temporary directory, never the
repository). Exit status 0, 1 when a request failed or a finished constrained output did not parse, 2 for a
bad argument (one line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.serve_load import _exit_on_sigterm, spawn_server, stop_server
from hybrid.errors import UsageError

PREFIX_REPEATS = 3  # the same long prompt, sent this many times in a row
TOKEN_TOLERANCE = 0.02  # the built prompt's token count is within this share of --prefix-tokens
CONTEXT_MARGIN = 64  # positions beyond the longest prompt + completion when --max-context is not given
WARMUP_DECODE_TOKENS = 32  # max_tokens of the warm-up round before the constrained-decoding rounds
SETTINGS = ("free", "json_schema", "json_object")

VOCABULARY = ("river stone bridge north hill quiet bright seven star watch morning field garden window letter "
              "market harbor ship sail wind summer winter autumn spring forest valley mountain village city "
              "road journey lantern candle paper story song music dance painter farmer doctor teacher "
              "student engine wheel clock mirror silver golden copper iron glass wooden ancient modern "
              "careful patient gentle sudden distant narrow broad heavy light shadow signal answer "
              "question reason method system pattern measure number").split()


# --- requests ---------------------------------------------------------------------------------------------------
async def stream(session, url: str, path: str, body: dict, headers: dict) -> dict:
    """One streamed request -> its status, ttft and latency (s), text, finish reason, usage, and the chosen
    tokens and logprobs when the body asked for logprobs (completions)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    out = {"status": None, "ttft": None, "text": "", "reasoning": "", "tokens": [], "logprobs": [],
           "finish_reason": None, "usage": None}
    async with session.post(url + path, json=body, headers=headers) as r:
        out["status"] = r.status
        if r.status != 200:
            out["error"] = (await r.text())[:300]
            out["latency"] = time.perf_counter() - t0
            return out
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["status"], out["error"] = 500, json.dumps(chunk["error"])[:300]
                continue
            out["usage"] = chunk.get("usage") or out["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                text = choice.get("text") or delta.get("content") or ""
                thought = delta.get("reasoning_content") or ""
                if out["ttft"] is None and (text or thought):  # first token: not the role-only chat chunk
                    out["ttft"] = time.perf_counter() - t0
                out["text"] += text
                out["reasoning"] += thought
                lp = choice.get("logprobs") or {}
                out["tokens"] += lp.get("tokens") or []
                out["logprobs"] += lp.get("token_logprobs") or []
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    out["latency"] = time.perf_counter() - t0
    return out


async def get_text(session, url: str, path: str, headers: dict) -> str:
    async with session.get(url + path, headers=headers) as r:
        return await r.text()


async def token_count(session, url: str, text: str, headers: dict) -> int:
    async with session.post(url + "/tokenize", json={"prompt": text}, headers=headers) as r:
        if r.status != 200:
            raise UsageError(f"POST /tokenize answered {r.status}: {(await r.text())[:200]}")
        return (await r.json())["count"]


def prefix_metrics(text: str) -> dict[str, float]:
    """Every unlabelled hybrid_prefix_cache_* sample of a /metrics page (whatever names this server exposes)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("hybrid_prefix_cache") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def words_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


async def build_prompt(session, url: str, target: int, seed: int, headers: dict) -> tuple[str, int]:
    """(text, its token count on this server) with the count within TOKEN_TOLERANCE of `target`: words are
    scaled by target / count until it is, then stepped one at a time."""
    words, seen = target, {}
    for _ in range(40):
        text = words_text(words, seed)
        seen[words] = count = await token_count(session, url, text, headers)
        if abs(count - target) <= TOKEN_TOLERANCE * target:
            return text, count
        step = round(words * (target / count - 1))
        step = step or (1 if count < target else -1)
        nxt = max(1, words + step)
        words = nxt if nxt not in seen else words + (1 if count < target else -1)
    raise UsageError(f"could not build a prompt of {target} tokens (+-{TOKEN_TOLERANCE:.0%}) from words on this "
                     "tokenizer; choose another --prefix-tokens")


# --- 1. prefix cache ----------------------------------------------------------------------------------------------
async def run_prefix(session, url: str, args, headers: dict) -> dict:
    prompt, count = await build_prompt(session, url, args.prefix_tokens, 1, headers)
    warm_prompt, warm_count = await build_prompt(session, url, args.prefix_tokens, 2, headers)
    body = {"max_tokens": args.max_tokens, "temperature": 0, "logprobs": 0}
    # twice: the first request fills the cache (a miss), the second reuses it, so the first use of each path (a
    # short prefill behind a long cached prefix runs at new shapes) is not billed to a measured request
    warm = [await stream(session, url, "/v1/completions", dict(body, prompt=warm_prompt), headers) for _ in range(2)]
    before = prefix_metrics(await get_text(session, url, "/metrics", headers))
    requests, last = [], before
    for _ in range(PREFIX_REPEATS):
        r = await stream(session, url, "/v1/completions", dict(body, prompt=prompt), headers)
        now = prefix_metrics(await get_text(session, url, "/metrics", headers))
        details = ((r["usage"] or {}).get("prompt_tokens_details") or {})
        requests.append({
            "status": r["status"], "error": r.get("error"),
            "ttft_s": _round(r["ttft"]), "latency_s": _round(r["latency"]),
            "text": r["text"], "tokens": r["tokens"], "logprobs": r["logprobs"],
            "prompt_tokens": (r["usage"] or {}).get("prompt_tokens"),
            "completion_tokens": (r["usage"] or {}).get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens"),  # OpenAI's field; None where the server does not report it
            "metrics_delta": {k: now.get(k, 0.0) - last.get(k, 0.0) for k in now if not k.endswith("_rate")}})
        last = now
    ttft = [r["ttft_s"] for r in requests]
    same = lambda key: all(r[key] == requests[0][key] for r in requests)  # noqa: E731
    diffs = [abs(a - b) for r in requests[1:] for a, b in zip(r["logprobs"], requests[0]["logprobs"])]
    return {
        "prompt_tokens": count, "target_tokens": args.prefix_tokens, "warmup_prompt_tokens": warm_count,
        "warmup": [{"status": w["status"], "ttft_s": _round(w["ttft"]), "latency_s": _round(w["latency"])} for w in warm],
        "requests": requests,
        "ttft_ratio_1_2": _ratio(ttft[0], ttft[1]), "ttft_ratio_1_3": _ratio(ttft[0], ttft[2]),
        "identical_text": same("text"), "identical_tokens": same("tokens") and bool(requests[0]["tokens"]),
        "max_logprob_diff": max(diffs) if diffs else None,
        "metrics_before": before, "metrics_after": last,
        "metrics_delta": {k: last.get(k, 0.0) - before.get(k, 0.0) for k in last if not k.endswith("_rate")},
    }


# --- 2. constrained decoding --------------------------------------------------------------------------------------
def answer_schema(string_chars: int) -> dict:
    """A long free string first (generation runs long), then two small fields; compact, closed object."""
    return {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "done"],
            "properties": {"answer": {"type": "string", "maxLength": string_chars},
                           "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
                           "done": {"type": "boolean"}}}


def schema_problem(obj, string_chars: int) -> str | None:
    """Why `obj` does not follow answer_schema(string_chars), or None."""
    if not isinstance(obj, dict):
        return f"not an object: {type(obj).__name__}"
    if set(obj) != {"answer", "confidence", "done"}:
        return f"keys {sorted(obj)}"
    if not isinstance(obj["answer"], str) or len(obj["answer"]) > string_chars:
        return "answer is not a string of at most maxLength characters"
    c = obj["confidence"]
    if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= 100:
        return f"confidence {c!r} is not an integer in 0..100"
    if not isinstance(obj["done"], bool):
        return f"done {obj['done']!r} is not a boolean"
    return None


def output_problem(setting: str, text: str, string_chars: int) -> str | None:
    """Why a finished constrained output is wrong (does not parse, or breaks the schema), or None."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if setting == "json_object":
        return None if isinstance(obj, dict) else f"not an object: {type(obj).__name__}"
    return schema_problem(obj, string_chars)


def response_format(setting: str, string_chars: int) -> dict | None:
    if setting == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer_schema(string_chars)}}
    return {"type": "json_object"} if setting == "json_object" else None


def decode_messages(i: int) -> list[dict]:
    topic = VOCABULARY[(7 * i) % len(VOCABULARY)]
    return [{"role": "user", "content": f"Request {i}. Write a long, detailed description of a {topic}: how it looks, "
             "where it is found and why it matters, in at least three hundred words. Answer as a JSON object with "
             "the keys answer (the description), confidence (0 to 100) and done (true)."}]


async def decode_batch(session, url: str, args, headers: dict, batch: int, setting: str, max_tokens: int) -> list[dict]:
    """`batch` concurrent streamed chat requests of one setting -> per request its figures."""
    rf = response_format(setting, args.string_chars)

    async def one(i):
        body = {"messages": decode_messages(i), "max_tokens": max_tokens, "temperature": 0}
        if rf is not None:
            body["response_format"] = rf
        r = await stream(session, url, "/v1/chat/completions", body, headers)
        tokens = (r["usage"] or {}).get("completion_tokens")
        rate = None
        if r["status"] == 200 and r["ttft"] is not None and tokens and tokens > 1 and r["latency"] > r["ttft"]:
            rate = (tokens - 1) / (r["latency"] - r["ttft"])
        row = {"status": r["status"], "error": r.get("error"), "ttft_s": _round(r["ttft"]),
               "latency_s": _round(r["latency"]), "completion_tokens": tokens, "decode_tok_s": _round(rate, 2),
               "finish_reason": r["finish_reason"]}
        if rf is not None and r["status"] == 200:
            text = r["text"] or r["reasoning"]  # a template that opens reasoning reads the JSON as reasoning
            row["truncated"] = r["finish_reason"] == "length"
            row["problem"] = None if row["truncated"] else output_problem(setting, text, args.string_chars)
            row["text"] = text
        return row

    return list(await asyncio.gather(*(one(i) for i in range(batch))))


def setting_summary(rows: list[dict], constrained: bool) -> dict:
    rates = [r["decode_tok_s"] for r in rows if r["decode_tok_s"] is not None]
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    out = {"decode_tok_s_median": _round(statistics.median(rates), 2) if rates else None,
           "completion_tokens": [r["completion_tokens"] for r in rows],
           "ttft_s_median": _round(statistics.median(ttfts)) if ttfts else None,
           "errors": sum(r["status"] != 200 for r in rows), "requests": rows}
    if constrained:
        checked = [r for r in rows if "truncated" in r]  # (answered requests)
        out["truncated"] = sum(r["truncated"] for r in checked)
        out["valid"] = sum(not r["truncated"] and r["problem"] is None for r in checked)
        out["failures"] = sum(not r["truncated"] and r["problem"] is not None for r in checked)
    return out


async def run_constrained(session, url: str, args, headers: dict) -> dict:
    for batch in args.batches:  # warm-up: first grammar (token table), each batch size's first steps
        for setting in SETTINGS:
            await decode_batch(session, url, args, headers, batch, setting,
                               min(args.decode_tokens, WARMUP_DECODE_TOKENS))
    rows = {(b, s): [] for b in args.batches for s in SETTINGS}
    for rnd in range(args.rounds):
        order = SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]  # free first, then last: drift favours no side
        for batch in args.batches:
            for setting in order:
                rows[batch, setting] += await decode_batch(session, url, args, headers, batch, setting,
                                                           args.decode_tokens)
    out = {}
    for batch in args.batches:
        per = {s: setting_summary(rows[batch, s], constrained=s != "free") for s in SETTINGS}
        free = per["free"]["decode_tok_s_median"]
        per["cost"] = {s: _round(1 - per[s]["decode_tok_s_median"] / free, 4)
                       if free and per[s]["decode_tok_s_median"] is not None else None for s in SETTINGS[1:]}
        out[str(batch)] = per
    return {"batches": out, "schema": answer_schema(args.string_chars),
            "failures": sum(out[str(b)][s]["failures"] for b in args.batches for s in SETTINGS[1:]),
            "truncated": sum(out[str(b)][s]["truncated"] for b in args.batches for s in SETTINGS[1:])}


# --- the run ------------------------------------------------------------------------------------------------------
def _round(x, digits: int = 4):
    return None if x is None else round(x, digits)


def _ratio(a, b):
    return round(a / b, 2) if a and b else None


async def measure(url: str, args, prefix_only: bool = False) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        health = json.loads(await get_text(session, url, "/health", headers))
        out = {"server": health, "prefix_cache": await run_prefix(session, url, args, headers)}
        if not prefix_only:
            out["constrained"] = await run_constrained(session, url, args, headers)
    return out


def server_options(args, extra: list[str]) -> argparse.Namespace:
    """What bench.serve_load.spawn_server reads: model, slots, context, queue, pass-through flags, key."""
    return argparse.Namespace(model=args.model, max_batch=max(args.batches), max_context=args.max_context,
                              requests=max(args.batches), server_arg=args.server_arg + extra, api_key=args.api_key)


@contextlib.contextmanager
def spawned(options: argparse.Namespace):
    """A `hybrid serve` child for the block -> its URL; stopped and reaped however the block ends (SIGTERM too)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    proc = None
    try:
        proc, url = spawn_server(options)
        print(f"# spawned `hybrid serve` (pid {proc.pid}) at {url} {' '.join(options.server_arg)}", flush=True)
        yield url
    finally:
        if proc is not None:
            stop_server(proc)
        signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--batches: {text!r} is not a comma-separated list of integers (e.g. 1,8)") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"--batches: every batch size must be >= 1, got {text!r}")
    return batches


def check_args(args) -> None:
    """One UsageError line for a value the run could not use; fills in --max-context when not given."""
    checks = [
        (args.prefix_tokens >= 32, f"--prefix-tokens must be >= 32 (twice the cache's shortest reuse), "
                                   f"got {args.prefix_tokens}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.decode_tokens >= 2, f"--decode-tokens must be >= 2 (a decode rate needs two tokens), "
                                  f"got {args.decode_tokens}"),
        (args.rounds >= 1, f"--rounds must be >= 1, got {args.rounds}"),
        (args.string_chars is None or args.string_chars >= 1, f"--string-chars must be >= 1, got {args.string_chars}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    args.batches = parse_batches(args.batches)
    if args.string_chars is None:
        args.string_chars = 3 * args.decode_tokens  # about 3/4 of the budget in English text: the object closes
    need = math.ceil(args.prefix_tokens * (1 + TOKEN_TOLERANCE)) + args.max_tokens + 1
    if args.max_context is None:
        args.max_context = max(need, 256 + args.decode_tokens) + CONTEXT_MARGIN
    elif args.max_context < need:
        raise UsageError(f"--max-context {args.max_context} cannot hold a {args.prefix_tokens}-token prompt and "
                         f"{args.max_tokens} tokens (needs {need}); raise it or lower --prefix-tokens")
    if args.out is not None and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: is a directory; give a file path")


def print_summary(res: dict) -> None:
    p = res["prefix_cache"]
    print(f"\nprefix cache: a {p['prompt_tokens']}-token prompt (target {p['target_tokens']}), "
          f"sent {PREFIX_REPEATS} times after a warm-up miss and hit of another prompt (ttft "
          f"{' / '.join(str(w['ttft_s']) for w in p['warmup'])} s)")
    print("  request  ttft_s    latency_s  reused_tokens  cached_tokens")
    for i, r in enumerate(p["requests"], 1):
        reused = r["metrics_delta"].get("hybrid_prefix_cache_tokens_reused")
        print(f"  {i:<8} {r['ttft_s']!s:<9} {r['latency_s']!s:<10} {reused!s:<14} {r['cached_tokens']}")
    print(f"  ttft first/second {p['ttft_ratio_1_2']}x, first/third {p['ttft_ratio_1_3']}x; outputs identical: "
          f"text {p['identical_text']}, tokens {p['identical_tokens']} (largest logprob difference "
          f"{p['max_logprob_diff']})")
    print(f"  /metrics over the 3 requests: {p['metrics_delta']}")
    off = res.get("prefix_cache_off")
    if off:
        print(f"  --no-prefix-cache: ttft {[r['ttft_s'] for r in off['requests']]} s; second request off / on "
              f"{_ratio(off['requests'][1]['ttft_s'], p['requests'][1]['ttft_s'])}x; same text as with the cache: "
              f"{off['same_text_as_cache_on']}")
    c = res["constrained"]
    print("\nconstrained decoding: per-request decode tok/s (median), completion tokens, cost = 1 - constrained/free")
    print("  batch  setting       tok/s     tokens (min-max)  cost     outputs valid / cut by max_tokens / failures")
    for batch, per in c["batches"].items():
        for s in SETTINGS:
            f = per[s]
            cost = per["cost"].get(s)
            tokens = [t for t in f["completion_tokens"] if t is not None] or [0]
            spread = f"{statistics.median(tokens):g} ({min(tokens)}-{max(tokens)})"
            check = f"{f['valid']} / {f['truncated']} / {f['failures']}" if "valid" in f else "-"
            print(f"  {batch:<6} {s:<13} {f['decode_tok_s_median']!s:<9} {spread:<17} "
                  f"{'-' if cost is None else f'{cost:+.1%}':<8} {check}")
    print(f"  constrained failures (finished but not valid): {c['failures']}; cut by max_tokens: {c['truncated']}")


def default_out_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="hybrid-serve-features-", suffix=".json")
    os.close(fd)
    return Path(name)


def main(argv=None) -> int:
    from cpu_kernels.knobs import knobs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the demo)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `hybrid serve` argument, repeatable (e.g. --server-arg=--gpu-experts=32)")
    p.add_argument("--max-context", type=int, default=None,
                   help="the server's --max-context (default: what the longest request needs)")
    p.add_argument("--prefix-tokens", type=int, default=2700,
                   help="prompt length of the prefix-cache part, in tokens (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="tokens generated per prefix-cache request (default %(default)s)")
    p.add_argument("--compare-off", action="store_true",
                   help="also run the prefix-cache part on a server restarted with --no-prefix-cache")
    p.add_argument("--batches", default="1,8",
                   help="concurrent requests per constrained-decoding setting, comma-separated (default %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="max_tokens of the constrained-decoding requests (default %(default)s)")
    p.add_argument("--string-chars", type=int, default=None,
                   help="the schema's free string field at most this many characters (default 3 x --decode-tokens)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of free / json_schema / json_object, their order alternating (default %(default)s)")
    p.add_argument("--api-key", default=knobs().api_key, help="the server's key (default: $HYBRID_API_KEY)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write the figures (default: a new file in the temporary directory)")
    args = p.parse_args(argv)
    check_args(args)
    print(f"# serve_features: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}; prefix_tokens={args.prefix_tokens} max_tokens={args.max_tokens} "
          f"batches={args.batches} decode_tokens={args.decode_tokens} rounds={args.rounds}", flush=True)
    try:
        with spawned(server_options(args, [])) as url:
            res = asyncio.run(measure(url, args))
        if args.compare_off:
            with spawned(server_options(args, ["--no-prefix-cache"])) as url:
                off = asyncio.run(measure(url, args, prefix_only=True))["prefix_cache"]
            off["same_text_as_cache_on"] = off["requests"][0]["text"] == res["prefix_cache"]["requests"][0]["text"]
            res["prefix_cache_off"] = off
    except KeyboardInterrupt:  # (the server is stopped by spawned())
        print("serve_features: interrupted", file=sys.stderr)
        return 130
    res["settings"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print(f"# server: {res['server']}")
    print_summary(res)
    out = Path(args.out) if args.out else default_out_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"# figures written to {out}")
    errors = [r for r in res["prefix_cache"]["requests"] if r["status"] != 200]
    errors += [r for per in res["constrained"]["batches"].values() for s in SETTINGS for r in per[s]["requests"]
               if r["status"] != 200]
    if errors:
        print(f"errors: {[r['error'] for r in errors][:5]}")
    return 1 if errors or res["constrained"]["failures"] else 0


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
