"""The default graph: three built-in multi-turn tasks trained together.

Grid navigation, a guess-the-number game with feedback and a box-pushing puzzle share one
policy (the built-in tiny model after a format-only warm-up). Each task's trajectories
advance on their own; rewards run on the REWARD pool; the trainer may use trajectories at
most ``alpha`` versions old.
"""

from rollart import GRPO, Graph, Policy


def graph() -> Graph:
    return Graph(
        name="multitask",
        tasks=("gridnav", "guess", "boxpush"),
        policy=Policy(model=None),
        # a small KL to the warm-up policy keeps a task from collapsing onto one action
        algo=GRPO(group_size=8, groups_per_step=12, lr=5e-4, kl_coef=0.05),
        steps=120,
    )
