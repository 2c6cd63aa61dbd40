"""The files of a GGUF checkpoint: one `.gguf` file, or the parts llama.cpp's gguf-split writes
(`NAME-00001-of-0000N.gguf`, metadata in the first, tensors spread over all), read with gguf.GGUFReader
(memory-mapped: opening reads the headers, not the tensor data).

GGUFReader parses every header field element by element: a 150K-token vocabulary's tokens, scores, types and
merges take it several seconds, at every start. So what it read (the metadata and each tensor's type, shape, file
offset and size) is kept as JSON under $HYBRID_CACHE/gguf-headers, keyed by every part's path, size and mtime and
the gguf package's version; a later start checks that each part's header bytes (everything before its first
tensor's data) still hash to what the entry recorded, maps the files itself at the recorded offsets and skips the
parse. An entry that is unreadable, inconsistent with the files or of another format is parsed again and
rewritten, never used.

What this module returns is the files' contents as they are: the metadata as plain Python values and every
tensor's ggml type, shape (torch order: GGUF lists dims fastest first, `ne[0]` is the last torch dim) and raw
bytes (a read-only memory map). What the metadata means for a model is hparams.py's job.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybrid.errors import UsageError
from hybrid.models.errors import ModelLoadError
from placement.json_file import write_json

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
    split.count must agree with their names; a tensor may appear in only one part. From the header cache when
    it holds these files, else parsed by GGUFReader (and the cache written)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    parts = split_parts(path)
    entry = header_cache_file(parts)
    cached = _from_cache(entry, parts)
    if cached is not None:
        return cached
    metadata: dict[str, Any] = {}
    tensors: dict[str, GgufTensor] = {}
    spans: list[list] = []
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
        spans += [[t.name, int(t.tensor_type), [int(d) for d in reversed(t.shape.tolist())], k, int(t.data_offset),
                   int(t.n_bytes)] for t in reader.tensors]
    _to_cache(entry, parts, metadata, spans)
    return parts, metadata, tensors


# -- the header cache ------------------------------------------------------------------------------------------------
HEADER_FORMAT = 1


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


def header_cache_file(parts: list[Path]) -> Path | None:
    """Where the header cache keeps these parts' headers (None: no cache folder is configured)."""
    from cpu_kernels.knobs import knobs

    ident = [HEADER_FORMAT, _gguf_version()]
    for part in parts:
        p = part.resolve()
        st = p.stat()
        ident.append([str(p), st.st_size, st.st_mtime_ns])
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]
    root = knobs().cache
    return None if root is None else Path(root).expanduser() / "gguf-headers" / f"{key}.json"


def _head(part: Path, n: int) -> list:
    """[n, sha256 of the part's first n bytes]: its header, the bytes GGUFReader parsed."""
    h = hashlib.sha256()
    with open(part, "rb") as f:
        left = n
        while left > 0:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return [n, h.hexdigest()]


def _from_cache(entry: Path | None, parts: list[Path]):
    """The cached (parts, metadata, tensors), or None when there is no usable entry."""
    if entry is None or not entry.is_file():
        return None
    try:
        doc = json.loads(entry.read_text(encoding="utf-8"))
        if doc.get("format") != HEADER_FORMAT or doc.get("parts") != [str(p.resolve()) for p in parts]:
            return None
        if doc["heads"] != [_head(p, n) for p, (n, _) in zip(parts, doc["heads"])]:
            return None  # a header rewritten within the mtime's granularity
        sizes = [p.stat().st_size for p in parts]
        maps = [np.memmap(p, dtype=np.uint8, mode="r") for p in parts]
        tensors = {}
        for name, ggml_type, shape, k, offset, nbytes in doc["tensors"]:
            if not (0 <= offset and offset + nbytes <= sizes[k]) or name in tensors:
                return None
            tensors[name] = GgufTensor(name, int(ggml_type), tuple(shape), maps[k][offset:offset + nbytes], parts[k])
        return parts, doc["metadata"], tensors
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # unreadable, truncated or of another shape: parsed again and rewritten


def _to_cache(entry: Path | None, parts: list[Path], metadata: dict, spans: list[list]) -> None:
    """Writes the entry (placement.json_file: a temporary file renamed into place); a cache that cannot be written
    is skipped."""
    if entry is None:
        return
    starts = [min([off for *_, k, off, _ in spans if k == i], default=p.stat().st_size) for i, p in enumerate(parts)]
    doc = {"format": HEADER_FORMAT, "parts": [str(p.resolve()) for p in parts],
           "heads": [_head(p, n) for p, n in zip(parts, starts)], "metadata": metadata, "tensors": spans}
    try:
        write_json(entry, doc)
    except (UsageError, TypeError, ValueError):  # a read-only cache folder, a full disk: the next start parses again
        pass
