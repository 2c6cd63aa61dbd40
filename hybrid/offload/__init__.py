"""The hybrid MoE layer: resident experts on the GPU, cold experts on the CPU lane or shipped, split per batch."""

from hybrid.offload.experts import HybridExperts, LayerStats, Offload

__all__ = ["HybridExperts", "LayerStats", "Offload"]
