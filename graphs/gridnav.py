"""A single-task graph: grid navigation only, on the default graph's settings."""

from rollart import GRPO, Graph


def graph() -> Graph:
    return Graph(name="gridnav", tasks=("gridnav",),
                 algo=GRPO(group_size=8, groups_per_step=4), steps=40)
