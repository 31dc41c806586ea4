"""The files of a sharded checkpoint: the ``dcp/`` folder that
``torch.distributed.checkpoint`` (DCP) writes, each rank of a trainer gang its own shard
files and rank 0 the ``.metadata`` that maps every shard of every tensor to its file.

Consumes a checkpoint folder URL (a local path or ``file://``: DCP's
``FileSystemWriter``; another fsspec URL: its ``FsspecWriter``); produces the storage
object ``dcp.save``/``dcp.load`` take (``dcp_storage``), manifest entries of the files
(``hash_files``) and a check that every file the metadata names is there
(``check_dcp``). Used by the trainer ranks (``rollart.trainer.fsdp.GangMember._save_shards``)
and by every trainer that loads such a checkpoint (``TorchBackend.read_dcp``).

Every rank writes into the same folder: the checkpoint URL must be one place every TRAIN
worker reaches (one host, a shared file system or an object store), as it already is for
rank 0 and the driver, which write the rest of the checkpoint.
"""

from __future__ import annotations

import re

import fsspec

from rollart.runtime.storage import digest

DCP_DIR = "dcp"  # the sharded state's folder in a checkpoint
METADATA = ".metadata"  # DCP's map of shards to files, written by the coordinator (rank 0)

__all__ = ["DCP_DIR", "check_dcp", "dcp_storage", "hash_files"]


def _local(path: str) -> str | None:
    fs, root = fsspec.core.url_to_fs(str(path))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return root if "file" in protocols else None


def dcp_storage(path: str, *, write: bool):
    """DCP's writer (``write``) or reader of the folder ``path``: the file system one for a
    local path, the fsspec one for another URL."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    local = _local(path)
    if local is not None:
        return FileSystemWriter(local) if write else FileSystemReader(local)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter(path) if write else FsspecReader(path)


def hash_files(path: str, names: list[str], prefix: str) -> dict:
    """Manifest entries ``{prefix/name: {"size", "sha256"}}`` of the files ``names`` in the
    folder ``path`` (streamed: a shard file is never held in memory)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    return {f"{prefix}/{n}": digest(fs, f"{root.rstrip('/')}/{n}") for n in names}


def check_dcp(path: str) -> None:
    """Raise ``ValueError`` naming what is missing from the DCP folder ``path``: its
    ``.metadata`` (the save did not finish) or a shard file it names (with the rank that
    wrote it: every rank's files must reach the one checkpoint folder)."""
    fs, root = fsspec.core.url_to_fs(str(path))
    root = root.rstrip("/")
    if not fs.exists(f"{root}/{METADATA}"):
        raise ValueError(
            f"the sharded checkpoint {path} has no {METADATA} (rank 0 writes it once every "
            f"rank has written its shards: the save did not finish); resume from an older "
            f"checkpoint (rollart.control.checkpoint.latest skips folders without COMPLETE)")
    meta = dcp_storage(path, write=False).read_metadata()
    names = sorted({info.relative_path for info in meta.storage_data.values()})
    missing = [n for n in names if not fs.exists(f"{root}/{n}")]
    if missing:
        ranks = sorted({m.group(1) for n in missing if (m := re.match(r"__(\d+)_", n))})
        raise ValueError(
            f"the sharded checkpoint {path} is missing {', '.join(missing)}"
            + (f" (written by rank {', '.join(ranks)} of the gang that saved it)" if ranks
               else "")
            + ": every rank writes its shards into the checkpoint folder, so the "
            "checkpoint URL must be one place every TRAIN worker reaches (a shared file "
            "system or an object store); copy the missing files there or resume from "
            "another checkpoint")
