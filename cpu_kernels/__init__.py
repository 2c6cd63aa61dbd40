"""CPU expert executor: compiled fused-MoE kernels (AMX, AVX-512, AVX2) behind a ctypes binding, NUMA-aware
thread pools, and a pure-PyTorch reference (`cpu_kernels.reference.moe_forward`, also the `ref` ISA)."""

import importlib

# Loaded on first use, so that plain-data modules (cpu_kernels.dtypes) import without torch or the kernels.
_LAZY = {"quant": ".quant", "reference": ".reference", "_native": "._native", "moe": ".moe",
         "bandwidth": ".bandwidth", "topology": ".topology", "ISAS": "._native", "IsaUnavailable": "._native",
         "available_isas": "._native", "default_isa": "._native", "measure_read_bandwidth": ".bandwidth",
         "CpuMoE": ".moe", "MoEHandle": ".moe", "Topology": ".topology"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = module if _LAZY[name] == "." + name else getattr(module, name)
    globals()[name] = value
    return value


__all__ = ["CpuMoE", "MoEHandle", "Topology", "available_isas", "default_isa", "ISAS", "IsaUnavailable",
           "reference", "quant", "measure_read_bandwidth"]
