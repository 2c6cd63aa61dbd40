"""What `hybrid serve` answers while its model loads (minutes for a big checkpoint): the port is taken at once, so a
client or an orchestrator sees a loading state instead of a refused connection, and a port already in use fails
before the load instead of after it.

    GET /health    503 {"status": "loading", "elapsed_s", "progress": [{"stage", "done", "total", "unit"}]}
    anything else  503 {"error": {"message": "the model is still loading", "code": "loading", ...}}

Progress is read from the load's own progress bars (tqdm keeps every open bar in `tqdm._instances`), so nothing in
the loader needs to report to the server. When the model is ready, `stop()` frees the port for the real server
(the gap is the time to bind again: milliseconds).
"""

from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web

LOADING_MESSAGE = "the model is still loading"


def bars() -> list[dict]:
    """The open progress bars: stage (the bar's description), done, total, unit."""
    try:
        from tqdm import tqdm
    except ImportError:
        return []
    out = []
    for bar in list(getattr(tqdm, "_instances", ())):
        out.append({"stage": str(getattr(bar, "desc", "") or "").rstrip(": "), "done": float(getattr(bar, "n", 0)),
                    "total": None if getattr(bar, "total", None) is None else float(bar.total),
                    "unit": str(getattr(bar, "unit", ""))})
    return out


class LoadingServer:
    """A minimal aiohttp server on (host, port) in a thread of its own, until stop()."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.t0 = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="hybrid-loading", daemon=True)
        self.bound_port: int | None = None

    def start(self) -> "LoadingServer":
        """Binds the port (raising OSError as the real server would: in use, not available) and returns."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "loading", "elapsed_s": round(time.monotonic() - self.t0, 1),
                                  "progress": bars()}, status=503)

    async def _other(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": LOADING_MESSAGE, "type": "server_error", "param": None,
                                            "code": "loading"}}, status=503, headers={"Retry-After": "5"})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._other)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.bound_port = runner.addresses[0][1]
            self._stop = asyncio.Event()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self._error = exc
            await runner.cleanup()
            self._ready.set()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
