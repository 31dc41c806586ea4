"""The trainer's parts of ``Policy``: ``LoRA`` (train low-rank adapters instead of every
weight) and ``TrainerParallel`` (how a trainer gang's ranks are laid out). Plain frozen
dataclasses validated in ``__post_init__``, as the rest of ``rollart.config.graph``
(which re-exports both); nothing here touches Dask or torch."""

from __future__ import annotations

from dataclasses import dataclass

from rollart.config.checks import check as _check
from rollart.config.checks import check_numbers as _numbers


@dataclass(frozen=True)
class LoRA:
    """Train low-rank adapters instead of every weight (``Policy.lora``; peft's LoRA).

    Only the adapters train and hold optimizer state; each weight version publishes only
    the adapter (``rollart.trainer.lora``); the KL reference is the base model with the
    adapter off. ``target_modules="auto"`` adapts every linear layer but the output head
    (peft's ``"all-linear"``: the attention and MLP projections of Qwen2, Llama, ...);
    a tuple names module-name suffixes (``("q_proj", "v_proj")``), each of which must
    match a linear layer of the model. ``alpha=None``: twice the rank.

    >>> LoRA(rank=16).scaling
    2.0
    """

    rank: int = 16  # the adapters' rank r
    alpha: float | None = None  # LoRA alpha (the scale is alpha / rank); None: twice the rank
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1)
    target_modules: str | tuple[str, ...] = "auto"  # "auto": every linear layer but the head
    rslora: bool = False  # scaling alpha / sqrt(rank) instead of alpha / rank

    def __post_init__(self):
        _check(isinstance(self.rank, int) and not isinstance(self.rank, bool)
               and self.rank >= 1, f"LoRA.rank must be an int ≥ 1, got {self.rank!r} "
               "(for full fine-tuning set Policy.lora=None: --set policy.lora=none)")
        _numbers(self, "alpha", optional=True)
        _numbers(self, "dropout")
        _check(self.alpha is None or self.alpha > 0,
               f"LoRA.alpha must be > 0 or None (twice the rank), got {self.alpha!r}")
        _check(0 <= self.dropout < 1, f"LoRA.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, str) and targets != "auto":  # "q_proj,v_proj"
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if isinstance(targets, list):
            targets = tuple(targets)
        object.__setattr__(self, "target_modules", targets)
        _check(targets == "auto" or (isinstance(targets, tuple) and targets and all(
            isinstance(t, str) and t for t in targets)),
               f"LoRA.target_modules must be 'auto' or a tuple of module names such as "
               f"('q_proj', 'v_proj'), got {targets!r}")
        _check(isinstance(self.rslora, bool), f"LoRA.rslora must be True or False, "
               f"got {self.rslora!r}")

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or twice the rank when unset."""
        return float(2 * self.rank if self.alpha is None else self.alpha)

    @property
    def scaling(self) -> float:
        """The factor on the adapter's product ``B @ A``."""
        return self.lora_alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def peft_options(self) -> dict:
        """The engines' ``lora`` option and the keyword arguments of peft's ``LoraConfig``."""
        targets = "all-linear" if self.target_modules == "auto" else list(self.target_modules)
        return {"r": self.rank, "lora_alpha": self.lora_alpha,
                "lora_dropout": float(self.dropout), "target_modules": targets,
                "use_rslora": self.rslora}


@dataclass(frozen=True)
class TrainerParallel:
    """How the N ranks of a trainer gang (``Pool(tag=TRAIN, workers=N)``) are laid out
    (``Policy.trainer_parallel``): ``tp`` ranks share each weight matrix (tensor
    parallel, the Megatron backend's), ``dp`` such groups each train their share of a
    batch (data parallel); ``tp × dp`` must be N (checked against the TRAIN workers at
    start: ``layout``). The torch backend is data parallel only (FSDP2 over all N ranks,
    ``tp=1``). One TRAIN worker is one process whatever the layout says (``tp=1``).

    >>> TrainerParallel(tp=2).layout(4, "megatron")
    (2, 2)
    """

    tp: int = 1  # tensor-parallel size: ranks sharing each weight matrix (Megatron only)
    dp: int | None = None  # data-parallel size (None: the TRAIN workers over tp)

    def __post_init__(self):
        _check(isinstance(self.tp, int) and not isinstance(self.tp, bool) and self.tp >= 1,
               f"TrainerParallel.tp must be an int ≥ 1, got {self.tp!r}")
        _check(self.dp is None or (isinstance(self.dp, int) and not isinstance(self.dp, bool)
                                   and self.dp >= 1),
               f"TrainerParallel.dp must be an int ≥ 1 or None (the TRAIN workers over "
               f"tp), got {self.dp!r}")

    def check_backend(self, backend: str) -> None:
        """Tensor parallelism is the Megatron backend's: ``tp > 1`` on another backend is a
        ``GraphError`` that says what to change."""
        _check(self.tp == 1 or backend == "megatron",
               f"Policy.trainer_parallel.tp={self.tp} with trainer_backend={backend!r}: "
               f"the torch backend has no tensor parallelism (FSDP2 data parallel over "
               f"every TRAIN worker); set trainer_backend='megatron', or tp=1 "
               f"(--set policy.trainer_parallel.tp=1)")

    def layout(self, ranks: int, backend: str = "torch") -> tuple[int, int]:
        """``(tp, dp)`` for a gang of ``ranks`` TRAIN workers on ``backend``; a layout
        that does not multiply to ``ranks`` is a ``GraphError`` naming both numbers and
        the fix."""
        self.check_backend(backend)
        dp = self.dp if self.dp is not None else max(ranks // self.tp, 1)
        _check(self.tp * dp == ranks,
               f"Policy.trainer_parallel tp={self.tp} x dp={dp} = {self.tp * dp} ranks, but "
               f"the trainer has {ranks} TRAIN worker(s): make tp x dp = {ranks} (e.g. "
               f"--set policy.trainer_parallel.tp=... and leave dp unset), or give the "
               f"TRAIN pool {self.tp * dp} workers (Pool(tag='TRAIN', workers="
               f"{self.tp * dp}))")
        return self.tp, dp
