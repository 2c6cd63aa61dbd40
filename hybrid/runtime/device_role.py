"""Who plays the GPU's part in this run, so that a machine without a GPU is told what is real on it.

With a CUDA device, attention, the router, resident experts and shipped experts run on the GPU, resident
experts live in VRAM and shipped ones cross PCIe. Without one, the same code runs with torch on the CPU:
"resident" experts are torch copies in DRAM, the ship lane copies packed weights within DRAM into staging
buffers for a torch matmul on the CPU, and no VRAM or PCIe figure describes anything on this machine.
Every user-facing output (generate/chat status lines and --json, /metrics, `hybrid plan`, the benches)
names the role from here, so they all say the same thing.
"""

from __future__ import annotations

CUDA = "cuda"
TORCH_ON_CPU = "torch-on-cpu"

CPU_ONLY_NOTE = ("CPU-only (no CUDA device): the 'GPU' role is played by torch on the CPU, so 'resident' experts are "
                 "torch copies in DRAM and the ship lane copies weights within DRAM (no VRAM, no PCIe)")


def is_cuda(device) -> bool:
    """device: a torch.device, a device string, or None (None: ask torch whether CUDA is available)."""
    if device is None:
        import torch

        return torch.cuda.is_available()
    return str(getattr(device, "type", device)).split(":")[0] == "cuda"


def gpu_role(device) -> str:
    """'cuda' or 'torch-on-cpu' (the value --json and /metrics report)."""
    return CUDA if is_cuda(device) else TORCH_ON_CPU
