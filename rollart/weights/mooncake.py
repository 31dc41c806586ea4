"""The Mooncake backend of the weight store, and a local ``mooncake_master`` for it.

``MooncakeMaster`` (driver side) starts ``mooncake_master`` with its HTTP metadata server
on 127.0.0.1 and free ports, waits until both answer, and stops it on exit; a port taken
between picking and binding is retried on fresh ports. ``master.url(prefix)`` is the
store URL ``mooncake://127.0.0.1:RPC/PREFIX?metadata=http://127.0.0.1:HTTP/metadata``.
On a cluster, pass the URL of a master that already runs instead (``--weights URL``).

``MooncakeWeightStore(url)`` (any process) is a ``WeightStore`` whose objects live in
the Mooncake distributed store. The publisher (trainer) mounts a memory segment that
holds the versions; readers (inference workers) mount none and pull over the transfer
engine (``tcp`` on these machines; RDMA where available). Mooncake has no listing, so
the publisher keeps the list of versions in an ``INDEX`` object, and readers claim a
slot ``readers/{i}`` (Mooncake's ``put`` never overwrites, so the first claim wins)
whose ``holds/{i}`` object names the version they fetch. A version being read is leased
by Mooncake and cannot be removed until the read ends; ``gc`` retries it later. Readers
write their claims and holds into the publisher's segment, which ``HOME`` names: placed
anywhere, one could land in another reader's relay segment and vanish when that reader
exits, taking the lease on a version being read with it.

Relay (``relay_mb=N`` in the URL; off by default): each reading process mounts an N MiB
segment of its own and serves the buckets it has read to the other readers of that
version, so the publisher's segment serves about one copy per version however many
workers pull (``rollart.weights.relay``; ``relay_wait``, ``relay_timeout``: seconds).

Requires the extra ``pip install 'rollart[mooncake]'`` (``mooncake-transfer-engine-non-cuda``
on CPU machines) and the system library ``libibverbs1``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from urllib.parse import parse_qs, urlencode, urlparse

from rollart.runtime.waits import stop_process
from rollart.weights.relay import (DEFAULT_TIMEOUT_S, DEFAULT_WAIT_S, Relay,
                                  extra_names, pinned_here, placed_in, striped)
from rollart.weights.store import WeightStore

logger = logging.getLogger(__name__)

MAX_READERS = 64
DEFAULT_SEGMENT_MB = 512  # publisher: memory that holds the live versions
DEFAULT_BUFFER_MB = 256  # per client: staging buffer, must exceed one version's blob
INSTALL_HINT = ("install the Mooncake extra (pip install 'rollart[mooncake]', i.e. "
                "mooncake-transfer-engine-non-cuda on CPU machines) and the system "
                "library libibverbs1 (apt-get install libibverbs1)")


class MooncakeError(RuntimeError):
    """Mooncake could not be started or reached; the message says what to change."""


def import_store():
    """The ``MooncakeDistributedStore`` class, or a ``MooncakeError`` saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeError(f"the Mooncake weight store needs the mooncake package "
                            f"({e}); {INSTALL_HINT}") from None
    return MooncakeDistributedStore


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """A ``mooncake_master`` process with an HTTP metadata server, on loopback.

    >>> # with MooncakeMaster() as master:
    >>> #     store = WeightStore(master.url("run-1"))
    """

    def __init__(self, host: str = "127.0.0.1", *, lease_ms: int = 10_000,
                 start_timeout: float = 30.0, retries: int = 3, binary: str | None = None):
        self.host, self.lease_ms = host, int(lease_ms)
        self.start_timeout, self.retries = start_timeout, retries
        self.binary = binary or shutil.which("mooncake_master")
        self.proc: subprocess.Popen | None = None
        self.rpc_port = self.http_port = None
        self.log_path = None

    def url(self, prefix: str = "rollart", **options) -> str:
        """The store URL for objects under ``prefix`` (options: segment_mb, buffer_mb)."""
        if self.proc is None:
            raise MooncakeError("the Mooncake master is not running; call start() first")
        query = urlencode({"metadata": f"http://{self.host}:{self.http_port}/metadata",
                           **options})
        return f"mooncake://{self.host}:{self.rpc_port}/{prefix}?{query}"

    def start(self) -> MooncakeMaster:
        if self.binary is None or shutil.which(self.binary) is None:
            raise MooncakeError(f"no mooncake_master executable "
                                f"({self.binary or 'not on PATH'}); {INSTALL_HINT}")
        errors = []
        for _ in range(self.retries):
            rpc, http, metrics = _free_port(self.host), _free_port(self.host), _free_port(
                self.host)
            busy = [p for p in (rpc, http, metrics) if _listening(self.host, p)]
            if busy or len({rpc, http, metrics}) < 3:  # taken since picked: pick again
                errors.append(f"port in use: {busy or [rpc, http, metrics]}")
                continue
            log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log",
                                              delete=False)
            cmd = [self.binary, f"--rpc_address={self.host}", f"--rpc_port={rpc}",
                   "--enable_http_metadata_server=true",
                   f"--http_metadata_server_host={self.host}",
                   f"--http_metadata_server_port={http}", f"--metrics_host={self.host}",
                   f"--metrics_port={metrics}", "--enable_metric_reporting=false",
                   f"--default_kv_lease_ttl={self.lease_ms}"]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if _listening(self.host, rpc) and _listening(self.host, http) and \
                        _alive_after(proc, 0.3):
                    self.proc, self.rpc_port, self.http_port = proc, rpc, http
                    self.log_path = log.name
                    return self
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                errors.append(f"not listening on {self.host}:{rpc}/{http} within "
                              f"{self.start_timeout}s")
            else:  # exited: most often a port taken between picking and binding
                errors.append(f"exited with status {proc.returncode}: "
                              f"{_tail(log.name)}")
        raise MooncakeError(f"could not start mooncake_master ({self.binary}) after "
                            f"{self.retries} tries: " + " | ".join(errors))

    def stop(self) -> None:
        """Close this process's clients of this master (their teardown needs it alive:
        against a stopped master it hangs 8-17 s at exit), then stop it."""
        if self.rpc_port is not None:
            close_clients(f"{self.host}:{self.rpc_port}")
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive_after(proc: subprocess.Popen, seconds: float) -> bool:
    """Still running a moment after its ports answered (a master that lost a port race
    answers through the other owner's socket, then exits)."""
    time.sleep(seconds)
    return proc.poll() is None


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if " E" in ln[:30] or "rror" in ln]
        return " / ".join(lines)[-n:] or "(no error lines in its log)"
    except OSError:
        return "(no log)"


