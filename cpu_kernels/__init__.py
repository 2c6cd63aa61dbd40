"""CPU expert executor: compiled fused-MoE kernels (AMX, AVX-512, AVX2) behind a ctypes binding, NUMA-aware
thread pools, and a pure-PyTorch reference (`cpu_kernels.reference.moe_forward`, also the `ref` ISA)."""

from . import quant, reference
from ._native import ISAS, IsaUnavailable, available_isas, default_isa
from .bandwidth import measure_read_bandwidth
from .moe import CpuMoE, MoEHandle
from .topology import Topology

__all__ = ["CpuMoE", "MoEHandle", "Topology", "available_isas", "default_isa", "ISAS", "IsaUnavailable",
           "reference", "quant", "measure_read_bandwidth"]
