"""The files of a GGUF checkpoint: one `.gguf` file, or the parts llama.cpp's gguf-split writes
(`NAME-00001-of-0000N.gguf`, metadata in the first, tensors spread over all), read with gguf.GGUFReader
(memory-mapped: opening reads the headers, not the tensor data).

What this module returns is the files' contents as they are: the metadata as plain Python values and every
tensor's ggml type, shape (torch order: GGUF lists dims fastest first, `ne[0]` is the last torch dim) and raw
bytes (a read-only memory map). What the metadata means for a model is hparams.py's job.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybrid.models.errors import ModelLoadError

SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_COUNT, SPLIT_NO = "split.count", "split.no"


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the checkpoint: `shape` in torch order, `data` its bytes as GGUFReader maps them."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray
    file: Path

    def raw(self) -> torch.Tensor:
        """The tensor's bytes as a flat uint8 tensor over the memory map (no copy; never written to)."""
        flat = np.asarray(self.data).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # the map is read-only: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)


def split_parts(path: Path) -> list[Path]:
    """The files of the checkpoint whose first (or any) part is `path`: [path] for a single file; for a
    split name, every part `PREFIX-0000k-of-0000N.gguf`, each of which must exist."""
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    if count < 1 or not 1 <= int(m.group("no")) <= count:
        raise ModelLoadError(f"{path}: a split GGUF name must be PREFIX-0000k-of-0000N.gguf with 1 <= k <= N")
    parts = [path.with_name(f"{m.group('prefix')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"missing file: {path.parent / missing[0]} (part of the split GGUF {parts[0].name}"
                             f"{f'; {len(missing) - 1} more missing' if len(missing) > 1 else ''})")
    return parts


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path), "r")
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # gguf-py raises ValueError, IndexError, struct/numpy errors on a bad file
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ModelLoadError(f"{path}: not a readable GGUF file ({first})") from None


def _float32(value: np.floating) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the
    number the converter was given, before float32 storage rounded it."""
    return float(str(np.float32(value)))


def _value(field) -> Any:
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    scalar = types[-1]
    value = field.contents()
    if scalar == GGUFValueType.FLOAT32:
        return [_float32(v) for v in value] if types[0] == GGUFValueType.ARRAY else _float32(value)
    return value


def read_metadata(reader, path: Path) -> dict[str, Any]:
    """Every key/value of one file's header as plain Python values (strings, numbers, bools, lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own entries (version, counts), not metadata
        try:
            out[key] = _value(field)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: metadata key {key!r} is not readable ({exc})") from None
    return out


def _tensors(reader, path: Path) -> dict[str, GgufTensor]:
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = GgufTensor(t.name, int(t.tensor_type), shape, t.data, path)
    return out


def read_files(path: str | Path) -> tuple[list[Path], dict[str, Any], dict[str, GgufTensor]]:
    """(parts, metadata of the first part, every tensor of every part by name). The parts' split.no and
    split.count must agree with their names; a tensor may appear in only one part."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    parts = split_parts(path)
    metadata: dict[str, Any] = {}
    tensors: dict[str, GgufTensor] = {}
    for k, part in enumerate(parts):
        reader = _reader(part)
        meta = read_metadata(reader, part)
        no, count = meta.get(SPLIT_NO), meta.get(SPLIT_COUNT)
        if len(parts) == 1 and (count or 1) > 1:
            raise ModelLoadError(f"{part}: part {(no or 0) + 1} of a GGUF split into {count} files, but not named "
                                 "PREFIX-0000k-of-0000N.gguf as gguf-split names them; restore the names")
        if len(parts) > 1:
            if (no, count) != (k, len(parts)):
                raise ModelLoadError(f"{part}: split.no/split.count are {no}/{count}, expected {k}/{len(parts)} "
                                     "from the file name")
        if k == 0:
            metadata = meta
        for name, t in _tensors(reader, part).items():
            if name in tensors:
                raise ModelLoadError(f"tensor {name!r} appears in both {tensors[name].file.name} and {part.name}")
            tensors[name] = t
    return parts, metadata, tensors
