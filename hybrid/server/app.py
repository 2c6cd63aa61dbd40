"""The aiohttp application: middlewares (errors, auth, metrics), lifecycle, and `serve()`.

Every failure leaves as an OpenAI-style JSON error with the right status, including aiohttp's own
(404 unknown path, 405 wrong method, 413 body over the cap) and unexpected exceptions (500, logged):
one bad request never takes the server down. A client that goes away is no error: its request is
cancelled with one debug line.

Shutdown (SIGTERM/SIGINT, or `stop` in tests): stop listening, refuse new requests (503), give in-flight
ones `shutdown_grace_s` to finish, end the rest (503 / an error event in the stream), stop the engine,
exit 0, all within seconds. A second signal meanwhile ends the process at once.
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
CLIENT_CLOSED = 499  # nginx's convention for "client closed the connection", used in metrics and the access log
# After the grace period, the seconds that ended requests get to write their last bytes (to clients that
# read slowly, or at all) before aiohttp cancels their handlers.
CLOSE_TIMEOUT_S = 1.0


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
    except asyncio.CancelledError:
        status = CLIENT_CLOSED  # the client went away; the handler's finally already cancelled its work
        log.debug("%s %s: ended early (client gone or shutting down)", request.method, request.path)
        raise
    except ConnectionResetError:  # the client went away while its body was read or its answer written
        status = CLIENT_CLOSED
        log.debug("%s %s: the client closed the connection; request cancelled", request.method, request.path)
        return _client_gone()
    except Exception:  # noqa: BLE001 - a bug in one request must not reach the other requests
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(server_error("internal server error (see the server log)"))
    finally:
        if endpoint is not None:
            state.metrics.request_done(endpoint, status)


def _client_gone() -> web.Response:
    """What a handler whose client left returns: nothing reaches the client, but returning (instead of
    raising ConnectionResetError to aiohttp, which logs it with a traceback as a server error) keeps
    the log quiet and the access log shows 499."""
    resp = web.Response(status=CLIENT_CLOSED)
    resp.force_close()
    return resp


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
        # Runs after the handlers ended (run_server drained them); sequences still in the engine get
        # a 503 event (nobody left to read it, but the engine thread ends cleanly).
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
    state: ServerState = app[STATE]
    timeout = state.config.read_timeout_s
    # shutdown_timeout: how long aiohttp waits for handlers once drain() has ended them (it waits twice,
    # then cancels what is left).
    runner = web.AppRunner(app, access_log=access, access_log_class=AccessLogger, keepalive_timeout=timeout,
                           lingering_time=min(10.0, timeout), shutdown_timeout=CLOSE_TIMEOUT_S, **cancel)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]  # the real port when port=0
        announce(host, bound)
        if stop is None:
            stop = _stop_on_signals(asyncio.get_running_loop(), state.config.shutdown_grace_s)
        await stop.wait()
        await drain(runner, state)
    finally:
        await runner.cleanup()  # closes the connections, then on_cleanup stops the engine thread


async def drain(runner: web.AppRunner, state: ServerState) -> None:
    """Stop listening, then let in-flight requests finish within the grace period and end the rest."""
    for site in list(runner.sites):
        await site.stop()
    ended = await state.inflight.drain(state.config.shutdown_grace_s)
    if ended:
        log.warning("shutdown: ended %d request(s) still running after %g s", ended, state.config.shutdown_grace_s)


def _stop_on_signals(loop, grace_s: float) -> asyncio.Event:
    """First SIGINT/SIGTERM: drain and exit. A second one: the system's default action, i.e. the process
    ends at once (no Python code runs, so no traceback and no waiting on a busy engine thread)."""
    stop = asyncio.Event()
    sigs = (signal.SIGINT, signal.SIGTERM)

    def first(sig):
        stop.set()  # before anything that can fail (stderr may be a closed pipe)
        for s in sigs:
            loop.remove_signal_handler(s)
            signal.signal(s, signal.SIG_DFL)  # (for SIGINT, not Python's KeyboardInterrupt handler)
        try:
            print(f"hybrid serve: {signal.Signals(sig).name}: finishing in-flight requests for up to "
                  f"{grace_s:g} s (signal again to stop at once)", file=sys.stderr, flush=True)
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
