"""A run's durable folders through fsspec: files written with their digest, the
checkpoint layout's step folders and the marker that says one is complete.

Consumes folder URLs (a local path, ``file://``, ``memory://``, object stores); produces
manifest entries (``{name: {"size", "sha256"}}``) and the list of complete step folders.
Used by the actors that write their part of a checkpoint (the trainer, the sample
buffer), by ``rollart.control.checkpoint`` (which owns the checkpoint format) and by
``rollart.config.preflight`` (a checkpoint URL that holds another run's steps).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import fsspec

STEP_PREFIX = "step-"
MARKER = "COMPLETE"


def step_dir(url: str, step: int) -> str:
    return f"{str(url).rstrip('/')}/{STEP_PREFIX}{int(step):08d}"


def digest(fs, path: str) -> dict:
    """``{"size", "sha256"}`` of one file on ``fs``."""
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def write_bytes(url: str, name: str, data: bytes) -> dict:
    """Write ``data`` to ``{url}/{name}``; returns its manifest entry."""
    fs, root = fsspec.core.url_to_fs(str(url))
    fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/{name}"
    with fs.open(path, "wb") as f:
        f.write(data)
    return {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def upload_dir(local: str, url: str, name: str) -> dict:
    """Copy the files of a local folder to ``{url}/{name}/``; returns manifest entries."""
    fs, root = fsspec.core.url_to_fs(str(url))
    out = {}
    for base, _, files in os.walk(local):
        for fname in sorted(files):
            src = os.path.join(base, fname)
            rel = os.path.relpath(src, local).replace(os.sep, "/")
            dst = f"{root.rstrip('/')}/{name}/{rel}"
            fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
            with open(src, "rb") as f:
                data = f.read()
            with fs.open(dst, "wb") as f:
                f.write(data)
            out[f"{name}/{rel}"] = {"size": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()}
    return out


def local_dir(url: str) -> str:
    """A local path for a folder URL: itself when local, else a downloaded copy."""
    fs, root = fsspec.core.url_to_fs(str(url))
    if "file" in _protocols(fs):
        return root
    tmp = tempfile.mkdtemp(prefix="rollart-ckpt-")
    fs.get(root.rstrip("/") + "/", tmp, recursive=True)
    return tmp


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def steps(url: str) -> list[int]:
    """Steps with a complete checkpoint under ``url``, oldest first."""
    fs, root = fsspec.core.url_to_fs(str(url))
    if not fs.exists(root):
        return []
    out = []
    for p in fs.ls(root, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit() and \
                fs.exists(f"{p.rstrip('/')}/{MARKER}"):
            out.append(int(name[len(STEP_PREFIX):]))
    return sorted(out)
