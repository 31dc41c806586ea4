"""An fsspec-backed, versioned store of model weights.

The trainer calls ``put(version, state_dict)`` after each step; inference workers call
``latest()`` and ``get(version)``. Each version is one safetensors blob at
``{url}/v{version:08d}.safetensors``; ``LATEST`` holds the newest complete version and is
written after the blob, so a reader never sees a half-written version. Old versions are
removed by ``gc(keep)``. Any fsspec URL works (a local path, ``file://``, ``memory://``
within one process, object stores).
"""

from __future__ import annotations

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class UnreadableWeightsError(ValueError):
    """A stored weight version exists but cannot be loaded (truncated, corrupted)."""


class WeightStore:
    """Versioned weights under one fsspec URL. Picklable (it holds only the URL)."""

    def __init__(self, url: str):
        self.url = str(url).rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(self.url)

    def __reduce__(self):
        return (WeightStore, (self.url,))

    def _path(self, version: int) -> str:
        return f"{self._root}/v{int(version):08d}.safetensors"

    def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Publish ``state_dict`` as ``version`` (tensors are copied to CPU, contiguous)."""
        self._fs.makedirs(self._root, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        blob = st_save(_untie(tensors))
        with self._fs.open(self._path(version), "wb") as f:
            f.write(blob)
        with self._fs.open(f"{self._root}/LATEST", "w") as f:
            f.write(str(int(version)))

    def get(self, version: int) -> dict[str, torch.Tensor]:
        path = self._path(version)
        if not self._fs.exists(path):
            raise KeyError(f"weight version {version} is not in the store at {self.url}")
        with self._fs.open(path, "rb") as f:
            blob = f.read()
        try:
            return st_load(blob)
        except Exception as e:
            raise UnreadableWeightsError(
                f"weight version {version} at {path} is unreadable ({type(e).__name__}: "
                f"{e}); it was truncated or is not a safetensors file. Delete it so the "
                "previous version is used, or publish the weights again") from None

    def get_newest_readable(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The newest version that loads, skipping unreadable ones; ``KeyError`` if none."""
        errors = []
        for version in reversed(self.versions()):
            try:
                return version, self.get(version)
            except UnreadableWeightsError as e:
                errors.append(str(e))
        raise KeyError(f"no readable weight version in {self.url}"
                       + (f": {'; '.join(errors)}" if errors else ""))

    def latest(self) -> int:
        """The newest published version, or -1 when nothing was published yet."""
        path = f"{self._root}/LATEST"
        if not self._fs.exists(path):
            return -1
        with self._fs.open(path, "r") as f:
            return int(f.read().strip())

    def versions(self) -> list[int]:
        if not self._fs.exists(self._root):
            return []
        names = [p.rsplit("/", 1)[-1] for p in self._fs.ls(self._root, detail=False)]
        return sorted(int(n[1:9]) for n in names if n.startswith("v") and n.endswith(".safetensors"))

    def gc(self, keep: int = 2) -> list[int]:
        """Remove all but the newest ``keep`` versions; returns the removed ones."""
        old = self.versions()[:-keep] if keep > 0 else self.versions()
        for v in old:
            self._fs.rm(self._path(v))
        return old


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): clone repeats."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        ptr = t.data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