# -- clients: one publisher and one reader per process and master ----------------------
_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _client(master: str, metadata: str, kind: str, segment_mb: int, buffer_mb: int):
    """This process's client of ``kind``: ``"publisher"`` (mounts ``segment_mb``: holds
    the versions), ``"relay"`` (mounts ``segment_mb``: holds replicas) or ``"reader"``."""
    key = (master, metadata, kind)
    with _clients_lock:
        if key in _clients:
            return _clients[key]
        meta = urlparse(metadata)
        for what, host, port in (("master", *master.rsplit(":", 1)),
                                 ("metadata server", meta.hostname, meta.port)):
            if not host or not port or not _listening(host, int(port), timeout=3.0):
                raise MooncakeError(f"the Mooncake {what} at {host}:{port} does not accept "
                                    "connections: start it (rollart starts its own with "
                                    "--weights mooncake) or fix the store URL")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", master.rsplit(":", 1)[0])
        store = import_store()()
        rc = store.setup(master.rsplit(":", 1)[0], metadata,
                         (segment_mb << 20) if kind != "reader" else 0, buffer_mb << 20,
                         "tcp", "",
                         master)
        if rc != 0:
            raise MooncakeError(f"could not connect to the Mooncake master at {master} "
                                f"(metadata {metadata}): setup returned {rc}. Is the master "
                                "running and reachable?")
        _clients[key] = store
        return store


def close_clients(master: str) -> int:
    """Close and forget this process's clients of ``master`` (``HOST:PORT``); returns how
    many. A later store on that address connects afresh."""
    with _clients_lock:
        keys = [k for k in _clients if k[0] == master]
        stores = [_clients.pop(k) for k in keys]
    for store in stores:
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - closing is best effort; say so
            logger.warning("closing a Mooncake client of %s failed: %r", master, e)
    return len(stores)


