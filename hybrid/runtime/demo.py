"""The demo checkpoint: a small Qwen3-MoE model with RANDOM weights and a byte-level BPE tokenizer,
built on first use and cached, so `hybrid generate` works on a fresh machine with no download.

Location: $HYBRID_CACHE/demo-qwen3-moe-v2, default ~/.cache/hybrid/demo-qwen3-moe-v2. It is written to
a temporary directory and renamed into place, so an interrupted build never leaves a half checkpoint.

The tokenizer and the model agree on the vocabulary, as bench/make_checkpoint's random checkpoints do: the
trained tokenizer (~800 tokens from the small corpus) is padded with placeholder tokens `<idN>` up to the
model's vocab_size, so every id the random model generates decodes to text. (Unpadded, a quarter of the
ids decoded to nothing: the vocabulary warning on every run, and a chat history whose text no longer
encoded to the ids the model had generated.)
"""

from __future__ import annotations

import codecs
import json
import os
import shutil
import tempfile
from pathlib import Path

from hybrid.errors import UsageError

DEMO_NAME = "demo-qwen3-moe-v2"  # v2: tokenizer padded to the model's vocabulary
DEMO_NOTICE = ("note: no --model given, using the built-in demo checkpoint ({path}); its weights are RANDOM, "
               "so the text is gibberish. Pass --model DIR for a real Hugging Face checkpoint.")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format Qwen chat models use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Training text for the tokenizer: enough English for common merges. Deterministic, so every machine
# builds the same tokenizer.
CORPUS = """\
Mixture-of-experts language models route every token to a few experts out of many. The experts hold
most of the weights, but each token only touches a small part of them, so a model with hundreds of
billions of parameters can run with the compute of a much smaller one. The hard part is memory: the
weights of all experts must live somewhere, and a single graphics card is rarely large enough.
This runtime keeps the attention layers, the router and the most popular experts on the GPU, and the
rest in the main memory of the machine, where the processor runs them. For every batch and every layer
a cost model decides whether it is cheaper to send the activations to the processor or to send the
weights of an expert to the graphics card.
The quick brown fox jumps over the lazy dog. Hello, world! What is the capital of France? Paris is the
capital and largest city of France. Once upon a time there was a small village near a river.
Question: how many tokens per second can this machine generate? Answer: it depends on the bandwidth.
"""


def cache_root() -> Path:
    from cpu_kernels.knobs import knobs

    return knobs().cache


def demo_path() -> Path:
    return cache_root() / DEMO_NAME


def _corpus() -> list[str]:
    import this  # noqa: F401  (prints the Zen of Python on import; silenced below)

    zen = codecs.decode(this.s, "rot13")
    return (CORPUS + zen).splitlines()


def build_tokenizer(out: Path, vocab_size: int = 1024) -> int:
    """Trains a byte-level BPE tokenizer (tokenizers library); returns its size with special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def pad_tokenizer(file: Path, vocab_size: int) -> int:
    """Adds placeholder tokens <idN> to tokenizer `file` for the ids N it lacks below vocab_size (the
    placeholders bench/make_checkpoint pads with); returns the size."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size > n:
        tok.add_tokens([f"<id{i}>" for i in range(n, vocab_size)])
        tok.save(str(file))
    return tok.get_vocab_size(with_added_tokens=True)


def _build(tmp: Path) -> None:
    """Writes the demo checkpoint into folder `tmp`: the tokenizer is trained first (its size sets the
    model's vocabulary) in a folder of its own, and copied in after the weights, since the checkpoint writer
    may put a new folder in place of `tmp`."""
    import contextlib
    import io

    import torch
    from tokenizers import Tokenizer

    from hybrid.models.presets import hf_config
    from hybrid.models.writer import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix=f".{DEMO_NAME}-tokenizer-", dir=tmp.parent) as tok_dir:
        tok_dir = Path(tok_dir)
        with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
            n_tokens = build_tokenizer(tok_dir)
        cfg = hf_config("demo")
        cfg["vocab_size"] = max(cfg["vocab_size"], -(-n_tokens // 64) * 64)  # room for every token
        pad_tokenizer(tok_dir / "tokenizer.json", cfg["vocab_size"])
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        cfg["eos_token_id"] = tok.token_to_id("<|endoftext|>")
        cfg["pad_token_id"] = tok.token_to_id("<|endoftext|>")
        write_random_checkpoint(tmp, cfg, seed=0, dtype=torch.bfloat16)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok_dir / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]}))
    (tmp / "README.txt").write_text("hybrid demo checkpoint: Qwen3-MoE config, RANDOM weights. "
                                    "Built by hybrid.runtime.demo; delete to rebuild.\n")
    os.chmod(tmp, 0o755)  # (a temporary folder is private to its owner; the cache is not)


def ensure_demo_checkpoint(progress_print=print) -> Path:
    """Returns the demo checkpoint directory, building it first if it is not cached yet."""
    path = demo_path()
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=path.parent))
    except OSError as exc:
        raise UsageError(f"cannot build the demo checkpoint under {path.parent} (HYBRID_CACHE): "
                         f"{exc.strerror or exc}; set HYBRID_CACHE to a writable folder or pass --model") from None
    progress_print(f"building the demo checkpoint in {path} (random weights, first use only)...")
    try:
        _build(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished first
            if not (path / "config.json").is_file():
                raise
    except OSError as exc:  # a full disk: the half-built folder goes, nothing named like the demo is left
        raise UsageError(f"cannot build the demo checkpoint in {path.parent} (HYBRID_CACHE): "
                         f"{exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
