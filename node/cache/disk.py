"""A prompt cache on each host's disk, under the in-memory ones (serve's LRU, chat's turn).

Each rank writes the KV of its own layers (pipeline) or its own heads (tensor) for every
complete block of BLOCK_TOKENS tokens of an answer's tokens, under a chain hash of the blocks
(a block's name covers every token before it), in a folder whose name covers everything that
makes a cache valid (``plan_key``: the weights' content fingerprint, the mlx and mlx-lm
versions, the family, the mode, the rank count, this rank's layers and split, the KV
settings). A new prompt's longest prefix of blocks on disk is found by name; every rank then
agrees on the shortest prefix that every rank holds and reads (``all_min``), so a block
missing or unreadable on one rank is a miss for all.

The cache lives in a folder of its own, ``STORE`` under the folder the user names (with a
marker file): it reads, writes and deletes only there, only files named as it names them, and
refuses a folder it did not make or that another user owns. Folders are 0700, files 0600
(the first layers' KV map back to the prompt's tokens). Blocks are safetensors files (no
pickle) whose metadata holds an HMAC of their name, plan and arrays under a key kept in the
store (0600): a truncated, corrupt, planted or foreign block is a miss (and removed when it
can be); its arrays must also have the shapes and dtypes of the plan's manifest, written with
the plan's first block. Files are written to a temporary name and renamed, so two processes
sharing a folder never see half a block; the store is kept under a byte bound by removing the
least recently used blocks (a read touches a block). Writing happens on a thread of its own
after the answer; the arrays to write are views taken on the rank's main thread, so the
generation never waits for the disk; what waits to be written is bounded in bytes, and a
writer that fails for any reason turns writing off (said once) instead of dying.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

BLOCK_TOKENS = 256
FORMAT = "3"
TMP_SUFFIX = ".tmp"
STATE_META = "__state__"  # a read state record's packed states (not an array name)
STORE = "mlx-cluster-kv"  # the folder of ours under the one the user names
MARKER = "MLX-CLUSTER-KV"  # in it: this folder is the prompt cache's
KEY_FILE = ".key"  # in it: the HMAC key of its blocks (0600)
MANIFEST = "layers.json"  # in a plan's folder: the shapes and dtypes its blocks hold
STATES = "states.json"  # and its state records' (-1: a sliding window's length varies)
FINGERPRINTS = "fingerprints.json"  # in the store: weights' fingerprints by path and stat
PLAN_NAME = re.compile(r"[0-9a-f]{24}")
BLOCK_NAME = re.compile(r"[0-9a-f]{40}\.safetensors")
TMP_NAME = re.compile(r"[0-9a-f]{40}\.safetensors\.\d+\.\d+\.tmp|.+\.\d+\.\d+\.tmp")
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died
MAX_QUEUED_BYTES = 512 << 20  # blocks waiting for the writer: past it, new ones are skipped
SAMPLE = 64  # bytes read at the start, middle and end of each tensor for the fingerprint


class NotOurs(RuntimeError):
    """The folder named for the cache is not one the cache may use (the sentence says why)."""


def open_store(root: Path) -> tuple[Path, bytes]:
    """The store under ``root`` (made 0700 with its marker and key if new) and its HMAC key;
    NotOurs when it exists and is not the cache's, or belongs to another user."""
    store = Path(root) / STORE
    try:
        root.mkdir(parents=True, exist_ok=True)
        store.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(store)
    except OSError as e:
        raise NotOurs(f"cannot make {store} ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotOurs(f"{store} is not a folder")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise NotOurs(f"{store} belongs to another user; pass a --prompt-cache-dir of yours")
    marker = store / MARKER
    if not marker.exists():
        if any(not _being_made(f.name) for f in store.iterdir()):
            raise NotOurs(f"{store} holds files the prompt cache did not write; pass another "
                          "--prompt-cache-dir (nothing there is read or removed)")  # fmt: skip
        _write_new(marker, b"mlx-cluster's prompt cache: every file here is its own\n")
    os.chmod(store, 0o700)
    return store, _key(store / KEY_FILE)


def _being_made(name: str) -> bool:
    """A file another rank of this host writes while it makes the same new store (the
    marker, the key, either's temporary file): ranks open the store at the same moment."""
    return any(name == f or (name.startswith(f + ".") and name.endswith(TMP_SUFFIX))
               for f in (MARKER, KEY_FILE))  # fmt: skip


def _key(path: Path) -> bytes:
    """The store's HMAC key: made once (whole or not at all: two ranks of one host race)."""
    for _ in range(3):
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            _write_new(path, secrets.token_bytes(32))
            continue
        if len(key) == 32:
            return key
        path.unlink(missing_ok=True)  # cut short by a crash: the blocks under it are misses
    raise NotOurs(f"cannot make the key {path}")


def _write_new(path: Path, data: bytes) -> None:
    """``data`` as a new file 0600, complete when it appears; nothing if one is already there."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _write_replacing(path: Path, data: bytes) -> None:
    """``data`` as ``path`` (0600), replacing it atomically."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    finally:
        tmp.unlink(missing_ok=True)


def file_fingerprint(path: Path) -> str:
    """One safetensors file's content, cheaply: its header (names, shapes, dtypes, offsets)
    and SAMPLE bytes at the start, middle and end of every tensor's data. A fine-tune, a
    re-quantization or another revision of the same shapes changes every tensor it touches,
    and each tensor is sampled."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        h.update(f"{size}:".encode() + header)
        base = 8 + n
        tensors = json.loads(header)
        spans = sorted(tuple(v["data_offsets"]) for k, v in tensors.items()
                       if k != "__metadata__" and isinstance(v, dict))  # fmt: skip
        for begin, end in spans:
            for at in sorted({begin, max(begin, (begin + end) // 2 - SAMPLE // 2),
                              max(begin, end - SAMPLE)}):  # fmt: skip
                h.update(os.pread(fd, min(SAMPLE, end - at), base + at))
    return h.hexdigest()


def weights_fingerprint(model_dir: Path, store: Path | None = None) -> str:
    """The weights' content on this host: the config, the index, and each safetensors file's
    ``file_fingerprint`` (a host may hold only its own stage's files: another host's ranks
    have their own keys, and their miss is every rank's). Remembered in the store by path,
    size, mtime, inode and ctime, so a start reads each file's samples once, and a file
    replaced by another of the same size and mtime (a copy that keeps times, ``cp -p``,
    rsync) is read again: its inode or its ctime, which no copy can set, changed."""
    model_dir = Path(model_dir)
    known: dict = {}
    cache_file = store / FINGERPRINTS if store is not None else None
    if cache_file is not None:
        try:
            known = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            known = {}
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (model_dir / name).exists():
            h.update((model_dir / name).read_bytes())
    changed = False
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        key = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
        if not isinstance(known.get(key), str):
            known[key] = file_fingerprint(f)
            changed = True
        h.update(f"{f.name}:{known[key]}".encode())
    if changed and cache_file is not None:
        try:
            _write_replacing(cache_file, json.dumps(known).encode())
        except OSError:
            pass  # only a cache of the work: the next start reads the samples again
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


STATE_KINDS = (RotatingKVCache, ArraysCache)  # kept whole at block boundaries (snapshots)


Part = int | str  # a layer's KV cache in the list: its index, or "i.j" (a CacheList's j-th)


def local_layers(cache: list) -> list[Part] | None:
    """This rank's KV caches in a fresh cache list (other layers' slots are node.model.stage's
    SkippedCache), kept as blocks: a layer's index, or "i.j" for each KV cache of a
    CacheList (DeepSeek V3.2's and GLM-5's latent and indexer keys, LongCat's two attentions);
    None when a layer's cache is neither those nor one of STATE_KINDS (quantized, other
    composite caches: no disk tier)."""
    from node.model.stage import SkippedCache

    ids: list[Part] = []
    for i, c in enumerate(cache):
        if isinstance(c, SkippedCache) or isinstance(c, STATE_KINDS):
            continue
        if isinstance(c, CacheList) and all(type(p) is KVCache for p in c.caches):
            ids.extend(f"{i}.{j}" for j in range(len(c.caches)))
            continue
        if type(c) is not KVCache:
            return None
        ids.append(i)
    return ids


def kv_part(cache: list, part: Part) -> KVCache:
    """The KV cache ``part`` names (``local_layers``)."""
    if isinstance(part, str):
        i, j = part.split(".")
        return cache[int(i)].caches[int(j)]
    return cache[part]


def state_layers(cache: list) -> list[int]:
    """The indices of this rank's caches that cannot be cut into blocks (a linear
    attention's state, a sliding window): each is kept whole, as it stands at a block
    boundary that a snapshot reached (node.cache.snapshots), in a state record named after
    the blocks before it (``state_name``)."""
    return [i for i, c in enumerate(cache) if isinstance(c, STATE_KINDS)]


def state_name(block: str) -> str:
    """The state record at the end of the block named ``block``: a name of the blocks' form
    (the store's bound and reads treat it as one), which no block can have."""
    return hashlib.sha256(f"state/{block}".encode()).hexdigest()[:40]


def pack_state(value: Any, name: str, arrays: dict[str, mx.array]) -> Any:
    """A cache's ``state`` (arrays, numbers, None, in tuples and lists) as JSON, its arrays
    into ``arrays`` under names from ``name``; ``unpack_state`` makes it again."""
    if isinstance(value, mx.array):
        arrays[name] = value
        return {"array": name}
    if isinstance(value, (list, tuple)):
        return [pack_state(v, f"{name}.{j}", arrays) for j, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a cache state holds a {type(value).__name__}")


def unpack_state(value: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(value, dict):
        return arrays[value["array"]]
    if isinstance(value, list):
        return [unpack_state(v, arrays) for v in value]
    return value


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
    """One rank's disk tier for one plan: ``folder`` is the plan's, in the store under
    ``root`` (open_store: NotOurs when the cache may not use it); ``limit_bytes`` bounds the
    whole store (every plan and model kept there on this host)."""

    def __init__(self, root: Path, key: str, limit_bytes: float, layers: list[Part],
                 log: Callable[[str], None] = lambda _: None, group=None,
                 warn: Callable[[str], None] | None = None,
                 states: list[int] | None = None):  # fmt: skip
        self.group = group  # the job's: restore agrees with every rank
        self.store, self.secret = open_store(Path(root))
        self.key = key
        self.folder = self.store / key
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self.limit = limit_bytes
        self.layers = layers
        self.states = states or []  # state_layers: kept whole, in state records
        self.log = log
        self.warn = warn or log
        self.stats = DiskStats()
        self.manifest: dict | None = self._read_manifest()  # None until the plan's first block
        self.state_manifest: dict | None = self._read_manifest(STATES)
        self.lock = threading.Lock()
        self.queued: set[str] = set()  # names waiting for the writer
        self.queued_bytes = 0
        self.writing = True  # off for good once the writer failed
        self.total: float | None = None  # the store's bytes as last counted, plus writes
        self.counted_at = 0.0
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="disk-cache")
        self.writer.start()

    # --- names -------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.folder / name[:2] / f"{name}.safetensors"

    def mac(self, name: str, digest: str) -> str:
        """What only this store's key signs: the block's plan, name and arrays."""
        message = f"{FORMAT}/{self.key}/{name}/{digest}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def held(self, names: list[str]) -> list[int]:
        """The sizes of the first blocks that are on disk (by name only; reading may still
        fail), up to the first that is not."""
        sizes = []
        for name in names:
            try:
                sizes.append(self.path(name).stat().st_size)
            except OSError:
                break
        return sizes

    # --- the plan's manifest -----------------------------------------------------------------

    def _read_manifest(self, file: str = MANIFEST) -> dict | None:
        try:
            data = json.loads((self.folder / file).read_text())
            layers = data["layers"]
            if hmac.compare_digest(data["mac"], self.mac(file, _canonical(layers))):
                return layers
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def _write_manifest(self, layers: dict, file: str = MANIFEST) -> dict | None:
        """The plan's first block's (or state record's) shapes; one there that this store
        did not sign (planted, copied in) is replaced."""
        body = json.dumps({"layers": layers, "mac": self.mac(file, _canonical(layers))}).encode()
        _write_new(self.folder / file, body)
        if (manifest := self._read_manifest(file)) is None:
            _write_replacing(self.folder / file, body)
            manifest = self._read_manifest(file)
        return manifest

    # --- reading -----------------------------------------------------------------------------

    def read(self, names: list[str], states: bool = False) -> list[dict[str, Any]]:
        """The blocks (or state records), in order, up to the first missing or bad one (a
        bad one is removed when this user may)."""
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
                why = self.check(name, meta, arrays, states)
            except FileNotFoundError:
                break
            except Exception as e:  # truncated, unreadable, another format
                why = f"unreadable ({type(e).__name__}: {e})"
            if why is not None:
                self.log(f"disk prompt cache: block {p.name} {why}; a miss")
                try:
                    p.unlink()
                except OSError:
                    pass  # another user's (a shared folder): left as it is
                break
            dtypes = json.loads(meta["dtypes"])
            blocks.append({k: _restore(v, dtypes[k]) for k, v in arrays.items()})
            if states:
                blocks[-1][STATE_META] = json.loads(meta["state"])
            try:
                size += p.stat().st_size
                os.utime(p)  # recently used
            except OSError:
                pass
        if blocks:
            self.stats.read_s += time.perf_counter() - start
            self.stats.bytes_read += size
        return blocks

    def check(self, name: str, meta: dict, arrays: dict[str, np.ndarray],
              states: bool = False) -> str | None:  # fmt: skip
        """Why a block (or state record) may not be used (None: it may): another format, a
        signature that is not this store's, arrays other than the plan's layers, shapes or
        dtypes other than the plan's manifest."""
        if meta.get("format") != FORMAT:
            return "is of another format"
        signed = _digest(arrays) + (f"/{meta.get('state', '')}" if states else "")
        if not hmac.compare_digest(str(meta.get("mac", "")), self.mac(name, signed)):
            return "was not written by this cache, or changed since (its signature differs)"
        if states:
            manifest = self.state_manifest or self._read_manifest(STATES)
            self.state_manifest = manifest
        else:
            manifest = self.manifest or self._read_manifest()
            self.manifest = manifest
        if manifest is None:
            return "has no manifest of its plan"
        dtypes = json.loads(meta.get("dtypes", "{}"))
        if set(arrays) != set(manifest) or set(dtypes) != set(manifest):
            return "holds other layers than its plan"
        if states:
            mine = {k for k in arrays if k[1:].split(".")[0] in {str(i) for i in self.states}}
        else:
            mine = {f"{kind}{i}" for i in self.layers for kind in "kv"}
        if set(arrays) != mine:  # a plan key of another layout (it names every part of it)
            return "holds other layers than this rank's"
        for k, a in arrays.items():
            shape, dtype = manifest[k]
            fits = len(shape) == a.ndim and all(
                m in (-1, d) for m, d in zip(shape, a.shape, strict=False)
            )
            if not fits or dtypes[k] != dtype:
                return f"has {k} of shape {list(a.shape)} {dtypes[k]}, not {manifest[k]}"
        return None

    def state_at(self, names: list[str], most: int) -> int:
        """The most blocks (at most ``most``) at whose end this rank has a state record
        (``most`` when it keeps no state layers; 0 when none)."""
        if not self.states:
            return most
        return next((n for n in range(most, 0, -1) if self.held([state_name(names[n - 1])])), 0)

    def agree_state(self, names: list[str], n: int) -> int:
        """The most blocks, at most ``n``, that every rank has and at whose end every rank has
        a state record (the same collectives on every rank: each step's decision is agreed)."""
        while n:
            n = agree_min(self.state_at(names, n), self.group)
            if not n or agree_min(int(self.state_at(names, n) == n), self.group):
                return n
            n -= 1
        return 0

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
        n = self.agree_state(names, n)  # every rank: some may keep no state layers
        blocks = self.read(names[:n]) if n else []
        record = self.read([state_name(names[n - 1])], states=True) if n and self.states else []
        cache = make_prompt_cache(model)
        packed = record[0][STATE_META] if record else {}
        kinds = all(p["kind"] == type(cache[int(i)]).__name__ for i, p in packed.items())
        if self.states:  # the state record is at the end of the n blocks: all or none
            read = n if len(blocks) == n and len(record) == 1 and kinds else 0
        else:  # the blocks up to the first bad one
            read = len(blocks)
        agreed = agree_min(read, self.group)
        if agree_min(int(agreed == n or not self.states), self.group) == 0:
            agreed = 0  # a rank's state record is at n only
        n = agreed
        if not n:
            return None, 0
        for i in self.layers:
            keys = mx.concatenate([b[f"k{i}"] for b in blocks[:n]], axis=2)
            values = mx.concatenate([b[f"v{i}"] for b in blocks[:n]], axis=2)
            kv_part(cache, i).state = (keys, values, n * BLOCK_TOKENS)
        for i, p in packed.items():
            cache[int(i)].state = unpack_state(p["state"], record[0])
        mx.eval(
            [kv_part(cache, i).keys for i in self.layers],
            [kv_part(cache, i).values for i in self.layers],
            [a for k, a in (record[0] if record else {}).items() if k != STATE_META],
        )
        self.stats.hits += 1
        return cache, n * BLOCK_TOKENS

    def lookup(self, model, tokens: list[int]) -> tuple[list, int]:
        """``restore``, with a fresh cache on a miss: (cache, tokens read). Without a measured
        prefill rate (a job's first prompt), reading is always tried."""
        cache, n = self.restore(model, tokens)
        return (cache if cache is not None else make_prompt_cache(model)), n

    # --- writing -----------------------------------------------------------------------------

    def save(self, tokens: list[int], cache: list, whole: bool = False) -> int:
        """Queue the blocks of ``tokens`` that ``cache`` holds and neither the disk nor the
        queue does; returns how many. ``whole``: the cache holds exactly ``tokens`` (a
        snapshot), which end on a block boundary: the state layers' record there too. The
        arrays are views (evaluated here, on the rank's thread); the thread writes them. Past
        MAX_QUEUED_BYTES waiting (a slow disk), the rest are skipped: memory stays bounded
        whatever the disk does."""
        if not self.writing or local_layers(cache) != self.layers:
            return 0
        if self.layers:
            held = min(getattr(kv_part(cache, i), "offset", 0) for i in self.layers)
        else:
            held = len(tokens) if whole else 0
        names = block_hashes(tokens[:held])
        work: list[tuple[str, dict, dict, int, dict | None]] = []
        with self.lock:
            room = MAX_QUEUED_BYTES - self.queued_bytes
        for b, name in enumerate(names):
            if name in self.queued or self.path(name).exists():
                continue
            lo, hi = b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS
            arrays, dtypes = {}, {}
            for i in self.layers:
                kv = kv_part(cache, i)
                for kind, a in (("k", kv.keys), ("v", kv.values)):
                    dtypes[f"{kind}{i}"] = str(a.dtype).removeprefix("mlx.core.")
                    arrays[f"{kind}{i}"] = _stored(a[..., lo:hi, :])
            nbytes = sum(a.nbytes for a in arrays.values())
            if nbytes > room:
                break
            room -= nbytes
            work.append((name, arrays, dtypes, nbytes, None))
        if whole and self.states and names and held == len(tokens) and held % BLOCK_TOKENS == 0:
            record = state_name(names[-1])
            if record not in self.queued and not self.path(record).exists():
                arrays = {}
                packed = {str(i): {"kind": type(cache[i]).__name__,
                                   "state": pack_state(cache[i].state, f"s{i}", arrays)}
                          for i in self.states}  # fmt: skip
                dtypes = {k: str(a.dtype).removeprefix("mlx.core.") for k, a in arrays.items()}
                arrays = {k: _stored(a) for k, a in arrays.items()}
                nbytes = sum(a.nbytes for a in arrays.values())
                if nbytes <= room:
                    work.append((record, arrays, dtypes, nbytes, packed))
        if not work:
            return 0
        mx.eval([a for _, arrays, _, _, _ in work for a in arrays.values()])
        with self.lock:
            for item in work:
                self.queued.add(item[0])
                self.queued_bytes += item[3]
        for item in work:
            self.pending.put(item)
        return len(work)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued block is written (a job's end; tests)."""
        done = threading.Event()
        self.pending.put(done)
        done.wait(timeout)

    def _write_loop(self) -> None:
        """The writer: any failure (a full disk, a folder gone, an error of the safetensors
        writer) turns writing off, said once, and what waits is let go; the thread lives."""
        while True:
            item = self.pending.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            name, arrays, dtypes, nbytes, state = item
            try:
                if self.writing:
                    self._write(name, arrays, dtypes, state)
                    self._fit()
            except Exception as e:
                if self.writing:
                    self.writing = False
                    self.warn(f"disk prompt cache: cannot write in {self.folder} "
                              f"({type(e).__name__}: {e}); it writes nothing more in this "
                              "job, answers go on (free disk space, or lower "
                              "--prompt-cache-disk-gb)")  # fmt: skip
            finally:
                del arrays
                with self.lock:
                    self.queued.discard(name)
                    self.queued_bytes -= nbytes

    def _write(self, name: str, arrays: dict[str, mx.array], dtypes: dict[str, str],
               state: dict | None = None) -> None:  # fmt: skip
        """A block, or (``state``: the packed states of the state layers) a state record."""
        from safetensors.numpy import save

        p = self.path(name)
        if p.exists():
            return
        stored = {k: np.ascontiguousarray(np.array(a, copy=False)) for k, a in arrays.items()}
        shapes: dict[str, list] = {k: [list(a.shape), dtypes[k]] for k, a in stored.items()}
        if state is None and self.manifest is None:
            self.manifest = self._write_manifest(shapes)
        if state is not None and self.state_manifest is None:
            for k, (shape, _) in shapes.items():  # a sliding window's length varies
                kind = state[k[1:].split(".")[0]]["kind"]
                if len(shape) == 4 and kind == RotatingKVCache.__name__:
                    shape[2] = -1
            self.state_manifest = self._write_manifest(shapes, STATES)
        signed = _digest(stored) + (f"/{json.dumps(state)}" if state is not None else "")
        meta = {"format": FORMAT, "mac": self.mac(name, signed), "dtypes": json.dumps(dtypes)}
        if state is not None:
            meta["state"] = json.dumps(state)
        data = save(stored, metadata=meta)
        p.parent.mkdir(mode=0o700, exist_ok=True)
        _write_replacing(p, data)
        self.stats.bytes_written += len(data)
        if self.total is not None:
            self.total += len(data)

    def files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every block in the store, by the store's own layout and
        names only; a temporary file left by a process that died long ago is removed."""
        out = []
        now = time.time()
        for plan in _entries(self.store):
            if not (PLAN_NAME.fullmatch(plan.name) and plan.is_dir(follow_symlinks=False)):
                continue
            for sub in _entries(Path(plan.path)):
                if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                    continue
                for f in _entries(Path(sub.path)):
                    try:
                        st = f.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if BLOCK_NAME.fullmatch(f.name):
                        out.append((st.st_mtime, st.st_size, Path(f.path)))
                    elif TMP_NAME.fullmatch(f.name) and now - st.st_mtime > STALE_TMP_S:
                        _remove(Path(f.path))
        return out

    def _fit(self) -> None:
        """Remove the least recently used blocks of the store while it is over the bound.
        The store is counted afresh at most every 30 s (other processes write to it too), or
        when the count kept since says it is over."""
        now = time.monotonic()
        if self.total is not None and self.total <= self.limit and now - self.counted_at < 30:
            return
        files = self.files()
        self.counted_at = now
        total = sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if total <= self.limit:
                break
            if _remove(f):
                total -= size
        self.total = total


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return True
    except OSError:  # another user's, in a shared folder
        return False


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


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
    """The folder the store goes in when none is named: the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-cluster"


def open_disk_cache(loaded, spec, group, log: Callable[[str], None],
                    warn: Callable[[str], None] | None = None) -> DiskCache | None:  # fmt: skip
    """Every rank at once: this rank's disk tier for the job, or None on every rank when the
    job asks for none or any rank cannot have one (its caches are not plain KV caches, a
    speculative proposer's caches ride along, its folder cannot be made or is not the
    cache's). ``warn``: what the user should see (the launcher shows it)."""
    warn = warn or log
    if spec.prompt_cache_disk_gb <= 0:
        return None
    if spec.draft.on or loaded.processor is not None:
        log("disk prompt cache: off with a draft model or a vision model")
        return None
    import mlx_lm

    fresh = make_prompt_cache(loaded.model)
    layers, states = local_layers(fresh), state_layers(fresh)
    root = Path(spec.prompt_cache_dir).expanduser() if spec.prompt_cache_dir else default_root()
    if layers is None:
        kinds = sorted({type(c).__name__ for c in fresh})
        warn(f"disk prompt cache off: this model's caches ({', '.join(kinds)}) are not kinds "
             "it keeps (KVCache in blocks; RotatingKVCache and ArraysCache whole)")  # fmt: skip
    disk = None
    if layers is not None:
        try:
            store, _ = open_store(root)
            q = spec.kv_quant
            versions = [getattr(mx, "__version__", ""), getattr(mlx_lm, "__version__", "")]
            key = plan_key(weights=weights_fingerprint(loaded.path, store), versions=versions,
                           family=loaded.config["model_type"], mode=spec.mode,
                           ranks=spec.world_size, rank=group.rank(), layers=layers,
                           states=states,
                           split=spec.split, split_weights=spec.split_weights,
                           kv=[q.kv_bits, q.kv_group_size, q.quantized_kv_start],
                           format=FORMAT)  # fmt: skip
            disk = DiskCache(root, key, spec.prompt_cache_disk_gb * 1e9, layers, log, group,
                             warn, states)  # fmt: skip
        except NotOurs as e:
            warn(f"disk prompt cache off: {e}")
        except OSError as e:
            warn(f"disk prompt cache off: cannot use {root} ({e})")
    if not agree_min(int(disk is not None), group) or disk is None:
        return None
    log(f"disk prompt cache: {disk.folder} (at most {spec.prompt_cache_disk_gb:g} GB in "
        f"{disk.store})")  # fmt: skip
    return disk


def _restore(a: np.ndarray, dtype: str) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def agree_min(n: int, group) -> int:
    """The smallest ``n`` over the ranks (one all_sum of a vector with a slot per rank)."""
    from node.rank.dist import gather_ints

    return min(gather_ints(n, group))
