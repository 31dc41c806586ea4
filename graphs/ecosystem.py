"""A multi-task graph over real environment libraries: the template to copy for real models.

Five sources share one policy, each with its own weight and sampling settings:

| task           | source                      | turns | weight | sampling           |
|----------------|-----------------------------|-------|--------|--------------------|
| frozenlake     | gymnasium FrozenLake 3x3    | 6     | 3      | 3 tokens, top_p 1  |
| calc           | sandboxed Python tool       | 3     | 2      | 5 tokens, top_p 1  |
| gem_guess      | GEM GuessTheNumber (easy)   | 4     | 2      | 3 tokens, top_p .95|
| ta_guess       | TextArena GuessTheNumber    | 6     | 1      | 3 tokens, top_p .95|
| rg_arithmetic  | reasoning-gym, 2 attempts   | 2     | 1      | 4 tokens, top_p .9 |

On the local default (the built-in tiny model after a format-only warm-up) the reward
moves on the easy tasks (FrozenLake, the guessing games); the arithmetic tasks need a
real model: set ``Policy(model="path/to/hf-model")``, ``warmup_steps=0`` and raise
``max_new_tokens`` (``dataclasses.replace`` on the tasks). Needs ``rollart[envs]``.
Temperature is policy-wide: the trainer's log-probs must use the sampling temperature.
"""

from rollart import GRPO, Graph, Policy
from rollart.env.adapters import RG_EASY_ARITHMETIC, gem, gym, reasoning_gym, textarena, tool


def tasks() -> tuple:
    return (
        gym.frozenlake_task(size=3, max_turns=6, top_p=1.0),
        tool.calc_tool_task(max_turns=3, top_p=1.0),
        gem.guess_the_number_task(max_turns=4, top_p=0.95),
        textarena.guess_the_number_task(max_turns=6, top_p=0.95),
        reasoning_gym.reasoning_gym_task("basic_arithmetic", name="rg_arithmetic",
                                         config=RG_EASY_ARITHMETIC, max_attempts=2,
                                         max_new_tokens=4, top_p=0.9),
    )


def graph() -> Graph:
    return Graph(
        name="ecosystem",
        tasks=tasks(),
        task_weights=(3.0, 2.0, 2.0, 1.0, 1.0),
        policy=Policy(model=None, warmup_steps=300),
        algo=GRPO(group_size=8, groups_per_step=8, lr=5e-4, kl_coef=0.05),
        steps=120,
    )
