"""A versioned store of model weights: one interface, two backends.

The trainer calls ``put(version, state_dict)`` after each step and ``gc(keep)``;
inference workers call ``latest()``, ``hold(reader, v)``, ``get(v)`` or
``iter_buckets(v)``, ``release(reader)``.
``WeightStore(url)`` picks the backend from the URL:

* ``mooncake://HOST:PORT/PREFIX?metadata=URL`` → ``rollart.weights.mooncake`` (a
  Mooncake distributed store; ``MooncakeMaster`` starts a local master and gives the URL)
* anything else → ``FsspecWeightStore`` (a local path, ``file://``, ``memory://`` within
  one process, object stores).

Each version is one safetensors blob, or (a trainer gang's, ``rollart.trainer.gang``)
HF-named buckets written by several publishers (``put_bucket``, each its own) and then a
manifest (``put_manifest``): a tensor-less blob under the version's name whose header
lists the buckets (``BUCKETS``). ``get`` reads a manifest's buckets in parallel and
returns the whole dict; ``iter_buckets`` returns a ``BucketStream``
(``rollart.weights.stream``) that reads them one
after another, a bounded number ahead of its consumer, so a reader that loads each bucket
as it arrives (an inference worker) never holds more than about two buckets. Every bucket
read goes through ``_read_bucket``, which counts the bytes read in ``transfer``; the
Mooncake backend's relay (``rollart.weights.relay``) overrides it so that pullers of a
version serve its buckets to each other and the trainer's side serves about one copy.
``LATEST`` names the newest complete version and is written after
the blob or manifest, so a reader never sees a half-written version (buckets without
their manifest are no version). Garbage
collection removes versions that are neither among the newest ``keep`` nor held by a
reader (a reader holds the version it is fetching); a backend may also refuse to remove
a version while a read is in progress (Mooncake leases), and then it is retried at the
next ``gc``. There is one publisher per store (the trainer).
"""

from __future__ import annotations

import abc
import json
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rollart.weights.stream import BucketStream

logger = logging.getLogger(__name__)


class UnreadableWeightsError(ValueError):
    """A stored weight version exists but cannot be loaded (truncated, corrupted)."""


