"""Load test for `hybrid serve`: N concurrent clients, reports requests/s and tokens/s.

    python -m bench.serve_load --spawn --clients 16 --requests 64 --max-tokens 32   # starts a server
    python -m bench.serve_load --url http://127.0.0.1:8000 --clients 8 --stream      # an existing one

Each client sends its share of the requests back to back (closed loop), so `--clients` is the
concurrency the server sees. Tokens are the server's own usage counts. The mean decode batch comes from
the server's /metrics (rows / steps over the run), which shows whether continuous batching kept the
batch full. Figures go to stdout and to a JSON file (--json FILE; default a new file in the temporary
directory, never the repository).

With --spawn the server is this process's child and never outlives it: it is stopped (SIGTERM, then
SIGKILL if it hangs) and reaped when the run ends, fails, or is interrupted by SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch the quiet river "
         "under an old stone bridge near the northern hills").split()


def prompt_for(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))


def default_json_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="hybrid-serve-load-", suffix=".json")
    os.close(fd)
    return Path(name)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def cold_split(text: str) -> dict[str, float]:
    """hybrid_cold_experts_total summed over layers, by lane ({} without a hybrid layer)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hybrid_cold_experts_total{"):
            lane = line.split('lane="')[1].split('"')[0]
            out[lane] = out.get(lane, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def one_request(session, url, args, i, headers) -> dict:
    prompt = prompt_for(i, args.prompt_words)
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": args.stream}
    if args.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + path, json=body, headers=headers) as r:
        if r.status != 200:
            return {"status": r.status, "error": (await r.text())[:200], "latency": time.perf_counter() - t0}
        if args.stream:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choice = (chunk.get("choices") or [{}])[0]
                if ttft is None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                    ttft = time.perf_counter() - t0  # first text, not the role-only chat chunk
                usage = chunk.get("usage") or usage
        else:
            usage = (await r.json())["usage"]
    return {"status": 200, "latency": time.perf_counter() - t0, "ttft": ttft,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}


async def run_load(url: str, args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url + "/health") as r:
            health = await r.json()
        # warm-up: one request, so lazy initialisation is not timed
        await one_request(session, url, args, 10_000, headers)
        async with session.get(url + "/metrics") as r:
            before = await r.text()
        queue = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(i)
        results = []

        async def client():
            while not queue.empty():
                results.append(await one_request(session, url, args, queue.get_nowait(), headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        async with session.get(url + "/metrics") as r:
            after = await r.text()
    ok = [r for r in results if r["status"] == 200]
    steps = metric(after, "hybrid_decode_steps_total") - metric(before, "hybrid_decode_steps_total")
    rows = metric(after, "hybrid_decode_batch_rows_total") - metric(before, "hybrid_decode_batch_rows_total")
    lat = sorted(r["latency"] for r in ok) or [0.0]
    ttfts = sorted(r["ttft"] for r in ok if r.get("ttft") is not None)
    out_tokens = sum(r["completion_tokens"] for r in ok)
    b, a = cold_split(before), cold_split(after)
    cpu, shipped = a.get("cpu", 0) - b.get("cpu", 0), a.get("shipped", 0) - b.get("shipped", 0)
    return {
        # with a hybrid layer: share of cold experts run on the CPU during the run (the rest shipped)
        "cold_expert_cpu_share": round(cpu / (cpu + shipped), 4) if cpu + shipped else None,
        "server": health, "clients": args.clients, "requests": args.requests, "ok": len(ok),
        "errors": {str(r["status"]): r.get("error") for r in results if r["status"] != 200},
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in ok) / wall, 2),
        "output_tokens": out_tokens,
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "mean_decode_batch": round(rows / steps, 2) if steps else None,
    }


SERVER_STOP_TIMEOUT_S = 30  # the server's shutdown grace and engine stop fit well within this


def spawn_server(args) -> tuple[subprocess.Popen, str]:
    """Start `hybrid serve` on a free port; -> (process, URL) once it listens. The caller must
    stop_server() it; if the start fails or is interrupted, it is stopped here."""
    cmd = [sys.executable, "-m", "hybrid", "serve", "--port", "0", "--max-batch", str(args.max_batch),
           "--max-context", str(args.max_context), "--max-queue", str(max(64, args.requests))]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.server_arg
    env = dict(os.environ, HYBRID_NO_PROGRESS="1")
    if args.api_key:
        env["HYBRID_API_KEY"] = args.api_key
    # A session of its own: a Ctrl-C at the terminal reaches only this process, which then stops the
    # server with one SIGTERM (a signal to both would be the server's second one: stop at once).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        for line in proc.stdout:  # "hybrid serve: listening on http://127.0.0.1:PORT (...)"
            if "listening on " in line:
                return proc, line.split("listening on ")[1].split()[0]
        raise SystemExit(f"server exited with {proc.wait()} before listening")
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it has not exited within SERVER_STOP_TIMEOUT_S
    or if waiting is interrupted; in every case the process is reaped before this returns."""
    try:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _exit_on_sigterm(signum, frame):
    """SIGTERM as an exception, so that `finally` blocks (stop_server) run as they do for Ctrl-C."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    from cpu_kernels.knobs import knobs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--spawn", action="store_true", help="start `hybrid serve` on a free port for the run")
    p.add_argument("--model", help="with --spawn: checkpoint directory (default: demo)")
    p.add_argument("--max-batch", type=int, default=16, help="with --spawn (default %(default)s)")
    p.add_argument("--max-context", type=int, default=1024, help="with --spawn (default %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="with --spawn: extra `hybrid serve` argument, repeatable (e.g. --server-arg=--gpu-experts=4)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=None, help="total (default 4 x clients)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--api-key", default=knobs().api_key, help="the server's key (default: $HYBRID_API_KEY)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="where to write the figures (default: a new file in the temporary directory, so a run "
                   "never leaves an untracked file in the repository; the path is printed)")
    args = p.parse_args(argv)
    args.requests = args.requests or 4 * args.clients
    proc = None
    url = args.url.rstrip("/")
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm) if args.spawn else None
    try:
        if args.spawn:
            proc, url = spawn_server(args)
            print(f"# spawned `hybrid serve` (pid {proc.pid}) at {url}", flush=True)
        print(f"# serve_load: {platform.node()} {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cpus, python {platform.python_version()}")
        print(f"# {url}: clients={args.clients} requests={args.requests} max_tokens={args.max_tokens} "
              f"prompt_words={args.prompt_words} temperature={args.temperature} "
              f"{'chat' if args.chat else 'completions'} {'stream' if args.stream else 'no-stream'}")
        res = asyncio.run(run_load(url, args))
    except KeyboardInterrupt:  # (the server, if spawned, is stopped below)
        print("serve_load: interrupted", file=sys.stderr)
        return 130
    finally:
        if proc is not None:
            stop_server(proc)
        if args.spawn:
            signal.signal(signal.SIGTERM, previous_sigterm or signal.SIG_DFL)
    res["settings"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print(f"# server: {res['server']}")
    print(f"requests/s {res['requests_per_s']}  output tokens/s {res['output_tokens_per_s']}  "
          f"prompt tokens/s {res['prompt_tokens_per_s']}  ok {res['ok']}/{args.requests}  wall {res['wall_s']} s")
    print(f"latency p50 {res['latency_p50_s']} s  p95 {res['latency_p95_s']} s  ttft p50 {res['ttft_p50_s']} s  "
          f"mean decode batch {res['mean_decode_batch']}"
          + (f"  cold experts on CPU {res['cold_expert_cpu_share']:.1%}" if res["cold_expert_cpu_share"] is not None
             else ""))
    if res["errors"]:
        print(f"errors: {res['errors']}")
    out = Path(args.json) if args.json else default_json_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"# figures written to {out}")
    return 0 if res["ok"] == args.requests else 1


if __name__ == "__main__":
    from bench.entry import run_main

    raise SystemExit(run_main(main))
