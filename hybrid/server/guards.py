"""Request guards that run before a handler: Host check (DNS rebinding), JSON-only POSTs (cross-site
form posts), the API key, and an access log that never records query strings (keys sent there).

Why the first two: with no API key, anything that can make this machine send HTTP to the port can
use the model, and a web page in a local browser can. A cross-site page can only send "simple"
requests without asking the server first (CORS preflight, which this server never grants), and those
cannot carry `Content-Type: application/json`; so POSTs without it are refused (415). A page can also
point its own DNS name at 127.0.0.1 ("DNS rebinding") to read the answers as same-origin; its requests
then carry that name in Host, so without an API key only loopback names, IP literals and the bound
host are accepted on /v1/* (403 otherwise; /health and /metrics reveal no model output). With an API key both checks are redundant and Host is not checked
(a browser never sends the key by itself) but POSTs still need JSON.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from hybrid.server.errors import ApiError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
QUERY_KEY_NAMES = ("api_key", "api-key", "apikey", "key", "token", "access_token", "auth")


def host_name(host_header: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    if h.count(":") == 1:  # name:port (more than one colon: a bare IPv6 address)
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def host_allowed(host_header: str | None, bound_host: str) -> bool:
    if not host_header:  # HTTP/1.0 without Host: not a browser
        return True
    name = host_name(host_header)
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name == host_name(bound_host):
        return True
    try:
        ipaddress.ip_address(name)  # rebinding needs a DNS name; an IP literal is what it says
        return True
    except ValueError:
        return False


def guard_middleware(bound_host: str, check_host: bool):
    @web.middleware
    async def guard(request: web.Request, handler):
        # /health and /metrics stay open to probes and scrapers that name the server by its DNS name
        if check_host and request.path.startswith("/v1") and not host_allowed(request.headers.get("Host"),
                                                                                bound_host):
            raise ApiError(403, f"Host {request.headers.get('Host')!r} is not this server's name: without an "
                           "API key only localhost, 127.0.0.1, [::1], IP addresses and the --host name are "
                           "accepted (protects against DNS rebinding); set HYBRID_API_KEY to serve other "
                           "names.", code="invalid_host")
        if request.method == "POST" and request.content_type != "application/json":
            raise ApiError(415, "POST bodies must be JSON, sent with 'Content-Type: application/json' (got "
                           f"{request.headers.get('Content-Type', 'none')!r}).", code="unsupported_media_type")
        return await handler(request)

    return guard


def _utf8(text: str) -> bytes:
    # Header values that are not UTF-8 reach us as lone surrogates (surrogateescape): this gives back
    # the bytes the client sent instead of raising.
    return text.encode("utf-8", "surrogateescape")


def auth_middleware(api_key: str | None):
    expected = _utf8(api_key) if api_key else None

    @web.middleware
    async def check(request: web.Request, handler):
        if expected is not None and request.path.startswith("/v1"):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # compare_digest: the time taken must not reveal how many leading bytes matched
            if scheme.lower() != "bearer" or not hmac.compare_digest(_utf8(token.strip()), expected):
                msg = "Missing or incorrect API key: send 'Authorization: Bearer <key>'."
                if any(k in QUERY_KEY_NAMES for k in _query_names(request)):
                    msg += (" A key in the URL's query string is not accepted (URLs end up in logs and "
                            "browser history).")
                raise ApiError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def _query_names(request: web.Request) -> list[str]:
    try:
        return [k.lower() for k in request.query]
    except Exception:  # noqa: BLE001 - a query string that does not parse has no key in it
        return []


def redacted_target(raw_path: str) -> str:
    """The request target without its query values: keys sent in URLs must not reach the log."""
    path, sep, _ = raw_path.partition("?")
    return path + ("?[redacted]" if sep else "")


class AccessLogger(AbstractAccessLogger):
    """One line per request: client, request line (query redacted), status, bytes, seconds, user agent."""

    def log(self, request, response, time: float) -> None:
        v = request.version
        self.logger.info('%s "%s %s HTTP/%d.%d" %d %d %.3fs "%s"', request.remote, request.method,
                         redacted_target(request.raw_path), v.major, v.minor, response.status,
                         response.body_length, time, request.headers.get("User-Agent", "-"))
