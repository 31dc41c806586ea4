"""Training: group-relative advantages, the clipped GRPO loss, the Trainer actor."""

from rollart.trainer.advantages import compute_advantages
from rollart.trainer.losses import grpo_loss, token_logprobs
from rollart.trainer.trainer import Trainer, collate

__all__ = ["Trainer", "collate", "compute_advantages", "grpo_loss", "token_logprobs"]
