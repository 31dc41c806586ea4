"""Scripted policies (rollart.env.scripted) and benchmarks/baselines.py: the optimal
player wins every held-out seed where the game is solvable within its turn limit, a
random valid action loses more often than the fixed heuristic, the heuristic no more
than the optimal player, on the held-out seeds the evaluation uses."""

import subprocess
import sys
from pathlib import Path

import pytest

from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.scripted import (
    POLICIES,
    Optimal,
    baselines,
    heldout_seeds,
    make_policy,
    play,
    shortest_plan,
    success_rate,
    task_for,
)

ROOT = Path(__file__).resolve().parents[2]
GAMES = ("gridnav", "guess", "boxpush")


def test_heldout_seeds_are_the_evaluations():
    from rollart.types import EVAL_SEED_BASE

    assert list(heldout_seeds(3)) == [EVAL_SEED_BASE, EVAL_SEED_BASE + 1, EVAL_SEED_BASE + 2]


@pytest.mark.parametrize("name", GAMES + ("calc",))
def test_optimal_wins_every_heldout_seed(name):
    task = task_for(name)
    n = 48 if name == "calc" else 300  # calc runs the sandboxed tool: a process per call
    assert success_rate(task, make_policy("optimal", task), heldout_seeds(n)) == 1.0


def test_gridnav_plan_is_the_manhattan_distance():
    """BFS over env copies finds the shortest walk: its length is the distance."""
    for seed in heldout_seeds(40):
        env = GridNavEnv()
        env.reset(seed)
        (x, y), (gx, gy) = env._pos, env._goal
        plan = shortest_plan(env, env.actions, env.max_turns)
        assert len(plan) == abs(gx - x) + abs(gy - y)
        assert env._pos == (x, y)  # the search played copies, not the env
        # and too few moves allowed: no plan
        assert shortest_plan(env, env.actions, len(plan) - 1) is None


def test_guess_bisection_needs_at_most_four_guesses_for_every_secret():
    task = task_for("guess")
    secrets = {}
    for seed in range(200):  # every secret 1..9 occurs among these seeds
        env = task.env_factory()
        env.reset(seed)
        secrets.setdefault(env._secret, seed)
    assert sorted(secrets) == list(range(1, 10))
    assert all(play(task, Optimal(task), seed) for seed in secrets.values())


def test_random_below_heuristic_below_optimal():
    table = baselines(tasks=GAMES, n_seeds=400)
    for name, row in table.items():
        assert row["random"] < row["heuristic"] <= row["optimal"] == 1.0, (name, row)
        assert row["random"] < 0.6, (name, row)  # a random walker mostly loses
    assert table["guess"]["heuristic"] < 0.95  # a candidate at random is not bisection


def test_calc_random_below_heuristic_below_optimal():
    row = baselines(tasks=("calc",), n_seeds=48)["calc"]
    assert row["random"] < row["heuristic"] < row["optimal"] == 1.0, row


def test_random_is_the_warmup_policy_and_repeats():
    task = task_for("guess")
    seeds = heldout_seeds(64)
    a = success_rate(task, make_policy("random", task, sample_seed=1), seeds)
    b = success_rate(task, make_policy("random", task, sample_seed=1), seeds)
    c = success_rate(task, make_policy("random", task, sample_seed=2), seeds)
    assert a == b and 0 < a < 1 and 0 < c < 1
    assert make_policy("random", task).task.warmup_action is task.warmup_action


def test_unknown_policy_says_what_to_use():
    with pytest.raises(ValueError, match="random, heuristic, optimal"):
        make_policy("greedy", task_for("gridnav"))
    assert POLICIES == ("random", "heuristic", "optimal")


@pytest.mark.bench
def test_baselines_script_quick():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "baselines.py"),
                          "--quick", "--tasks", "gridnav,guess,boxpush"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(line) == 1
    figures = dict(kv.split("=") for kv in line[0].split()[1:])
    assert figures["seeds"] == "64"
    for name in GAMES:
        assert float(figures[f"{name}_optimal"]) == 1.0
        assert float(figures[f"{name}_random"]) < float(figures[f"{name}_heuristic"])
