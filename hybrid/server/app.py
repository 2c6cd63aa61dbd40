"""The aiohttp application: middlewares (errors, auth, metrics), lifecycle, and `serve()`.

Every failure leaves as an OpenAI-style JSON error with the right status, including aiohttp's own
(404 unknown path, 405 wrong method, 413 body over the cap) and unexpected exceptions (500, logged):
one bad request never takes the server down.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web

from hybrid.server.config import ServerConfig
from hybrid.server.errors import ApiError, server_error
from hybrid.server.guards import AccessLogger, auth_middleware, guard_middleware
from hybrid.server.metrics import Metrics
from hybrid.server.routes import STATE, ServerState, add_routes
from hybrid.server.scheduler import Scheduler

log = logging.getLogger("hybrid.server")
_AIOHTTP = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", aiohttp.__version__).groups())

METERED = ("/v1/completions", "/v1/chat/completions", "/v1/models")
TOKENIZE_THREADS = 2
CLIENT_CLOSED = 499  # nginx's convention for "client closed the connection", used in metrics only


def _error_response(err: ApiError) -> web.Response:
    resp = web.json_response(err.body(), status=err.status, headers=err.headers)
    if err.close:
        resp.force_close()
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler):
    state: ServerState = request.app[STATE]
    endpoint = request.path if request.path in METERED else None
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except ApiError as err:
        status = err.status
        return _error_response(err)
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 413:
            msg = f"The request body is larger than the limit of {state.config.max_body_bytes} bytes."
        else:
            msg = f"{exc.reason}: {request.method} {request.path}"
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # 405 must say what is
        return _error_response(ApiError(exc.status, msg, type=kind, headers=allow))
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED  # the client went away; the handler's finally already cancelled its work
        raise
    except Exception:  # noqa: BLE001 - a bug in one request must not reach the other requests
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(server_error("internal server error (see the server log)"))
    finally:
        if endpoint is not None:
            state.metrics.request_done(endpoint, status)


def build_app(config: ServerConfig, runtime, model_name: str, metrics: Metrics | None = None) -> web.Application:
    metrics = metrics or Metrics(expert_split=getattr(runtime, "expert_split", dict),
                                 device=getattr(runtime, "device_type", None))
    scheduler = Scheduler(runtime, metrics, config.max_queue, config.prefill_chunk)
    guard = guard_middleware(config.host, check_host=config.api_key is None)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware, guard, auth_middleware(config.api_key)])
    # Tokenization runs here, off the event loop, with few threads: prompts that are refused can cost
    # at most a bounded prefix each (routes.py), and a burst of them queues instead of taking every core.
    tokenize_pool = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="hybrid-tokenize")
    app[STATE] = ServerState(config=config, runtime=runtime, scheduler=scheduler, metrics=metrics,
                             model_name=model_name, tokenize_pool=tokenize_pool)
    add_routes(app)

    async def start(app):
        scheduler.start()

    async def stop(app):
        # Runs after aiohttp closed the connections; waiting sequences get a 503 event (nobody left
        # to read it, but the engine thread ends cleanly).
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)
        tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


async def run_server(app: web.Application, host: str, port: int, announce,
                     stop: asyncio.Event | None = None) -> None:
    """Listen until `stop` is set (or SIGINT/SIGTERM when no `stop` is given, i.e. in the main thread)."""
    # handler_cancellation: a client that disconnects gets its handler cancelled, which cancels its
    # sequences, even for non-streaming requests that would otherwise only notice at the final write.
    # (aiohttp < 3.9 has no such switch: it always cancelled.)
    cancel = {"handler_cancellation": True} if _AIOHTTP >= (3, 9) else {}
    # One access-log line per request only when asked for (--log-level info/debug).
    # Its format never shows query strings (guards.AccessLogger): a key sent in the URL stays out of it.
    access = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.INFO) else None
    # keepalive_timeout: aiohttp closes a connection that has not sent complete headers within it
    # (from connect, or from the previous response); the body has its own deadline (routes.read_json).
    # lingering_time: how long an unread body is drained before closing, within the same bound.
    timeout = app[STATE].config.read_timeout_s
    runner = web.AppRunner(app, access_log=access, access_log_class=AccessLogger, keepalive_timeout=timeout,
                           lingering_time=min(10.0, timeout), **cancel)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]  # the real port when port=0
        announce(host, bound)
        if stop is None:
            stop = _stop_on_signals(asyncio.get_running_loop())
        await stop.wait()
    finally:
        # Stops listening, then lets in-flight requests finish (up to aiohttp's 60 s shutdown timeout)
        # before the engine thread stops: a SIGTERM drains instead of cutting streams mid-answer.
        await runner.cleanup()


def _stop_on_signals(loop) -> asyncio.Event:
    """First SIGINT/SIGTERM: drain and exit. A second one: the default handlers, i.e. exit now."""
    stop = asyncio.Event()
    sigs = (signal.SIGINT, signal.SIGTERM)

    def first(sig):
        stop.set()  # before anything that can fail (stderr may be a closed pipe)
        for s in sigs:
            loop.remove_signal_handler(s)
        try:
            print(f"hybrid serve: {signal.Signals(sig).name}: finishing in-flight requests "
                  "(signal again to stop at once)", file=sys.stderr, flush=True)
        except OSError:
            pass

    for sig in sigs:
        loop.add_signal_handler(sig, first, sig)
    return stop


def serve(config: ServerConfig, runtime, model_name: str, announce=None) -> None:
    """Run until SIGINT/SIGTERM. `announce(host, port)` is called once the socket is listening."""
    def default_announce(host, port):
        print(f"hybrid serve: listening on http://{host}:{port} (model '{model_name}', "
              f"max_batch={runtime.max_batch}, max_context={runtime.max_context})", flush=True)

    app = build_app(config, runtime, model_name)
    asyncio.run(run_server(app, config.host, config.port, announce or default_announce))
