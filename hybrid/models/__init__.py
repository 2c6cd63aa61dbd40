"""Model definitions and checkpoint loading for the supported MoE families.

    from hybrid.models import load_model
    model = load_model("/path/to/Qwen3-30B-A3B", device="cuda", dtype=torch.bfloat16)
    model.layers[i].moe.experts   # the swappable expert executor of MoE layer i (see moe.py)
"""

from hybrid.models.config import ModelConfig, RopeConfig
from hybrid.models.errors import ModelLoadError
from hybrid.models.families import FAMILIES, family_for
from hybrid.models.checkpoints import load_model, read_config  # a checkpoint directory or a GGUF file
from hybrid.models.loader import build_empty
from hybrid.models.moe import MoEBlock, StackedExperts
from hybrid.models.transformer import MoETransformer, init_random_

__all__ = ["ModelConfig", "RopeConfig", "ModelLoadError", "FAMILIES", "family_for", "build_empty", "load_model",
           "read_config", "MoEBlock", "StackedExperts", "MoETransformer", "init_random_"]
