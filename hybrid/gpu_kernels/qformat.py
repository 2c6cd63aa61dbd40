"""The quantized weight formats the GPU kernels read (hybrid.gpu_kernels.qgemv) and hybrid.models.qweight
writes: kinds, the int8 / int4 group and fp8's block. Here, below both, so that neither imports the other's
module (the models import the kernels, never the reverse); hybrid.models.qweight's docstring describes the bytes."""

KINDS = ("int8", "int4", "fp8")
GROUP = 128  # int8 / int4: inputs per fp32 scale
FP8_BLOCK = (128, 128)  # fp8: rows x inputs per fp32 scale (DeepSeek-V3's published layout)


def is_quantized_weight(w) -> bool:
    """A hybrid.models.qweight.QWeight (recognised by its fields: this package does not import the models)."""
    return getattr(w, "kind", None) in KINDS and hasattr(w, "q") and hasattr(w, "scale") and hasattr(w, "group")
