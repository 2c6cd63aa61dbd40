"""Tokenizer from a checkpoint directory: tokenizer.json (the `tokenizers` library) plus
tokenizer_config.json (special tokens, chat template rendered with jinja2 as transformers does)."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid.models.errors import ModelLoadError


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"missing file: {tok_file}")
        try:
            self.tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises bare Exceptions for a corrupt file
            raise ModelLoadError(f"{tok_file}: not a readable tokenizer ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") from None
        cfg_file = path / "tokenizer_config.json"
        from hybrid.models.checks import read_json_object

        self.config = read_json_object(cfg_file) if cfg_file.is_file() else {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template = template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self._compiled = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        t = self.token_id(self.eos_token)
        return () if t is None else (t,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to the prompt text."""
        if self.chat_template is None:
            raise ModelLoadError("this tokenizer has no chat template (tokenizer_config.json: chat_template)")
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template already writes any BOS token, so no special tokens are added again. Only the
        # template's own markers become control tokens: "<|im_end|>" typed by a user stays text.
        from hybrid.runtime.chat_tokens import encode_chat_plain_contents

        return encode_chat_plain_contents(
            self, messages, lambda msgs: self.apply_chat_template(msgs, add_generation_prompt, **kwargs))

