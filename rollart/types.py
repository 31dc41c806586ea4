"""Plain records shared by every stage. Imports nothing else from rollart.

Who makes what:
  * ``GenRequest`` / ``GenResult``: the env manager (through ``LLMProxy``) asks an
    ``InferenceWorker`` for one turn of text; the engine answers with token ids,
    behaviour log-probs and the policy version that produced each token.
  * ``ScoreRequest`` / ``ScoreResult``: the env manager asks a worker to re-score a stale
    member's generated tokens under the weights it holds now (``rollart.env.rescore``).
  * ``StepResult``: what an environment's ``step`` returns.
  * ``Episode``: what a reward function sees (text only, no tensors, so rewards can run
    anywhere, including behind HTTP later).
  * ``Trajectory``: one finished rollout, the row the ``SampleBuffer`` stores.

Resource tags name the hardware roles; every placement in rollart uses these constants.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# -- resource tags (Dask worker resources) -------------------------------------------
H800 = "H800"  #: compute-optimized inference GPUs (prefill-heavy work)
H20 = "H20"  #: bandwidth-optimized inference GPUs (decode-heavy work)
CPU_ENV = "CPU_ENV"  #: CPU pool that hosts environments (EnvManager actors)
REWARD = "REWARD"  #: pool that runs reward functions
TRAIN = "TRAIN"  #: the trainer
BUFFER = "BUFFER"  #: the data of record (SampleBuffer: ledger, samples), off the env pool
INFERENCE_TAGS = (H800, H20)
ALL_TAGS = (H800, H20, CPU_ENV, REWARD, TRAIN, BUFFER)

#: held-out seeds start here: training draws seeds < 1e6, the warm-up 1e6..2e6
EVAL_SEED_BASE = 2_000_000

#: off-policy corrections of the policy loss (see ``rollart.trainer.losses``: why the default)
OFF_POLICY = ("decoupled", "tis", "ppo")
DEFAULT_OFF_POLICY = "ppo"
#: what becomes of a complete group that went too stale waiting for its take (async):
#: dropped, kept with its old tokens re-scored by the trainer, or kept with their
#: behaviour log-probs under the PPO clip, as areal trains them (``GRPO.stale_groups``)
STALE_GROUPS = ("drop", "rescore", "clip")
#: how GRPO scales a group's centred rewards (``rollart.trainer.advantages``)
SCALE_REWARDS = ("group", "batch", "none")


class TrajState(str, enum.Enum):
    """Lifecycle of a trajectory; every launched one ends in exactly one final state."""

    GENERATING = "generating"
    IN_ENV = "in_env"
    SCORING = "scoring"
    BUFFERED = "buffered"
    TAKEN = "taken"  # handed to the trainer; its update is not published yet
    TRAINED = "trained"  # in an update the trainer published
    DROPPED = "dropped"  # too stale when the trainer looked at it
    ABORTED = "aborted"  # stopped because it could no longer meet the staleness bound
    CANCELLED = "cancelled"  # redundant extra, not needed
    FAILED = "failed"  # env or reward raised / returned garbage
    LOST_IN_STEP = "lost_in_step"  # taken by a step that was neither published nor re-run


FINAL_STATES = (
    TrajState.TRAINED,
    TrajState.DROPPED,
    TrajState.ABORTED,
    TrajState.CANCELLED,
    TrajState.FAILED,
    TrajState.LOST_IN_STEP,
)


@dataclass
class GenRequest:
    """One generation call: continue ``prompt_ids`` with at most ``max_new_tokens``."""

    prompt_ids: list[int]
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    request_id: str | None = None  # lets a caller that went away abort it (``abort``)
    cache_key: str | None = None  # e.g. the trajectory id: its KV may be kept for reuse
    # generation also stops once its decoded text contains one of these (the tokens
    # that completed it are kept; finish_reason "stop")
    stop_strings: tuple[str, ...] = ()


@dataclass
class GenResult:
    """Generated ``token_ids`` (stop token included when it was produced)."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token under temperature-scaled logits
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" | "length" | "abort" (its caller aborted it)
    worker: str = ""  # address of the worker that generated it


@dataclass
class ScoreRequest:
    """Re-score tokens already generated (no sampling): the log-prob of
    ``token_ids[i]`` given ``token_ids[:i]`` for each ``i`` in ``positions`` (each ≥ 1),
    under temperature-scaled logits as ``GenResult.logprobs``; ``min_version``: the
    caller wants weights at least this new (the worker waits briefly for them)."""

    token_ids: list[int]
    positions: list[int]
    temperature: float = 1.0
    min_version: int | None = None


@dataclass
class ScoreResult:
    """``ScoreRequest``'s answer: one log-prob per position, all under ``version``."""

    logprobs: list[float]
    version: int
    worker: str = ""


@dataclass
class StepResult:
    """What ``Env.step`` returns."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """The text-level record of a finished rollout, the input of reward functions."""

    task: str
    seed: int
    observations: list[str]
    actions: list[str]
    env_rewards: list[float]
    info: dict[str, Any]  # the last step's info (e.g. {"success": True})
    truncated: bool = False


@dataclass
class Trajectory:
    """One rollout as token ids, ready for training. Schema: ``rollart.buffer.schema``."""

    traj_id: str
    task: str
    group_id: str
    seed: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1 where the policy generated the token
    logprobs: list[float]  # behaviour log-probs (0.0 where loss_mask == 0)
    versions: list[int]  # policy version per response token (-1 where loss_mask == 0)
    reward: float = 0.0
    num_turns: int = 0
    env_time: float = 0.0
    gen_time: float = 0.0
    outcome: str = ""  # "success" | "failure" | "truncated" | "failed"
    error: str = ""
    state: str = TrajState.GENERATING.value
    # tool calls the policy made / how many of them were invalid; None when it was
    # offered no tools (its env declares none, or the raw format)
    tool_calls: int | None = None
    invalid_tool_calls: int | None = None

    @property
    def version(self) -> int:
        """The oldest policy version among generated tokens (-1 if none)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else -1
