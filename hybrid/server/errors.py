"""Errors that become OpenAI-style JSON bodies: {"error": {"message", "type", "param", "code"}}.

Clients (the openai package included) read `error.message` and map the HTTP status to an exception
class, so the status is what matters most and the message must say what to change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None
    close: bool = False  # close the connection after answering (the client stalled mid-request)

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def queue_full(retry_after_s: int) -> ApiError:
    # 429 + Retry-After: the openai client retries these by itself, honouring the header.
    return ApiError(
        429,
        f"The server is at capacity (request queue full); retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="unavailable")


SHUTTING_DOWN = "the server is shutting down"


def shutting_down() -> ApiError:
    # close: the connection is not kept alive for a next request that would only get this answer again
    return ApiError(503, f"{SHUTTING_DOWN}; retry the request later.", type="server_error", code="unavailable",
                    close=True)
