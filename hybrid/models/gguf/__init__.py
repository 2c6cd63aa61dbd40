"""GGUF checkpoints (llama.cpp's format, e.g. unsloth's files): parse, map, de-quantize, load.

    from hybrid.models.gguf import load_gguf, open_gguf, write_tokenizer_files
    model = load_gguf("Qwen3-30B-A3B-Q4_K_M.gguf", device="cuda", dtype=torch.bfloat16)
    write_tokenizer_files(open_gguf(path), "tok_dir")   # tokenizer.json + tokenizer_config.json

Modules, one job each: files (the file or split parts, read with gguf.GGUFReader, memory-mapped), hparams
(metadata -> the family's config.json dict), checkpoint (open_gguf: files + config through the family's
parse_config), names (GGUF tensor names -> our parameters, undoing the converter's transforms), dequant (torch
de-quantizers, bit-exact with gguf-py's reference), repack (expert blocks kept for the CPU executor), load
(load_gguf / check_gguf), tokenizer (tokenizers.Tokenizer and tokenizer_config from the metadata; spm: a
SentencePiece "llama" vocabulary's).

Architectures: qwen3moe, qwen2moe, llama with experts (Mixtral), deepseek2 (DeepSeek-V3 / R1, Kimi-K2),
glm4moe, gpt-oss. Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M, MXFP4.
IQ2_XS, IQ2_S, TQ1_0 and TQ2_0 load too; no CPU format holds them, so their experts are de-quantized and
re-quantized (repack.NEAREST: q2_k, q2_k, iq2_xxs, iq2_xxs).
Tensors are de-quantized to the model's dtype, except expert blocks the CPU executor's format holds exactly (Q4_0
in int4 groups of 32, MXFP4 in mxfp4: repack), which reach it as the file's own nibbles and scales.
"""

from hybrid.models.gguf.checkpoint import GgufCheckpoint, is_gguf, open_gguf, read_gguf_config
from hybrid.models.gguf.dequant import SUPPORTED, dequantize
from hybrid.models.gguf.load import check_gguf, load_gguf
from hybrid.models.gguf.tokenizer import tokenizer_from_metadata, write_tokenizer_files

__all__ = ["GgufCheckpoint", "is_gguf", "open_gguf", "read_gguf_config", "SUPPORTED", "dequantize", "check_gguf",
           "load_gguf", "tokenizer_from_metadata", "write_tokenizer_files"]
