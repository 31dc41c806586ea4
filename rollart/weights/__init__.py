"""Versioned weight store: the trainer publishes, inference workers pull.

Consumes state dicts from ``Trainer``; produces them for ``InferenceWorker``.
"""

from rollart.weights.store import WeightStore

__all__ = ["WeightStore"]
