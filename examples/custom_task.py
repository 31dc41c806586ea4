"""Bring your own task: an env class and a reward function in one file, trained with the
built-in tasks' machinery.

The env below is a countdown: the observation says how many steps remain to the goal and
in which direction (``ladder : goal 2 up . act :``); the agent climbs with ``up``/``down``.
Env and reward are module-level so they pickle to the Dask workers. A graph mixes it with
a built-in task.

    python examples/custom_task.py --steps 40
"""

import argparse
import random
from dataclasses import replace

import rollart
from rollart import Episode, StepResult, Task


class LadderEnv:
    """Reach rung 0 from a random rung in [-3, 3] \\ {0}; four turns."""

    def reset(self, seed: int) -> str:
        self.pos = random.Random(seed).choice([-3, -2, -1, 1, 2, 3])
        self.turn = 0
        return self._text()

    def _text(self) -> str:
        side = "up" if self.pos < 0 else "down"
        return f"ladder : goal {abs(self.pos)} {side} . act :"

    def step(self, action: str) -> StepResult:
        self.turn += 1
        word = (action.split() or [""])[0]
        invalid = word not in ("up", "down")
        if not invalid:
            self.pos += 1 if word == "up" else -1
        success = self.pos == 0
        done = success or self.turn >= 4
        obs = "ladder : success ." if success else self._text()
        return StepResult(("invalid . " if invalid else "") + obs, float(success), done,
                          {"success": success, "invalid": invalid, "truncated": done and
                           not success})

    def close(self) -> None:
        pass


def ladder_reward(episode: Episode) -> float:
    """1 for reaching the goal, minus 0.1 per invalid action.

    >>> ladder_reward(Episode("ladder", 0, [], ["up"], [1.0], {"success": True}))
    1.0
    """
    invalid = sum("invalid" in o.split() for o in episode.observations[1:])
    return float(bool(episode.info.get("success"))) - 0.1 * invalid


def ladder_random_action(rng: random.Random, observation: str) -> str:
    return rng.choice(["up", "down"])


def ladder_vocabulary() -> list[str]:
    return ["ladder", ":", ".", "goal", "up", "down", "act", "success", "invalid",
            "1", "2", "3"]


LADDER = Task(name="ladder", env_factory=LadderEnv, reward_fn=ladder_reward, max_turns=4,
              warmup_action=ladder_random_action, vocabulary=ladder_vocabulary,
              description="climb to the goal rung")


def graph(steps: int = 40) -> rollart.Graph:
    return rollart.Graph(name="ladder-mix", tasks=(LADDER, "boxpush"), steps=steps,
                         algo=rollart.GRPO(group_size=8, groups_per_step=8))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--run-dir", default=None)
    a = p.parse_args()
    g = graph(a.steps)
    if a.warmup_steps is not None:
        g = replace(g, policy=replace(g.policy, warmup_steps=a.warmup_steps))
    result = rollart.train(g, run_dir=a.run_dir, eval_seeds=32)
    print("held-out success:", result.evaluation)
