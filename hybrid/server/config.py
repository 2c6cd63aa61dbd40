"""ServerConfig: every knob of `hybrid serve`, validated once; the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.runtime.config import RuntimeConfig

BATCH_PREFILL = ("on", "off")  # --batch-prefill: prompts prefilled together in one pass, or one at a time
EXACT_DTYPE = "float64"  # --dtype float64: the exactness runs' dtype (CPU only)


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be the served model id, or None. It goes into every response body and stream
    chunk as UTF-8 JSON, so it must be printable text that UTF-8 can encode (a name taken from bytes
    that are not UTF-8 arrives as lone surrogates, which cannot be encoded)."""
    if not name:
        return "the model name must not be empty"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"the model name {ascii(name)} is not valid UTF-8; use printable UTF-8 text"
    if not name.isprintable():
        return f"the model name {ascii(name)} contains control or separator characters; use printable text"
    return None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default: exposing a model server is an explicit choice
    port: int = 8000  # 0 = any free port (the bound one is printed; tests use this)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_batch: int = 8  # KV cache slots = sequences decoded together
    # positions per slot: prompt + completion must fit; the runtime's default, checked where the engine is built
    max_context: int = RuntimeConfig.max_context
    max_queue: int = 64  # sequences waiting for a slot before new requests get 429
    max_body_bytes: int = 1 << 20  # request bodies above this get 413 before they are parsed
    # Prompt tokens prefilled per scheduler iteration, in chunks of at most this size: bounds how long
    # running sequences wait for their next token while new (long) prompts are prefilled.
    prefill_chunk: int = 512
    max_choices: int = 16  # n x number of prompts in one request
    # Seconds a client may take to send a request's headers, and again its body (and the longest a
    # kept-alive connection may idle): a stalled or trickling client is disconnected, not kept forever.
    read_timeout_s: float = 60.0
    served_model_name: str | None = None  # defaults to the model directory's name
    # Messages in one chat request (OpenAI's limit too). Every message costs template tokens even when
    # empty, and the tokenizer holds the GIL while it works, so without a cap a few requests of many
    # empty messages would stall every other request for seconds.
    max_messages: int = 2048
    # Seconds that in-flight requests get to finish after SIGTERM/SIGINT before they are ended with a
    # 503 (streams: an error event); new requests get 503 meanwhile.
    shutdown_grace_s: float = 5.0

    def __post_init__(self):
        checks = [
            (0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}"),
            (self.max_batch >= 1, f"max_batch must be >= 1, got {self.max_batch}"),
            (self.max_queue >= 1, f"max_queue must be >= 1, got {self.max_queue}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}"),
            (self.prefill_chunk >= 1, f"prefill_chunk must be >= 1, got {self.prefill_chunk}"),
            (self.max_choices >= 1, f"max_choices must be >= 1, got {self.max_choices}"),
            (0 < self.read_timeout_s <= 86400, f"read_timeout must be in (0, 86400] s, got {self.read_timeout_s}"),
            (self.api_key is None or len(self.api_key) > 0, "api_key must not be empty"),
            (self.max_messages >= 1, f"max_messages must be >= 1, got {self.max_messages}"),
            (0 <= self.shutdown_grace_s <= 3600, f"shutdown_grace must be in [0, 3600] s, got {self.shutdown_grace_s}"),
        ]
        name_problem = None if self.served_model_name is None else model_name_problem(self.served_model_name)
        checks.append((name_problem is None, f"--served-model-name: {name_problem}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
