"""A prompt cache on each host's disk, under the in-memory ones (serve's LRU, chat's turn).

Each rank writes the KV of its own layers (pipeline) or its own heads (tensor) for every
complete block of BLOCK_TOKENS tokens of an answer's tokens, under a chain hash of the blocks
(a block's name covers every token before it), in a folder whose name covers everything that
makes a cache valid (``plan_key``: the weights' fingerprint, the family, the mode, the rank
count, this rank's layers and split, the KV settings). A new prompt's longest prefix of
blocks on disk is found by name; every rank then agrees on the shortest prefix that every rank
holds and reads (``all_min``), so a block missing or unreadable on one rank is a miss for all.

Blocks are safetensors files (no pickle) with the sha256 of their arrays in the metadata: a
truncated or corrupt block is a miss and is removed. Files are written to a temporary name
and renamed, so two processes sharing a folder never see half a block; the folder is kept
under a byte bound by removing the least recently used blocks (a read touches a block).
Writing happens on a thread of its own after the answer; the arrays to write are views taken
on the rank's main thread, so the generation never waits for the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .dist import control_stream

BLOCK_TOKENS = 256
FORMAT = "1"
TMP_SUFFIX = ".tmp"


def weights_fingerprint(model_dir: Path) -> str:
    """The weights, cheaply: the config, the index, and each safetensors file's name, size and
    header (tensor names, shapes, dtypes and offsets) of those on this host, not their data.
    (A host may hold only its own stage's files; a file changed on another host changes
    that host's ranks' keys, and their miss is every rank's.)"""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (Path(model_dir) / name).exists():
            h.update((Path(model_dir) / name).read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(f"{f.name}:{f.stat().st_size}:".encode() + fh.read(n))
    return h.hexdigest()[:24]


def plan_key(**parts: Any) -> str:
    """A folder name from everything that makes a cache valid (plain JSON values)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def block_hashes(tokens: list[int], block: int = BLOCK_TOKENS) -> list[str]:
    """The chain hash of each complete block of ``tokens``: block i's covers blocks 0..i."""
    out, h = [], b""
    for i in range(len(tokens) // block):
        ids = np.asarray(tokens[i * block : (i + 1) * block], dtype=np.int64)
        h = hashlib.sha256(h + ids.tobytes()).digest()
        out.append(h.hex()[:40])
    return out


def local_layers(cache: list) -> list[int] | None:
    """The indices of this rank's KV caches in a fresh cache list (other layers' slots are
    node.stage's SkippedCache); None when a layer's cache is not a plain KVCache (sliding
    windows, quantized, state-space caches: no disk tier)."""
    from .stage import SkippedCache

    ids = []
    for i, c in enumerate(cache):
        if isinstance(c, SkippedCache):
            continue
        if type(c) is not KVCache:
            return None
        ids.append(i)
    return ids


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def _stored(a: mx.array) -> mx.array:
    """bfloat16 has no numpy type: it is stored as its bits."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


@dataclass
class DiskStats:
    """What this rank's disk tier did (rank 0's go to /metrics and the stats line)."""

    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0

    @property
    def read_bps(self) -> float | None:
        return self.bytes_read / self.read_s if self.read_s > 0 and self.bytes_read else None


class DiskCache:
    """One rank's disk tier for one plan: ``folder`` is ``root / plan_key``; ``limit_bytes``
    bounds the whole ``root`` (every plan and model kept there on this host)."""

    def __init__(self, root: Path, key: str, limit_bytes: float, layers: list[int],
                 log: Callable[[str], None] = lambda _: None, group=None):  # fmt: skip
        self.group = group  # the job's: restore agrees with every rank
        self.root = Path(root)
        self.folder = self.root / key
        self.limit = limit_bytes
        self.layers = layers
        self.log = log
        self.stats = DiskStats()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="disk-cache")
        self.writer.start()
        self.full_warned = False

    # --- names -------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.folder / name[:2] / f"{name}.safetensors"

    def held(self, names: list[str]) -> list[int]:
        """The sizes of the first blocks that are on disk (by name only; reading may still
        fail), up to the first that is not."""
        sizes = []
        for name in names:
            try:
                sizes.append(self.path(name).stat().st_size)
            except FileNotFoundError:
                break
        return sizes

    # --- reading -----------------------------------------------------------------------------

    def read(self, names: list[str]) -> list[dict[str, mx.array]]:
        """The blocks, in order, up to the first missing or bad one (a bad one is removed)."""
        from safetensors import safe_open

        blocks = []
        start = time.perf_counter()
        size = 0
        for name in names:
            p = self.path(name)
            try:
                with safe_open(str(p), framework="numpy") as f:
                    meta = f.metadata() or {}
                    arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
                if meta.get("format") != FORMAT or meta.get("sha256") != _digest(arrays):
                    raise ValueError("checksum")
                dtypes = json.loads(meta["dtypes"])
                blocks.append({k: _restore(v, dtypes[k]) for k, v in arrays.items()})
                size += p.stat().st_size
                os.utime(p)  # recently used
            except FileNotFoundError:
                break
            except Exception as e:  # truncated, corrupt, another format: a miss, removed
                self.log(f"disk prompt cache: block {p.name} unreadable ({e}); removed")
                p.unlink(missing_ok=True)
                break
        if blocks:
            self.stats.read_s += time.perf_counter() - start
            self.stats.bytes_read += size
        return blocks

    def restore(self, model, tokens: list[int], worth: Callable[[int, int], bool]
                = lambda tokens, nbytes: True) -> tuple[list | None, int]:  # fmt: skip
        """Every rank at once: a fresh cache holding the longest prefix of ``tokens`` (at
        most all but the last token, which must still be fed) that every rank has on disk,
        and its length; (None, 0) when none. ``worth`` (rank 0's): whether reading that many
        tokens' blocks of that many bytes beats prefilling them."""
        names = block_hashes(tokens[:-1])
        sizes = self.held(names)
        n = len(sizes)
        if n and (self.group is None or self.group.rank() == 0):
            n = n if worth(n * BLOCK_TOKENS, sum(sizes)) else 0
        n = agree_min(n, self.group)
        blocks = self.read(names[:n]) if n else []
        n = agree_min(len(blocks), self.group)
        if not n:
            return None, 0
        cache = make_prompt_cache(model)
        for i in self.layers:
            keys = mx.concatenate([b[f"k{i}"] for b in blocks[:n]], axis=2)
            values = mx.concatenate([b[f"v{i}"] for b in blocks[:n]], axis=2)
            cache[i].state = (keys, values, n * BLOCK_TOKENS)
        mx.eval([cache[i].keys for i in self.layers], [cache[i].values for i in self.layers])
        self.stats.hits += 1
        return cache, n * BLOCK_TOKENS

    def lookup(self, model, tokens: list[int]) -> tuple[list, int]:
        """``restore``, with a fresh cache on a miss: (cache, tokens read). Without a measured
        prefill rate (a job's first prompt), reading is always tried."""
        cache, n = self.restore(model, tokens)
        return (cache if cache is not None else make_prompt_cache(model)), n

    # --- writing -----------------------------------------------------------------------------

    def save(self, tokens: list[int], cache: list) -> int:
        """Queue the blocks of ``tokens`` that ``cache`` holds and the disk does not; returns
        how many. The arrays are views (evaluated here, on the rank's thread); the thread
        writes them."""
        if local_layers(cache) != self.layers:
            return 0
        held = min(getattr(cache[i], "offset", 0) for i in self.layers) if self.layers else 0
        names = block_hashes(tokens[:held])
        todo = [(b, name) for b, name in enumerate(names) if not self.path(name).exists()]
        if not todo:
            return 0
        work = []
        for b, name in todo:
            lo, hi = b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS
            arrays, dtypes = {}, {}
            for i in self.layers:
                for kind, a in (("k", cache[i].keys), ("v", cache[i].values)):
                    dtypes[f"{kind}{i}"] = str(a.dtype).removeprefix("mlx.core.")
                    arrays[f"{kind}{i}"] = _stored(a[..., lo:hi, :])
            work.append((name, arrays, dtypes))
        mx.eval([a for _, arrays, _ in work for a in arrays.values()])
        for item in work:
            self.pending.put(item)
        return len(work)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued block is written (a job's end; tests)."""
        done = threading.Event()
        self.pending.put(done)
        done.wait(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self.pending.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(*item)
            except OSError as e:  # a full disk, a folder gone: a warning, never a crash
                if not self.full_warned:
                    self.log(f"disk prompt cache: cannot write ({e}); answers go on without")
                    self.full_warned = True
            self._fit()

    def _write(self, name: str, arrays: dict[str, mx.array], dtypes: dict[str, str]) -> None:
        from safetensors.numpy import save_file

        p = self.path(name)
        if p.exists():
            return
        stored = {k: np.ascontiguousarray(np.array(a, copy=False)) for k, a in arrays.items()}
        meta = {"format": FORMAT, "sha256": _digest(stored), "dtypes": json.dumps(dtypes)}
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            save_file(stored, str(tmp), metadata=meta)
            os.replace(tmp, p)  # atomic: a reader sees the whole block or none
        finally:
            tmp.unlink(missing_ok=True)
        self.stats.bytes_written += p.stat().st_size

    def _fit(self) -> None:
        """Remove the least recently used blocks of ``root`` while it is over the bound."""
        files = []
        for f in self.root.rglob("*.safetensors"):
            try:
                st = f.stat()
            except FileNotFoundError:  # another process removed it
                continue
            files.append((st.st_mtime, st.st_size, f))
        total = sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if total <= self.limit:
                break
            f.unlink(missing_ok=True)
            total -= size


def worth_reading(stats: DiskStats, prefill_tps: float | None) -> Callable[[int, int], bool]:
    """Whether reading beats prefilling, from the rates measured so far (rank 0's): reading
    at the disk's measured rate (unmeasured: assumed worth it) against prefilling at the
    last prompt's rate (unmeasured: likewise)."""

    def worth(tokens: int, nbytes: int) -> bool:
        bps = stats.read_bps
        if bps is None or not prefill_tps:
            return True
        return nbytes / bps < tokens / prefill_tps

    return worth


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-cluster" / "prompt-cache"


def open_disk_cache(loaded, spec, group, log: Callable[[str], None]) -> DiskCache | None:
    """Every rank at once: this rank's disk tier for the job, or None on every rank when the
    job asks for none or any rank cannot have one (its caches are not plain KV caches, a
    speculative proposer's caches ride along, its folder cannot be made)."""
    if spec.prompt_cache_disk_gb <= 0:
        return None
    if spec.draft.on or loaded.processor is not None:
        log("disk prompt cache: off with a draft model or a vision model")
        return None
    layers = local_layers(make_prompt_cache(loaded.model))
    root = Path(spec.prompt_cache_dir).expanduser() if spec.prompt_cache_dir else default_root()
    ok = layers is not None
    if not ok:
        log("disk prompt cache: this model's caches are not plain KV caches; off")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log(f"disk prompt cache: cannot make {root} ({e}); off")
        ok = False
    if not agree_min(int(ok), group):
        return None
    q = spec.kv_quant
    key = plan_key(weights=weights_fingerprint(loaded.path), family=loaded.config["model_type"],
                   mode=spec.mode, ranks=spec.world_size, rank=group.rank(), layers=layers,
                   split=spec.split, split_weights=spec.split_weights,
                   kv=[q.kv_bits, q.kv_group_size, q.quantized_kv_start],
                   format=FORMAT)  # fmt: skip
    log(f"disk prompt cache: {root / key} (at most {spec.prompt_cache_disk_gb:g} GB in {root})")
    return DiskCache(root, key, spec.prompt_cache_disk_gb * 1e9, layers, log, group)


def _restore(a: np.ndarray, dtype: str) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def agree_min(n: int, group) -> int:
    """The smallest ``n`` over the ranks (one all_sum of a vector with a slot per rank)."""
    if group is None or group.size() == 1:
        return n
    slots = mx.zeros((group.size(),), dtype=mx.int32)
    slots[group.rank()] = n
    return int(mx.distributed.all_sum(slots, group=group, stream=control_stream()).min().item())
