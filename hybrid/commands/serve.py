"""`hybrid serve`: the OpenAI-compatible HTTP server (see hybrid/server/)."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys

from hybrid.errors import UsageError

API_KEY_ENV = "HYBRID_API_KEY"


def register(subparsers) -> None:
    from hybrid.loading.parse import DTYPES, add_hybrid_arguments, add_max_context_argument
    from hybrid.server.config import BATCH_PREFILL, EXACT_DTYPE, ServerConfig

    d = ServerConfig()
    p = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI API (completions, chat, streaming)",
        description="OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions (stream or "
        "not), /health, /metrics (Prometheus). Requests are batched continuously on one engine thread.")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json, safetensors, tokenizer); "
                   "default: the built-in demo model, shipped in the package")
    p.add_argument("--host", default=d.host, help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=d.port, help="TCP port, 0 = any free one (default %(default)s)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set; "
                   "prefer the variable: command lines are visible to other users)")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help="KV cache slots = sequences decoded together (default %(default)s)")
    add_max_context_argument(p)
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="sequences waiting for a slot before requests get 429 (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                   help="prompt tokens prefilled per scheduler step; running sequences wait at most this "
                   "much prefill per token (default %(default)s)")
    p.add_argument("--batch-prefill", default="on", choices=BATCH_PREFILL,
                   help="prefill a burst of new prompts in one padded forward (default on; off = one "
                   "prompt per model pass)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="request body cap; larger bodies get 413 (default %(default)s)")
    p.add_argument("--read-timeout", type=float, default=d.read_timeout_s, metavar="SECONDS",
                   help="a client must send a request's headers, and then its body, within this many seconds "
                   "(also the longest an idle keep-alive connection stays open); default %(default)s")
    p.add_argument("--max-messages", type=int, default=d.max_messages, metavar="N",
                   help="messages in one chat request; more get 400 (default %(default)s, as OpenAI)")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to this many "
                   "seconds, then end them with a 503 (streams: an error event) and exit 0; a second signal "
                   "exits at once (default %(default)s)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=sorted(DTYPES) + [EXACT_DTYPE],
                   help="default: bfloat16 on the GPU, float32 on the CPU; float64 (plain model only) makes "
                   "greedy output independent of batching, for exactness tests")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs for decode (always eager on the CPU)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (by default a KV slot given back keeps its tokens' K/V and a "
                   "later prompt starting the same way prefills only the rest; the same tokens either way)")
    p.add_argument("--served-model-name", help="the model id clients send: printable UTF-8 text (default: the "
                   "directory name)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_hybrid_arguments(p)
    p.set_defaults(func=run)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    from cpu_kernels.knobs import knobs
    from hybrid.server.adapter import load_runtime
    from hybrid.server.app import serve
    from hybrid.server.config import ServerConfig, model_name_problem

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = args.api_key if args.api_key is not None else knobs().api_key
    try:
        config = ServerConfig(host=args.host, port=args.port, api_key=api_key, max_batch=args.max_batch,
                              max_context=args.max_context, max_queue=args.max_queue,
                              max_body_bytes=args.max_body_bytes, prefill_chunk=args.prefill_chunk,
                              served_model_name=args.served_model_name, read_timeout_s=args.read_timeout,
                              max_messages=args.max_messages, shutdown_grace_s=args.shutdown_grace)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.plan is not None and not os.path.isfile(args.plan):  # (--plan comes with the hybrid flags)
        raise UsageError(f"--plan: no such file: {args.plan}")
    if not _is_loopback(config.host) and config.api_key is None:
        print(f"hybrid serve: warning: listening on {config.host} without an API key; anyone who can reach "
              f"this port can use the model (set {API_KEY_ENV})", file=sys.stderr)
    from hybrid.server.loading import LoadingServer

    try:  # the port first: /health says "loading" during the load, and a busy port fails before it
        loading = LoadingServer(config.host, config.port).start()
    except OSError as exc:
        raise UsageError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    try:
        runtime, name = load_runtime(args)  # the session warms the engine up (graph capture) on a GPU
    finally:
        loading.stop()
    name = config.served_model_name or name
    if model_name_problem(name) is not None:  # a directory name that is not printable UTF-8
        raise UsageError(f"{model_name_problem(name)} (the model directory's name); pass --served-model-name")
    try:
        serve(config, runtime, name)
    except OSError as exc:  # port in use, address not available
        raise UsageError(f"cannot listen on {config.host}:{config.port}: {exc}") from None
    return 0