class WeightStore(abc.ABC):
    """Versioned weights. ``WeightStore(url)`` returns the backend the URL names.

    Subclasses implement the byte-level primitives below; versioning, holds and garbage
    collection are shared. Stores pickle as their URL.
    """

    url: str

    def __new__(cls, url: str | None = None, *args, **kwargs):
        if cls is WeightStore:
            if str(url).startswith("mooncake://"):
                # import cycle, kept in here: MooncakeWeightStore subclasses WeightStore
                from rollart.weights.mooncake import MooncakeWeightStore

                cls = MooncakeWeightStore
            else:
                cls = FsspecWeightStore
        return super().__new__(cls)

    def __reduce__(self):
        return (WeightStore, (self.url,))

    # -- primitives (per backend) -------------------------------------------------------
    @abc.abstractmethod
    def _write(self, name: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _read(self, name: str) -> bytes | None:
        """The object's bytes, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def _remove(self, name: str) -> bool:
        """Remove an object; ``False`` when the backend refuses now (retry later)."""

    @abc.abstractmethod
    def versions(self) -> list[int]:
        """Versions present, oldest first."""

    @abc.abstractmethod
    def holds(self) -> dict[str, int]:
        """``{reader: version}`` for every reader that holds a version."""

    @abc.abstractmethod
    def hold(self, reader: str, version: int) -> None:
        """Mark ``version`` as needed by ``reader`` (until ``release``)."""

    @abc.abstractmethod
    def release(self, reader: str) -> None: ...

    def _forget(self, version: int) -> None:
        """Hook: a version was removed (backends that keep an index update it)."""

    def _remember(self, version: int) -> None:
        """Hook: a version was added."""

    # -- the interface ------------------------------------------------------------------
    @staticmethod
    def _name(version: int) -> str:
        return f"v{int(version):08d}.safetensors"

    def put(self, version: int, state_dict: dict[str, torch.Tensor],
            metadata: dict[str, str] | None = None) -> int:
        """Publish ``state_dict`` as ``version`` (tensors copied to CPU, contiguous), with
        ``metadata`` in the safetensors header (an adapter's: ``ADAPTER``, ``BASE``);
        returns the bytes published."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        blob = st_save(_untie(tensors), metadata=metadata)
        self.put_bytes(version, blob)
        return len(blob)

    def put_bytes(self, version: int, blob: bytes) -> None:
        """Publish an already serialised safetensors blob as ``version``."""
        self._write(self._name(version), blob)
        self._known_buckets()[int(version)] = []
        self._remember(int(version))
        self._write("LATEST", str(int(version)).encode())

    @staticmethod
    def _bucket_name(version: int, k: int) -> str:
        return f"v{int(version):08d}.b{int(k):05d}.safetensors"

    def put_bucket(self, version: int, k: int, state_dict: dict[str, torch.Tensor],
                   metadata: dict[str, str] | None = None) -> tuple[str, int]:
        """Write bucket ``k`` of ``version`` (no version yet: ``put_manifest`` makes it
        one); returns its name and bytes."""
        tensors = {n: v.detach().to("cpu").contiguous() for n, v in state_dict.items()}
        blob = st_save(_untie(tensors), metadata=metadata)
        name = self._bucket_name(version, k)
        self._write(name, blob)
        return name, len(blob)

    def put_manifest(self, version: int, buckets: list[str],
                     metadata: dict[str, str] | None = None) -> None:
        """Publish ``version`` as the ``buckets`` written before (``put_bucket``)."""
        head = {**(metadata or {}), BUCKETS: json.dumps(list(buckets))}
        self.put_bytes(version, st_save({}, metadata=head))
        self._known_buckets()[int(version)] = list(buckets)

    def _buckets_of(self, version: int) -> list[str]:
        """``version``'s bucket names (``[]``: one blob). Known without a read for what
        this store object published; else read once and kept (a Mooncake read leases the
        object, which holds off its removal until the next ``gc``)."""
        known = self._known_buckets()
        if version not in known:
            data = self._read(self._name(version))
            try:
                known[version] = json.loads(header_metadata(data).get(BUCKETS, "[]")) \
                    if data is not None else []
            except Exception:  # noqa: BLE001 - an unreadable manifest: its buckets stay
                known[version] = []
        return known[version]

    def _known_buckets(self) -> dict[int, list[str]]:
        return self.__dict__.setdefault("_bucket_names", {})

    def get(self, version: int, meta: bool = False, reader: str | None = None):
        """The tensors of ``version`` (a manifest's buckets read in parallel and merged);
        with ``meta``, ``(tensors, header metadata)``. ``reader``: the name the caller
        holds the version under (a relaying backend reads through its peers then)."""
        data, head, names = self._manifest(version)
        try:
            tensors = st_load(data)
            if names:
                with ThreadPoolExecutor(min(8, len(names))) as pool:
                    blobs = list(pool.map(lambda n: self._read_bucket(version, n, reader),
                                          names))
                missing = [n for n, b in zip(names, blobs) if b is None]
                if missing:
                    raise ValueError(f"buckets {missing} are missing")
                for blob in blobs:
                    tensors.update(st_load(blob))
            return (tensors, head) if meta else tensors
        except Exception as e:
            raise self._unreadable(version, e) from None

    def _manifest(self, version: int) -> tuple[bytes, dict[str, str], list[str]]:
        """``version``'s blob or manifest, read (and counted in ``transfer``): ``(bytes,
        header metadata less the bucket list, bucket names)``; ``KeyError`` when it is
        not in the store, ``UnreadableWeightsError`` when its header cannot be read."""
        data = self._read(self._name(version))
        if data is None:
            raise KeyError(f"weight version {version} is not in the store at {self.url}")
        self._count("origin_bytes", len(data))  # the blob, or the manifest
        try:
            head = header_metadata(data)
            return data, head, json.loads(head.pop(BUCKETS, "[]"))
        except Exception as e:
            raise self._unreadable(version, e) from None

    def _unreadable(self, version: int, e: BaseException) -> UnreadableWeightsError:
        return UnreadableWeightsError(
            f"weight version {version} in {self.url} is unreadable ({type(e).__name__}: "
            f"{e}); it was truncated or is not a safetensors file. Delete it so the "
            "previous version is used, or publish the weights again")

    def iter_buckets(self, version: int, *, reader: str | None = None, ahead: int = 2,
                     on_close: Callable[[], None] | None = None) -> BucketStream:
        """``version`` bucket by bucket: a ``BucketStream`` yielding ``(bucket name,
        tensors)``, read by a thread at most ``ahead`` buckets before its consumer
        (``ahead=2``: bucket k+1 is read while bucket k is loaded). A version stored as
        one blob is one bucket. ``KeyError`` when ``version`` is not in the store;
        ``UnreadableWeightsError`` (from the manifest here, from a bucket while
        iterating) when it cannot be read. ``reader``: as for ``get``."""
        data, head, names = self._manifest(version)
        try:
            first = None if names else st_load(data)
        except Exception as e:
            raise self._unreadable(version, e) from None
        return BucketStream(self, version, names, head, reader=reader, ahead=ahead,
                            whole=first, on_close=on_close)

    def _read_bucket(self, version: int, name: str, reader: str | None) -> bytes | None:
        """One bucket's bytes (``None``: missing), counted in ``transfer``. A relaying
        backend overrides this (``rollart.weights.relay``)."""
        data = self._read(name)
        if data is not None:
            self._count("origin_bytes", len(data))
        return data

    def _bucket_order(self, names: list[str], reader: str | None) -> list[str]:
        """The order a reader takes a version's buckets in (a relay stripes it)."""
        return list(names)

    @property
    def transfer(self) -> dict[str, int]:
        """Bytes this store object read (a copy): ``origin_bytes`` from the objects the
        trainer wrote (buckets, blobs, manifests), ``relay_bytes`` from other readers'
        replicas; ``fallbacks``: bucket reads that went to the origin because no replica
        could be read (``relay_*`` keys: the relay's own counts)."""
        with self._transfer_lock():
            return dict(self._transfer())

    def _transfer(self) -> dict[str, int]:
        return self.__dict__.setdefault("_transfer_counts", {
            "origin_bytes": 0, "relay_bytes": 0, "fallbacks": 0})

    def _transfer_lock(self) -> threading.Lock:
        return self.__dict__.setdefault("_transfer_mutex", threading.Lock())

    def _count(self, key: str, n: int = 1) -> None:
        with self._transfer_lock():
            counts = self._transfer()
            counts[key] = counts.get(key, 0) + int(n)

    def _remove_extras(self, name: str) -> bool:
        """Hook: remove what readers added next to bucket ``name`` (relay replicas);
        ``False`` when something must wait for the next ``gc``."""
        return True

    def _remove_version(self, version: int) -> bool:
        """Remove ``version``: its buckets, then its blob or manifest (kept, to retry at
        the next ``gc``, while a bucket cannot be removed yet)."""
        names = self._buckets_of(version)
        if not all([self._remove_extras(name) for name in names]):
            return False
        if not all([self._remove(name) for name in names]):
            return False
        if not self._remove(self._name(version)):
            return False
        self._known_buckets().pop(int(version), None)
        return True

    def get_newest_readable(self, meta: bool = False) -> tuple:
        """``(version, tensors)`` of the newest version that loads (``(version, tensors,
        metadata)`` with ``meta``), skipping unreadable ones; ``KeyError`` if none."""
        errors = []
        for version in reversed(self.versions()):
            try:
                got = self.get(version, meta=meta)
                return (version, *got) if meta else (version, got)
            except UnreadableWeightsError as e:
                errors.append(str(e))
        raise KeyError(f"no readable weight version in {self.url}"
                       + (f": {'; '.join(errors)}" if errors else ""))

    def latest(self) -> int:
        """The newest published version, or -1 when nothing was published yet."""
        data = self._read("LATEST")
        return int(data.decode().strip()) if data else -1

    def truncate(self, version: int) -> list[int]:
        """Remove versions newer than ``version`` (a run resumed from a checkpoint);
        returns them."""
        newer = [v for v in self.versions() if v > int(version)]
        for v in newer:
            if self._remove_version(v):
                self._forget(v)
        if self.latest() > int(version):
            self._write("LATEST", str(int(version)).encode())
        return newer

    def gc(self, keep: int = 2, protect: tuple[int, ...] = ()) -> list[int]:
        """Remove versions older than the newest ``keep`` that no reader holds and that
        are not in ``protect`` (a LoRA run's base: its adapters apply to it); returns
        the removed ones (a version being read may survive until the next gc)."""
        present = self.versions()
        protect = set(protect) | (set(present[-keep:]) if keep > 0 else set())
        protect |= set(self.holds().values())
        removed = []
        for v in present:
            if v not in protect and self._remove_version(v):
                self._forget(v)
                removed.append(v)
        return removed


class FsspecWeightStore(WeightStore):
    """Versions as files ``{url}/v{version:08d}.safetensors``; holds as small files in
    ``{url}/holds/``."""

    def __init__(self, url: str):
        self.url = str(url).rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(self.url)

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self._fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self._fs.open(path, "wb") as f:
            f.write(data)

    def _read(self, name: str) -> bytes | None:
        try:
            with self._fs.open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _remove(self, name: str) -> bool:
        try:
            self._fs.rm(self._path(name))
        except FileNotFoundError:
            pass
        return True

    def versions(self) -> list[int]:
        if not self._fs.exists(self._root):
            return []
        names = [p.rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
        return sorted(int(n[1:9]) for n in names if _VERSION.fullmatch(n))  # not buckets

    def holds(self) -> dict[str, int]:
        root = self._path("holds")
        if not self._fs.exists(root):
            return {}
        out = {}
        for p in self._fs.ls(root, detail=False):
            data = self._read(f"holds/{p.rsplit('/', 1)[-1]}")
            if data:
                rec = json.loads(data)
                out[rec["reader"]] = int(rec["version"])
        return out

    def hold(self, reader: str, version: int) -> None:
        self._write(f"holds/{_safe(reader)}",
                    json.dumps({"reader": reader, "version": int(version)}).encode())

    def release(self, reader: str) -> None:
        self._remove(f"holds/{_safe(reader)}")


# header metadata of an adapter version (rollart.trainer.lora): its format, and the
# version whose full weights it applies to (-1: the model folder's)
ADAPTER, BASE = "rollart.adapter", "rollart.base"
# header metadata of a bucketed version's manifest: its buckets' names, as a JSON list
BUCKETS = "rollart.buckets"
_VERSION = re.compile(r"v\d{8}\.safetensors")


def header_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob's header (``{}`` when it has none)."""
    n = int.from_bytes(blob[:8], "little")
    return dict(json.loads(blob[8:8 + n]).get("__metadata__") or {})


def _safe(reader: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in reader)


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): clone repeats."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        ptr = t.data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
