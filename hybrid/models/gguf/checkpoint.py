"""open_gguf: a GGUF checkpoint's files, its metadata read as the family's config, and its tensors, checked
without reading tensor data.

The metadata becomes the config.json dict a Hugging Face checkpoint of the same model would have
(hparams.py), which is then checked (hybrid.models.checks) and parsed by the family's parse_config exactly
as a config.json would be, so the config rules live in one place. The family's errors say "config.json"; here
they name the GGUF file instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid.models import checks
from hybrid.models.config import ModelConfig
from hybrid.models.errors import ModelLoadError
from hybrid.models.families import Family, family_for
from hybrid.models.gguf.files import GgufTensor, SPLIT_NAME, read_files
from hybrid.models.gguf.hparams import hf_config


@dataclass(frozen=True)
class GgufCheckpoint:
    """An opened GGUF checkpoint: `path` is its first part, `files` every part; `metadata` the first part's
    key/values; `tensors` every tensor of every part by GGUF name; `raw_config` the config.json dict the
    metadata means; `family` and `config` what our loader builds from it."""

    path: Path
    files: tuple[Path, ...]
    arch: str
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]
    raw_config: dict
    family: Family
    config: ModelConfig


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (what a caller dispatches on: a .gguf file, not a directory)."""
    path = Path(path)
    return path.suffix == ".gguf" and not path.is_dir()


def _parse(family: Family, raw: dict, origin: str) -> ModelConfig:
    """family.parse_config(raw), its errors naming the GGUF file rather than config.json."""
    try:
        return family.parse_config(raw)
    except ModelLoadError as exc:
        raise ModelLoadError(str(exc).replace("config.json", origin, 1)) from None
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise ModelLoadError(f"{origin}: a value has a wrong type or size ({type(exc).__name__}: {exc})") from None


def config_from_metadata(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                         origin: str) -> tuple[Family, ModelConfig, dict]:
    """(family, ModelConfig, config.json dict) of the metadata of a file named `origin` holding tensors of
    `shapes` (name -> torch-order shape): hparams.hf_config, checked and parsed as a config.json would be."""
    raw = hf_config(metadata, shapes, origin)
    where = f"{origin} (GGUF metadata)"
    checks.check_config_fields(raw, where)
    family = family_for(raw)
    return family, _parse(family, raw, where), raw


def open_gguf(path: str | Path) -> GgufCheckpoint:
    """Open the GGUF checkpoint at `path` (a single file, or any part of a split one: every part is opened).
    Reads the headers only (the tensor data stays memory-mapped); ModelLoadError in one line for a file that is
    missing, unreadable, of an unsupported architecture or with metadata that does not make a valid config."""
    files, metadata, tensors = read_files(path)
    family, cfg, raw = config_from_metadata(metadata, {n: t.shape for n, t in tensors.items()}, str(files[0]))
    return GgufCheckpoint(path=files[0], files=tuple(files), arch=metadata["general.architecture"],
                          metadata=metadata, tensors=tensors, raw_config=raw, family=family, config=cfg)


def read_gguf_config(path: str | Path) -> tuple[Family, ModelConfig, dict]:
    """(family, ModelConfig, config.json dict) of a GGUF checkpoint, as hybrid.models.loader.read_config gives
    them for a directory (headers only)."""
    ckpt = open_gguf(path)
    return ckpt.family, ckpt.config, ckpt.raw_config


def display_name(path: Path) -> str:
    """The checkpoint's name without the split suffix (for progress bars and messages)."""
    m = SPLIT_NAME.match(path.name)
    return f"{m.group('prefix')}.gguf" if m else path.name