class MooncakeWeightStore(WeightStore):
    """Versioned weights in a Mooncake distributed store (see the module docstring)."""

    def __init__(self, url: str):
        self.url = str(url)
        u = urlparse(self.url)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        if u.scheme != "mooncake" or not u.hostname or not u.port or "metadata" not in q:
            raise MooncakeError(f"bad Mooncake store URL {url!r}: expected "
                                "mooncake://HOST:PORT/PREFIX?metadata=http://HOST:PORT/metadata")
        self.master = f"{u.hostname}:{u.port}"
        self.metadata = q["metadata"]
        self.prefix = u.path.strip("/") or "rollart"
        try:
            self.segment_mb = int(q.get("segment_mb", DEFAULT_SEGMENT_MB))
            self.buffer_mb = int(q.get("buffer_mb", DEFAULT_BUFFER_MB))
            self.relay_mb = int(q.get("relay_mb", 0))
            self.relay_wait = float(q.get("relay_wait", DEFAULT_WAIT_S))
            self.relay_timeout = float(q.get("relay_timeout", DEFAULT_TIMEOUT_S))
        except ValueError as e:
            raise MooncakeError(f"bad option in the Mooncake store URL {url!r} ({e}): "
                                "segment_mb, buffer_mb, relay_mb are integers (MiB), "
                                "relay_wait, relay_timeout numbers (s)") from None
        if self.relay_mb < 0 or self.relay_wait < 0 or self.relay_timeout <= 0:
            raise MooncakeError(f"bad relay option in {url!r}: relay_mb >= 0 (0: off), "
                                "relay_wait >= 0 and relay_timeout > 0 seconds")
        self._slots: dict[str, int] = {}  # reader -> claimed slot (this process)
        self._versions: list[int] | None = None  # the publisher's copy of INDEX
        self._home: str | None = None  # the publisher's segment, as HOME names it

    def __getstate__(self):  # (pickled as the URL by WeightStore.__reduce__)
        return {"url": self.url}

    def _publisher(self):
        """This process's publisher client of the store, if it publishes here."""
        return _clients.get((self.master, self.metadata, "publisher"))

    def _store(self, publisher: bool = False):
        here = self._publisher()
        if not publisher and here is not None:  # a publisher process reads through it too
            return here
        if publisher:
            return _client(self.master, self.metadata, "publisher", self.segment_mb,
                           self.buffer_mb)
        if self.relay_mb:  # a relaying reader reads through its segment's client
            return _client(self.master, self.metadata, "relay", self.relay_mb,
                           self.buffer_mb)
        return _client(self.master, self.metadata, "reader", 0, self.buffer_mb)

    @property
    def relay(self) -> Relay | None:
        """This process's relay (``relay_mb`` in the URL), or ``None``: off, or this
        process publishes (its reads are the origin's own)."""
        if not self.relay_mb or self._publisher() is not None:
            return None
        if self.__dict__.get("_relay") is None:
            self._relay = Relay(self, self._store(), max_readers=MAX_READERS,
                                      wait_s=self.relay_wait, timeout_s=self.relay_timeout)
        return self._relay

    def _read_bucket(self, version: int, name: str, reader: str | None) -> bytes | None:
        if reader is None or self.relay is None:
            return super()._read_bucket(version, name, reader)
        return self.relay.read(version, name, self._slot(reader))

    def _bucket_order(self, names: list[str], reader: str | None) -> list[str]:
        if reader is None or self.relay is None:
            return list(names)
        return striped(names, self._slot(reader))

    def _remove_extras(self, name: str) -> bool:
        """Remove the relay's replicas and claim of bucket ``name`` (``False`` while one
        is being read: Mooncake leases it; the next ``gc`` retries)."""
        keys = [self._key(n) for n in extra_names(name, MAX_READERS)]
        return all(rc in (0, -704) for rc in self._store().batch_remove(keys))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # -- primitives ---------------------------------------------------------------------
    def _write(self, name: str, data: bytes) -> None:
        if len(data) > self.buffer_mb << 20:
            raise MooncakeError(f"a {len(data) >> 20} MiB object exceeds the client buffer "
                                f"of {self.buffer_mb} MiB: add buffer_mb=N to the store URL")
        store = self._store(publisher=True)
        # in the publisher's own segment: unpinned, Mooncake places an object in any
        # mounted segment, a reader's relay segment included (gone when that reader
        # exits), or one of a reader killed less than the master's client TTL (~10 s)
        # ago, still listed: the write to it fails (-800, connection refused)
        rc = store.upsert(self._key(name), data, pinned_here(store))
        if rc != 0:
            raise MooncakeError(f"Mooncake upsert of {self._key(name)} ({len(data)} bytes) "
                                f"failed with status {rc} (segment full? raise segment_mb "
                                "in the store URL)")

    def _read(self, name: str) -> bytes | None:
        store = self._store()
        key = self._key(name)
        size = store.get_size(key)
        if size < 0:
            return None
        if size > self.buffer_mb << 20:
            raise MooncakeError(f"{key} is {size >> 20} MiB, more than the client buffer "
                                f"of {self.buffer_mb} MiB: add buffer_mb=N to the store URL")
        for _ in range(20):  # an object being replaced (upsert) can read empty briefly
            data = store.get(key)
            if data or size == 0:
                return bytes(data)
            if store.is_exist(key) != 1:
                return None  # removed between the size query and the read
            time.sleep(0.02)
        return None

    def _remove(self, name: str) -> bool:
        # 0: removed; -704: not there (any more); -706: leased by a reader, retry later
        return self._store().remove(self._key(name)) in (0, -704)

    # -- versions: an index object (one publisher writes it and keeps a copy) -----------
    # (not probed with is_exist: Mooncake leases what it is asked about, which would
    # block the removal that follows)
    def _index(self) -> list[int]:
        if self._versions is None:
            data = self._read("INDEX")
            return json.loads(data) if data else []
        return self._versions

    def versions(self) -> list[int]:
        return sorted(self._index())

    def _remember(self, version: int) -> None:
        self._versions = sorted(set(self._index()) | {version})
        self._write("INDEX", json.dumps(self._versions).encode())
        home = self._store(publisher=True).get_hostname()
        if self._home != home:  # once per publisher client (a restarted trainer's anew)
            self._write("HOME", home.encode())
            self._home = home

    def _forget(self, version: int) -> None:
        self._versions = [v for v in self._index() if v != version]
        self._write("INDEX", json.dumps(self._versions).encode())

    # -- holds: reader slots, in the publisher's segment ----------------------------------
    def _home_config(self, refresh: bool = False):
        """Where this process's claims and holds go: the publisher's segment (``HOME``;
        before anything was published, where Mooncake places them)."""
        here = self._publisher()
        if here is not None:  # this process publishes: its own segment
            return pinned_here(here)
        if refresh or self._home is None:
            data = self._read("HOME")
            self._home = data.decode() if data else None
        return placed_in(self._home)

    def _book(self, name: str, data: bytes) -> None:
        """Upsert a reader's bookkeeping object ``name`` in the publisher's segment; an
        upsert refused (a publisher restarted on another segment) re-reads ``HOME`` once."""
        store, key = self._store(), self._key(name)
        for refresh in (False, True):
            rc = store.upsert(key, data, self._home_config(refresh))
            if rc == 0:
                return
        raise MooncakeError(f"Mooncake upsert of {key} failed with status {rc}: a reader's "
                            "hold that is not recorded lets gc remove the version it reads "
                            f"(is the publisher's segment {self._home!r} full or gone?)")

    def _slot(self, reader: str) -> int:
        if reader in self._slots:
            return self._slots[reader]
        store = self._store()
        me = f"{reader}/{uuid.uuid4().hex}".encode()
        config = self._home_config()
        for i in range(MAX_READERS):
            key = self._key(f"readers/{i}")
            if store.is_exist(key) == 1:
                continue
            store.put(key, me, config)  # never overwrites: the first claim of a slot wins
            if bytes(store.get(key)) == me:
                self._slots[reader] = i
                return i
        raise MooncakeError(f"more than {MAX_READERS} readers of {self.url}")

    def hold(self, reader: str, version: int) -> None:
        self._book(f"holds/{self._slot(reader)}",
                   json.dumps({"reader": reader, "version": int(version)}).encode())

    def release(self, reader: str) -> None:
        if reader in self._slots:
            self._book(f"holds/{self._slots[reader]}",
                       json.dumps({"reader": reader, "version": None}).encode())

    def holds(self) -> dict[str, int]:
        store = self._store()
        keys = [self._key(f"holds/{i}") for i in range(MAX_READERS)]
        out = {}
        for key, present in zip(keys, store.batch_is_exist(keys)):
            if present == 1:
                data = store.get(key)
                rec = json.loads(bytes(data)) if data else {}
                if rec.get("version") is not None:
                    out[rec["reader"]] = int(rec["version"])
        return out
