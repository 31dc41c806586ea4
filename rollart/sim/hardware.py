"""The simulator's hardware and models: GPU types and the models it serves, as data.

Consumes nothing; produces ``GPUSpec`` (dense BF16 FLOP/s, HBM bandwidth and memory of a
GPU type: datasheet figures, ``rollart.sim.costs``' docstring names them) and
``ModelSpec`` (parameters, layers, KV bytes per token), with the tables ``GPUS`` and
``MODELS``, and the checks every cost record uses (``_positive``, ``_fraction``). Used by
``rollart.sim.costs`` (re-exported there), ``rollart.sim.measure`` and ``rollart.sim.paper``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

def _positive(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                or not math.isfinite(v):
            raise ValueError(f"{type(obj).__name__}.{name} must be a finite number > 0, "
                             f"got {v!r}")


def _fraction(obj, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"{type(obj).__name__}.{name} must be in [0, 1], got {v!r}")


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type: peak dense BF16 FLOP/s, HBM bytes/s and memory bytes."""

    name: str
    flops: float  # peak dense FLOP/s at the training/serving dtype
    hbm_bytes_s: float  # memory bandwidth, bytes/s
    mem_bytes: float  # device memory, bytes

    def __post_init__(self):
        _positive(self, "flops", "hbm_bytes_s", "mem_bytes")


GPUS: dict[str, GPUSpec] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s, 80 GB HBM3
    "H100": GPUSpec("H100", 989e12, 3.35e12, 80e9),
    # H800 SXM: H100 SXM compute and HBM, reduced NVLink (400 GB/s)
    "H800": GPUSpec("H800", 989e12, 3.35e12, 80e9),
    # NVIDIA H20 product brief: 148 TFLOP/s dense BF16, 4.0 TB/s, 96 GB HBM3
    "H20": GPUSpec("H20", 148e12, 4.0e12, 96e9),
    # this machine's CPU as the torch engine sees it: replaced by calibrate.measure_engine
    # (an effective rate for the tiny model, Python overhead included, not a peak)
    "cpu": GPUSpec("cpu", 5e9, 5e9, 8e9),
}


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder's shape: what the roofline needs.

    ``q_heads`` (0: ``hidden // head_dim``) sets the attention width where it differs
    from ``hidden`` (Qwen3-32B: 64 heads × 128 = 8192 over a 5120 hidden).
    """

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # BF16 weights and KV
    q_heads: int = 0

    def __post_init__(self):
        _positive(self, "params", "layers", "hidden", "kv_heads", "head_dim",
                  "bytes_per_param")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer: 2 · layers · kv_heads · head_dim · bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attn_width(self) -> int:
        return (self.q_heads or self.hidden // self.head_dim) * self.head_dim


MODELS: dict[str, ModelSpec] = {
    # Qwen3 model cards / config.json (params incl. embeddings)
    "Qwen3-8B": ModelSpec("Qwen3-8B", 8.2e9, 36, 4096, 8, 128, q_heads=32),
    "Qwen3-14B": ModelSpec("Qwen3-14B", 14.8e9, 40, 5120, 8, 128, q_heads=40),
    "Qwen3-32B": ModelSpec("Qwen3-32B", 32.8e9, 64, 5120, 8, 128, q_heads=64),
    # rollart.model.build_tiny_model defaults: Qwen2, hidden 128, 2 layers, 4 heads
    # (kv = q heads, head_dim 32), fp32 on CPU; params counted for a ~300-word vocab
    "tiny": ModelSpec("tiny", 0.43e6, 2, 128, 4, 32, bytes_per_param=4.0, q_heads=4),
}


