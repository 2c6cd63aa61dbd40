"""The demo checkpoint: a small Qwen3-MoE model trained on Shakespeare's plays, shipped inside the package
(hybrid/runtime/demo_model), so that `hybrid generate` without --model prints English on a fresh machine with
no download and no first-use build.

The folder is what `python -m bench.train_small --family qwen3_moe --size demo --device cpu` writes: config.json,
model.safetensors (bf16), a byte-level BPE tokenizer of 2048 tokens trained on the same plays with the ChatML
template, generation_config.json, and training.json, the run's own record (parameters, steps, seconds, held-out
perplexity against the unigram baseline), which the notice below quotes. The model writes Shakespeare-like
English and knows nothing else.

build_tokenizer and pad_tokenizer are a generic tokenizer builder for random checkpoints (bench.make_checkpoint,
tests): a ~1k-token byte-level BPE trained on a fixed English text, padded with placeholder tokens `<idN>` up to a
model's vocab_size so that every id a random model generates decodes to text.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from hybrid.errors import UsageError

DEMO_DIR = Path(__file__).resolve().with_name("demo_model")
DEMO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "training.json")
DEMO_NOTICE = ("note: no --model given, using the built-in demo ({path}): a {params:.1f} M-parameter Qwen3-MoE "
               "model trained for {minutes:.0f} minutes on Shakespeare's plays (bench.train_small --size demo, {steps} "
               "steps; held-out perplexity {ppl:.0f}, unigram baseline {unigram:.0f}). It writes Shakespeare-like "
               "English and knows nothing else; pass --model DIR for a real checkpoint.")
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
TOKENIZER_TEXT = """\
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


def demo_checkpoint() -> Path:
    """The packaged demo checkpoint's folder; a UsageError naming the remedy when an install lost its files."""
    missing = [name for name in DEMO_FILES if not (DEMO_DIR / name).is_file()]
    if missing:
        raise UsageError(f"the built-in demo model is incomplete ({DEMO_DIR} lacks {', '.join(missing)}): "
                         "reinstall hybrid-moe or pass --model DIR")
    return DEMO_DIR


def demo_training(path: Path | None = None) -> dict:
    """The demo's training.json: how it was trained and what it scored on held-out plays."""
    path = demo_checkpoint() if path is None else Path(path)
    try:
        return json.loads((path / "training.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"the built-in demo model's training.json cannot be read ({exc}): "
                         "reinstall hybrid-moe or pass --model DIR") from None


def demo_notice(path: Path | None = None) -> str:
    """The one line said whenever the demo is used: what it is, from its own training record."""
    path = demo_checkpoint() if path is None else Path(path)
    t = demo_training(path)
    return DEMO_NOTICE.format(path=path, params=t["params"]["total"] / 1e6, minutes=t["train_seconds"] / 60,
                              steps=t["steps"], ppl=t["heldout_perplexity"], unigram=t["unigram_perplexity"])


def _tokenizer_text() -> list[str]:
    import this  # noqa: F401  (prints the Zen of Python on its first import; build_tokenizer silences it)

    zen = codecs.decode(this.s, "rot13")
    return (TOKENIZER_TEXT + zen).splitlines()


def build_tokenizer(out: Path, vocab_size: int = 1024) -> int:
    """Trains a byte-level BPE tokenizer (tokenizers library) on TOKENIZER_TEXT and the Zen of Python into folder
    `out` (tokenizer.json, tokenizer_config.json with the ChatML template); returns its size with special tokens.
    Deterministic: every machine builds the same tokenizer."""
    import contextlib
    import io

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen
        lines = _tokenizer_text()
    tok.train_from_iterator(lines, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def pad_tokenizer(file: Path, vocab_size: int, out: Path | None = None) -> int:
    """Adds placeholder tokens <idN> to tokenizer `file` (written to `out`, default the same file) for the ids N it
    lacks below vocab_size, so every id a random or small model emits shows as text; returns the size.

    A BPE model's placeholders are entries of its vocabulary (no merge reaches them, so encoding never yields
    one), not added tokens: llguidance builds its token table (constrained decoding) in time quadratic in the
    added tokens, over a minute for a 151,936-id vocabulary padded that way against about a second this way."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(Path(file).read_text(encoding="utf-8"))
    n = Tokenizer.from_str(json.dumps(spec)).get_vocab_size(with_added_tokens=True)
    names = {f"<id{i}>": i for i in range(n, vocab_size)}
    if names and isinstance(spec.get("model", {}).get("vocab"), dict):
        spec["model"]["vocab"].update(names)
        tok = Tokenizer.from_str(json.dumps(spec))
    else:
        tok = Tokenizer.from_str(json.dumps(spec))
        tok.add_tokens(list(names))
    if names or out is not None:
        tok.save(str(out or file))
    return tok.get_vocab_size(with_added_tokens=True)
