"""Registry of supported architectures, keyed by config.json's model_type."""

from __future__ import annotations

from hybrid.models.errors import ModelLoadError
from hybrid.models.families import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from hybrid.models.families.common import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (qwen3_moe, mixtral, qwen2_moe, olmoe, deepseek_v3,
                                                                   glm4_moe, gpt_oss)}
FAMILIES.update({f.model_type: f for f in (deepseek_v3.KIMI_K2, deepseek_v3.KIMI_K25)})  # DeepSeek-V3 text models


def family_for(raw_config: dict) -> Family:
    model_type = raw_config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for fam in FAMILIES.values():  # a config without model_type but with a known architecture
        if model_type is None and set(raw_config.get("architectures") or []) & set(fam.architectures):
            return fam
    supported = ", ".join(f"{f.model_type} ({'/'.join(f.architectures)})" for f in FAMILIES.values())
    raise ModelLoadError(f"unsupported architecture: model_type {model_type!r} "
                         f"(architectures {raw_config.get('architectures')}); supported: {supported}")
