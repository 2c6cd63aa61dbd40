"""The hybrid MoE layer: resident experts on the GPU, cold experts on the CPU lane or shipped, split per batch."""

from hybrid.offload.experts import HybridExperts, LayerStats
from hybrid.offload.shared import Offload

__all__ = ["HybridExperts", "LayerStats", "Offload"]
