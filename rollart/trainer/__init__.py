"""Training: group-relative advantages, the clipped GRPO loss, the Trainer actor."""

from rollart.trainer.advantages import compute_advantages
from rollart.trainer.losses import grpo_loss, token_logprobs
from rollart.trainer.trainer import Trainer, collate

__all__ = ["Trainer", "collate", "compute_advantages", "grpo_loss", "token_logprobs",
           "trainer_class"]


def trainer_class(backend: str = "torch") -> type:
    """The trainer actor class of a ``Policy.trainer_backend`` ("torch" | "megatron")."""
    if backend == "megatron":
        from rollart.trainer.megatron import MegatronTrainer

        return MegatronTrainer
    if backend != "torch":
        raise ValueError(f"unknown trainer backend {backend!r}: use 'torch' or 'megatron'")
    return Trainer
