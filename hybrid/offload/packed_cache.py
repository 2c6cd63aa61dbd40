"""The packed-expert cache: each MoE layer's CPU executor bytes (cpu_kernels.CpuMoE.packed_state) kept on disk,
so that a restart copies them back instead of converting the checkpoint's experts again (de-quantizing,
re-quantizing and packing run at 0.3-0.7 GB/s; copying packed bytes back runs at the disk's or page cache's rate).

$HYBRID_CACHE/packed/<key>/ holds one file per MoE layer (layer-<i>.bin: the executor's buffers back to back at
4 KiB offsets), manifest.json and last_used. The key hashes everything the bytes depend on: the checkpoint (its
folder, every safetensors file's name, size and mtime_ns, config.json's bytes; a GGUF file: every part's name,
size and mtime_ns), the packing layout
(cpu_kernels.moe.packed_layout: CPU dtype, int4 group, ISA, int4 order, K padding, row alignment, the NUMA nodes'
F slices, the packing format) and this module's FORMAT. Another machine, ISA, thread split or dtype is another key.

Writing happens in the background, so that a cache never makes a load slower: each layer's packed bytes (views
of the executor's buffers, which nothing writes after packing: no copy) are kept until the last layer is packed,
then one writer thread writes them into a temporary folder beside the others (sequentially, in 64 MiB pieces, at a
lower CPU and I/O priority than the model's threads, each file fsynced), the manifest (every file's size and a
sampled hash, and a checksum of the manifest itself), then one rename, so a cache folder is complete or absent.
The load returns without waiting, and its packing never shares the cores with the writer. The writer owns its
temporary folder: it checks the free space first, and any error (a full disk, a read-only folder) removes the
folder and gives up with a one-line warning (the running model never depends on the cache); a load that fails
before its last layer writes nothing. At interpreter exit a write still going is waited for (one line says so;
Ctrl-C stops it), so a one-shot `hybrid generate` leaves a complete cache; a killed process leaves a temporary
folder that a later load removes once its process is gone (remove_stale_temporaries). A second process that
starts meanwhile finds no cache folder yet and converts (it never reads a temporary folder); of two writers of
one key, the first rename wins and the other removes its own folder.

Reading: before the first layer the manifest's checksum, format and key, and every file's size and sampled hash
are checked; anything off removes the folder and this load rebuilds it. Each layer's file is memory-mapped and
copied into the executor's node-local buffers by each node's own threads (CpuMoE.from_packed: no conversion, the
first touch stays on the node, huge pages stay possible). The files' page cache is kept, after writing as after
reading: it is reclaimable (the kernel evicts clean file pages under memory pressure, so it never makes an OOM),
and where the machine has the memory the next start copies from it at memory speed instead of the disk's rate.
A sampled hash reads 64 windows of 4 KiB a file, not the whole file: with the exact sizes it finds truncation and
gross damage cheaply, not every flipped bit of a large file.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import mmap
import os
import secrets
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("hybrid.offload")

FORMAT = 1  # of the folder (files, manifest); the packed bytes' own version is in the layout (PACK_FORMAT)
ALIGN = 4096  # each part of a layer's file starts on a page
MANIFEST, LAST_USED = "manifest.json", "last_used"
_SAMPLES, _WINDOW = 64, 4096
_NOT_WRITTEN = "this load goes on without it (set HYBRID_CACHE to another folder, or pass --no-cache)"
_PIECE = 64 << 20  # the writer's write size: a cancel is seen between pieces
_WRITER_NICE = 10  # the writer thread's niceness above the process's (Linux: its I/O priority follows it)
_WRITERS: set = set()  # the caches whose writer thread runs (wait_for_writers, the wait at exit)
_WRITERS_LOCK = threading.Lock()


@dataclass
class LoadTimes:
    """Where a hybrid load's seconds went, for the line it ends with. read: everything but the rest (the loader
    reading the checkpoint and de-quantizing what it converts, the non-expert weights' copy to the device);
    convert: packing (and quantizing) experts for the CPU executor; upload: the hybrid layers' device work
    (page-locking the packed bytes, biases, resident experts); cache: checking and reading the packed cache, and
    handing layers to its background writer (cache_bytes: bytes read from it; cache_writing: bytes handed to the
    writer, whose seconds the load does not wait for)."""

    total_s: float = 0.0
    convert_s: float = 0.0
    upload_s: float = 0.0
    cache_s: float = 0.0
    cache_bytes: int = 0
    cache_writing: int = 0

    @property
    def read_s(self) -> float:
        return max(0.0, self.total_s - self.convert_s - self.upload_s - self.cache_s)

    def line(self) -> str:
        rate = self.cache_bytes / self.cache_s / 1e9 if self.cache_s > 0 else 0.0
        what = []
        if self.cache_bytes or not self.cache_writing:
            what.append(f"{self.cache_bytes / 1e9:.2f} GB at {rate:.2f} GB/s")
        if self.cache_writing:
            what.append(f"{self.cache_writing / 1e9:.2f} GB writing in the background")
        return (f"loaded in {self.total_s:.1f} s: read {self.read_s:.1f} s, convert {self.convert_s:.1f} s, "
                f"upload {self.upload_s:.1f} s, cache {self.cache_s:.1f} s ({', '.join(what)})")


def cache_root() -> Path:
    """$HYBRID_CACHE/packed: beside the demo checkpoint and the calibrated profile."""
    from cpu_kernels.knobs import knobs

    return knobs().cache / "packed"


def checkpoint_identity(model_dir) -> dict:
    """What says a checkpoint changed: a folder's resolved path, every safetensors file's (relative name, size,
    mtime_ns), and config.json's bytes' hash; a GGUF file's first part's resolved path and every part's (name,
    size, mtime_ns) (its metadata, the config, is inside them)."""
    from hybrid.models.gguf import is_gguf

    if is_gguf(model_dir):
        from hybrid.models.gguf.files import split_parts

        parts = split_parts(Path(model_dir).resolve())
        files = [[p.name, st.st_size, st.st_mtime_ns] for p in parts for st in (p.stat(),)]
        return dict(path=str(parts[0]), files=files, config=None)
    root = Path(model_dir).resolve()
    files = []
    for f in sorted(root.rglob("*.safetensors")):
        st = f.stat()
        files.append([f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    config = hashlib.sha256((root / "config.json").read_bytes()).hexdigest()
    return dict(path=str(root), files=files, config=config)


def cache_key(identity: dict, layout: dict) -> str:
    """The folder name: a hash of the checkpoint's identity, the packing layout and FORMAT."""
    text = json.dumps(dict(format=FORMAT, checkpoint=identity, layout=layout), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def sampled_hash(buf, size: int) -> str:
    """blake2b of the size and 64 evenly spread 4 KiB windows (the whole buffer when it is smaller)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(size.to_bytes(8, "little"))
    if size <= _SAMPLES * _WINDOW:
        h.update(buf[:size])
    else:
        for i in range(_SAMPLES):
            off = (size - _WINDOW) * i // (_SAMPLES - 1)
            h.update(buf[off:off + _WINDOW])
    return h.hexdigest()


def _file_hash(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, sampled_hash(b"", 0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return size, sampled_hash(mm, size)


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: Path) -> dict:
    """The manifest's body; ValueError (one line) when it is unreadable or its checksum is off."""
    try:
        doc = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"manifest unreadable ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("body"), dict):
        raise ValueError("manifest unreadable (not a manifest)")
    if doc.get("checksum") != _checksum(doc["body"]):
        raise ValueError("manifest checksum mismatch")
    return doc["body"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_temporaries(root: Path) -> None:
    """Temporary folders of loads that died before their rename (their process is gone). A folder of a live
    process, this one's writer or another's, is left to its writer, which renames or removes it."""
    for d in root.glob(".tmp-*") if root.is_dir() else ():
        parts = d.name.split("-")
        if len(parts) == 4 and parts[2].isdigit() and not _pid_alive(int(parts[2])):
            shutil.rmtree(d, ignore_errors=True)


class PackedCache:
    """One load's side of the packed cache of its key: a complete, checked cache to read every layer from, or
    none (absent, or found bad and removed) for a writer thread to write as the layers are packed (store, commit,
    close; wait). Seconds and bytes go to `times`."""

    def __init__(self, root: Path, key: str, identity: dict, layout: dict, layers: list[int], times: LoadTimes):
        self.root, self.key, self.identity, self.layout = root, key, identity, layout
        self.layers, self.times = list(layers), times
        self.folder = root / key
        self.manifest: dict | None = None  # set: reading from the cache
        self._tmp: Path | None = None  # the folder being written
        self._written: dict[str, dict] = {}  # layer -> its manifest entry
        self._loaded: dict[int, object] = {}  # layer -> executor read from the cache (a rebuild writes them)
        self._off = False  # writing gave up (no space, an error) or is over: nothing more is stored
        # (layer, packed state, parts, shape, the layer's own layout or None) for the writer, in load order
        self._pending: list[tuple] = []
        self._need = 0  # bytes the whole cache takes (the free-space check)
        self._writer: threading.Thread | None = None  # the background write, started by commit
        self._cancel = threading.Event()  # Ctrl-C at exit: the writer stops and removes its folder
        self._over = threading.Event()  # the writer is done, its folder renamed or removed
        self._queued = self._done = 0  # bytes handed to the writer, bytes it wrote

    @classmethod
    def open(cls, model_dir, layout: dict, layers, times: LoadTimes) -> "PackedCache | None":
        """The cache for this checkpoint and layout, checked; None for the ref ISA (nothing packed)."""
        if layout["isa"] == "ref":
            log.info("packed cache: not used with the ref ISA (it packs nothing)")
            return None
        t0 = time.perf_counter()
        identity = checkpoint_identity(model_dir)
        root = cache_root()
        cache = cls(root, cache_key(identity, layout), identity, layout, layers, times)
        remove_stale_temporaries(root)
        if cache.folder.exists():
            try:
                cache.manifest = cache._checked()
            except ValueError as exc:
                cache._discard(str(exc))
            except (KeyError, TypeError, AttributeError) as exc:  # a well-formed checksum over a foreign body
                cache._discard(f"manifest malformed ({type(exc).__name__}: {exc})")
        log.info("packed cache %s: %s", cache.key,
                 "hit" if cache.manifest else "miss (written in the background as the layers pack)")
        times.cache_s += time.perf_counter() - t0
        return cache

    def _checked(self) -> dict:
        """The manifest, after every check that is cheap: checksum, format, key, layers, file sizes and hashes."""
        body = read_manifest(self.folder)
        if body.get("format") != FORMAT:
            raise ValueError(f"format {body.get('format')} (this version reads {FORMAT})")
        if body.get("key") != self.key or body.get("layout") != self.layout:
            raise ValueError("written for another checkpoint or layout")
        if sorted(int(i) for i in body.get("layers", {})) != sorted(self.layers):
            raise ValueError(f"holds layers {sorted(body.get('layers', {}))}, the model's MoE layers are {self.layers}")
        for entry in body["layers"].values():
            path = self.folder / entry["file"]
            try:
                size, digest = _file_hash(path)
            except OSError as exc:
                raise ValueError(f"{entry['file']}: {exc.strerror or exc}") from None
            if size != entry["size"]:
                raise ValueError(f"{entry['file']} is {size} bytes, the manifest says {entry['size']}")
            if digest != entry["hash"]:
                raise ValueError(f"{entry['file']}: content differs from the manifest's hash")
        return body

    def _discard(self, why: str) -> None:
        """A bad cache is never used: removed, and this load writes it again."""
        try:
            shutil.rmtree(self.folder)
        except OSError as exc:
            log.warning("packed cache %s: %s; cannot remove it (%s), %s", self.key, why, exc.strerror or exc,
                        _NOT_WRITTEN)
            self._off = True
        else:
            log.warning("packed cache %s: %s; rebuilding it", self.key, why)
        self.manifest = None

    # -- reading ----------------------------------------------------------------------------------
    def holds(self, layer: int) -> bool:
        """Whether `layer`'s experts will come from the cache, so a loader may skip reading them and hand the
        factory None for the weights (only the biases are still needed: the GPU lanes keep them)."""
        return self.manifest is not None and str(layer) in self.manifest["layers"]

    def load(self, layer: int, shape=None, with_biases: bool = False, **kwargs):
        """The executor of `layer` copied from the cache (CpuMoE.from_packed with kwargs), or None where the
        cache does not serve it (none, or this layer's bytes failed: the cache is then rebuilt)."""
        if self.manifest is None:
            return None
        t0 = time.perf_counter()
        entry = self.manifest["layers"][str(layer)]
        try:
            if shape is not None and list(shape) != entry["shape"]:
                raise ValueError(f"layer {layer} holds experts {entry['shape']}, the checkpoint {list(shape)}")
            if with_biases != any(name.endswith(".bias") for name in entry["parts"]):
                raise ValueError(f"layer {layer}'s biases differ from the checkpoint's")
            moe = self._read_layer(entry, **kwargs)
        except (OSError, ValueError) as exc:
            self._rebuild(f"layer {layer}: {getattr(exc, 'strerror', None) or exc}")
            return None
        self._loaded[layer] = moe
        self.times.cache_s += time.perf_counter() - t0
        self.times.cache_bytes += entry["size"]
        return moe

    def _read_layer(self, entry: dict, **kwargs):
        """CpuMoE.from_packed over the layer's file, memory-mapped copy-on-write (never written: read-only files
        work); the views die with the mapping. The file's pages stay in the page cache for the next start."""
        from cpu_kernels import CpuMoE

        with open(self.folder / entry["file"], "rb") as f:
            if os.fstat(f.fileno()).st_size != entry["size"]:
                raise ValueError(f"{entry['file']} changed size since the load started")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            with contextlib.suppress(AttributeError, OSError):
                mm.madvise(mmap.MADV_WILLNEED)  # read ahead while the node threads copy
            try:
                data = torch.frombuffer(mm, dtype=torch.uint8)
                state = {name: data[off:off + n] for name, (off, n) in entry["parts"].items()}
                return CpuMoE.from_packed(state, entry["shape"], entry.get("layout", self.layout), **kwargs)
            finally:
                state = data = None
                mm.close()

    def _rebuild(self, why: str) -> None:
        """A layer's bytes failed after the checks passed: drop the cache and write it again, starting with the
        layers already read from it (their executors hold the same bytes)."""
        self._discard(why)
        for layer, moe in self._loaded.items():
            self.store(layer, moe)

    # -- writing ----------------------------------------------------------------------------------
    def store(self, layer: int, moe) -> None:
        """Keep the layer's packed bytes (views of the executor's buffers, which stay as packed: no copy) for the
        writer thread that commit starts; the load neither writes nor waits for the disk."""
        if self.manifest is not None or self._off:
            return
        t0 = time.perf_counter()
        state = moe.packed_state()
        parts, off = {}, 0
        for name, t in state.items():
            parts[name] = [off, t.numel()]
            off = -(-(off + t.numel()) // ALIGN) * ALIGN
        self._need = self._need or off * len(self.layers)
        size = max(o + n for o, n in parts.values())
        self._queued += size
        # a layer whose down has a dtype of its own (a GGUF file's mixed types) records its layout
        own = moe.layout if moe.layout != self.layout else None
        self._pending.append((layer, state, parts, [moe.E, moe.F, moe.D], own))
        self.times.cache_writing += size
        self.times.cache_s += time.perf_counter() - t0

    def _write(self) -> None:
        """The writer thread: the temporary folder (if the disk has room), each layer's file, the manifest and
        the rename. It owns the temporary folder: an error (one warning) or a cancel removes it."""
        t0 = time.perf_counter()
        with contextlib.suppress(AttributeError, OSError):  # the model's threads come first, for CPU and I/O
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _WRITER_NICE))
        try:
            self._start(self._need)
            for layer, state, parts, shape, own in self._pending:
                if self._tmp is None or self._cancel.is_set():
                    break
                self._write_layer(layer, state, parts, shape, own)
            state = None  # the executors' buffers are let go here, not while the interpreter exits
            if self._tmp is not None and not self._cancel.is_set():
                self._publish()
                log.info("packed cache %s: written in the background (%.2f GB in %.1f s)", self.key,
                         self._done / 1e9, time.perf_counter() - t0)
        except OSError as exc:
            self._give_up(f"not written ({exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''})")
        except Exception as exc:  # noqa: BLE001 - the background write never takes the model down
            self._give_up(f"not written (unexpected {type(exc).__name__})")
            log.debug("packed cache %s: the writer failed", self.key, exc_info=True)
        finally:
            self._off = True
            self._remove_tmp()  # a cancelled or failed write's folder; none after the rename
            self._pending = []  # let go of the executors' buffers
            with _WRITERS_LOCK:
                _WRITERS.discard(self)
            self._over.set()

    def _start(self, need: int) -> None:
        """The temporary folder, if the disk has room for every layer (and a margin)."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if free < need + (64 << 20):
            self._give_up(f"not written: {need / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free under {self.root}")
            return
        tmp = self.root / f".tmp-{self.key}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        self._tmp = tmp

    def _write_layer(self, layer: int, state: dict, parts: dict, shape: list, own: dict | None = None) -> None:
        """One layer's file: its parts at their offsets, written in pieces (stop() is seen between two), fsynced;
        its pages stay in the page cache for the next start."""
        name = f"layer-{layer}.bin"
        path = self._tmp / name
        with open(path, "wb") as f:
            for part, t in state.items():
                f.seek(parts[part][0])
                data = memoryview(t.numpy())
                for at in range(0, len(data), _PIECE):
                    if self._cancel.is_set():
                        return
                    f.write(data[at:at + _PIECE])
                    self._done += min(_PIECE, len(data) - at)
            f.truncate(max(off + n for off, n in parts.values()))
            f.flush()
            os.fsync(f.fileno())
        size, digest = _file_hash(path)
        self._written[str(layer)] = dict(file=name, size=size, hash=digest, parts=parts, shape=shape,
                                         **({"layout": own} if own is not None else {}))

    def _give_up(self, why: str) -> None:
        log.warning("packed cache %s: %s; %s", self.key, why, _NOT_WRITTEN)
        self._off = True
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def commit(self) -> None:
        """After the last layer: the writer thread starts on the layers stored (the load does not wait for it;
        see wait and the wait at exit); a cache read from is marked used instead."""
        if self.manifest is not None:
            with contextlib.suppress(OSError):
                (self.folder / LAST_USED).touch()
        elif self._pending and not self._off and self._writer is None:
            self._writer = threading.Thread(target=self._write, daemon=True, name=f"packed-cache-{self.key[:8]}")
            with _WRITERS_LOCK:
                _WRITERS.add(self)
            self._writer.start()

    def _publish(self) -> None:
        if sorted(int(i) for i in self._written) != sorted(self.layers):
            raise OSError(f"layers {sorted(self._written)} written of {self.layers}")
        body = dict(format=FORMAT, key=self.key, created=time.time(), model=self.identity["path"],
                    dtype=self.layout["dtype"], group_size=self.layout["group_size"], layout=self.layout,
                    checkpoint=self.identity, layers=self._written)
        with open(self._tmp / MANIFEST, "w") as f:
            json.dump(dict(checksum=_checksum(body), body=body), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        (self._tmp / LAST_USED).touch()
        _fsync_dir(self._tmp)
        try:
            os.rename(self._tmp, self.folder)
        except OSError:  # another load published this key first: theirs is as good
            if not (self.folder / MANIFEST).exists():
                raise
            self._remove_tmp()
            return
        self._tmp = None
        _fsync_dir(self.root)
        self._remove_superseded()

    def _remove_superseded(self) -> None:
        """Caches of this model folder and layout made from an older state of its files are dead weight."""
        for info in list_caches(self.root):
            if info.key != self.key and info.model == self.identity["path"] and info.layout == self.layout:
                shutil.rmtree(info.folder, ignore_errors=True)
                log.info("packed cache %s: removed (superseded by %s)", info.key, self.key)

    def close(self) -> None:
        """After the load, whatever happened: a load that failed before commit wrote nothing, and its layers'
        bytes are let go; a committed write goes on in the background."""
        if self._writer is None:
            self._pending = []

    def stop(self) -> None:
        """The writer stops at its next 64 MiB and removes its temporary folder (Ctrl-C while waiting at exit)."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the background write is over (published, given up or stopped); whether it is. An event, not
        Thread.join: a join that Ctrl-C interrupts takes the thread for finished (Python 3.11) and the
        exit would cut the writer off before it removes its folder."""
        if self._writer is None:
            return True
        if self._over.wait(timeout):
            self._writer.join()  # its last steps: a daemon thread cut off at exit inside torch code aborts
            return True
        return False

    @property
    def writing(self) -> int:
        """Bytes handed to the writer and not yet written."""
        return max(0, self._queued - self._done) if self._writer is not None and not self._over.is_set() else 0


def wait_for_writers(timeout: float | None = None) -> bool:
    """Until every background write of this process is over; whether they are (False: timeout passed)."""
    with _WRITERS_LOCK:
        running = list(_WRITERS)
    deadline = None if timeout is None else time.monotonic() + timeout
    return all([c.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for c in running])


EXIT_POLL_S = 0.25


def _finish_at_exit() -> None:
    """At interpreter exit: a cache still being written is finished (one line says so), so a one-shot command
    leaves it complete; Ctrl-C meanwhile stops it (its writer removes the temporary folder)."""
    with _WRITERS_LOCK:
        running = list(_WRITERS)
    if not running:
        return
    left = sum(c.writing for c in running)
    try:  # the line inside: a Ctrl-C the moment it is read still stops the writers
        print(f"finishing the packed cache ({left / 1e9:.2f} GB left to write; Ctrl-C skips it)…", file=sys.stderr,
              flush=True)
        # waits of a quarter second: a Ctrl-C the kernel hands to another thread does not wake a blocked main
        # thread, which sees it only when it next runs
        while not wait_for_writers(EXIT_POLL_S):
            pass
    except KeyboardInterrupt:
        for c in running:
            c.stop()
        wait_for_writers()


atexit.register(_finish_at_exit)


def open_for_load(model_dir, cfg, offload, times: LoadTimes, layer_formats: bool = False) -> PackedCache | None:
    """The packed cache of a load_hybrid: layout from the executor arguments HybridExperts will pass (layer_formats:
    a GGUF file's layers in formats of their own, another key than the same file in one format)."""
    from cpu_kernels.moe import packed_layout

    layout = packed_layout(cfg.expert_intermediate_size, offload.cpu_dtype, offload.group_size, isa=offload.cpu_isa,
                           topology=offload.topology, threads=None if offload.topology else offload.threads)
    if layer_formats:
        layout = {**layout, "layer_formats": True}
    try:
        return PackedCache.open(model_dir, layout, cfg.moe_layer_indices, times)
    except OSError as exc:  # the checkpoint's files or the cache folder cannot even be looked at
        log.warning("packed cache: not used (%s%s); %s", exc.strerror or exc,
                    f": {exc.filename}" if exc.filename else "", _NOT_WRITTEN)
        return None


@dataclass
class CacheInfo:
    """One folder under cache_root(), as `hybrid cache list` shows it."""

    key: str
    folder: Path
    model: str  # the checkpoint folder, or why the manifest cannot be read
    dtype: str
    bytes: int
    last_used: float
    layout: dict | None


def list_caches(root: Path | None = None) -> list[CacheInfo]:
    """Every cache folder (temporary ones left out), most recently used first."""
    root = cache_root() if root is None else root
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if not d.is_dir() or d.name.startswith("."):
            continue
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        stamp = d / LAST_USED if (d / LAST_USED).exists() else d
        try:
            body = read_manifest(d)
            model, dtype, layout = body.get("model", "?"), str(body.get("dtype", "?")), body.get("layout")
            if dtype == "int4":
                dtype += f"/g{body.get('group_size')}"
        except ValueError as exc:
            model, dtype, layout = f"(bad: {exc})", "?", None
        out.append(CacheInfo(d.name, d, model, dtype, size, stamp.stat().st_mtime, layout))
    return sorted(out, key=lambda c: -c.last_used)


def remove_cache(key: str, root: Path | None = None) -> CacheInfo:
    """Remove the cache folder named `key` (or a unique prefix of 6 or more of its characters); KeyError when
    none or several match."""
    caches = list_caches(root)
    match = [c for c in caches if c.key == key] or [c for c in caches if len(key) >= 6 and c.key.startswith(key)]
    if len(match) != 1:
        raise KeyError(f"{'no' if not match else 'more than one'} packed cache {key!r}")
    shutil.rmtree(match[0].folder)
    return match[0]
