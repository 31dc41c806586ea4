"""The rollout figures of a step from worker and manager stats (pure, no cluster)."""

import pytest

from rollart.observe.figures import padding, rollout_figures


def _manager(turns, overhead, p99, **more):
    return {"turns": turns, "turn_overhead_s": overhead, "env_step_p99": p99, **more}


def test_ratios_are_over_the_totals_not_a_mean_of_each_workers():
    # a busy worker and an idle one: the run's prefix reuse is 90 hit tokens of 200, not
    # the mean of 0.5 and 0.0; its padding 50 padded tokens over 250 forwarded
    workers = [{"tokens_generated": 40, "prefix_hit_tokens": 90, "prefix_prompt_tokens": 180,
                "prefill_tokens": 200, "prefill_padded": 240, "prefill_shared": 3},
               {"tokens_generated": 2, "prefix_hit_tokens": 0, "prefix_prompt_tokens": 20,
                "prefill_tokens": 50, "prefill_padded": 60}]
    managers = [_manager(30, 0.002, 0.4, group_errors=1, backups=2),
                _manager(10, 0.010, 1.5, rewards_here=7)]
    f = rollout_figures(workers, managers, driver_errors=2)
    assert f["rollout/prefix_reuse"] == pytest.approx(90 / 200)
    assert f["rollout/prefill_padding"] == pytest.approx(300 / 250 - 1)
    # a turn's overhead weighted by each manager's turns: (30*2 + 10*10) / 40 ms
    assert f["rollout/turn_overhead_s"] == pytest.approx(0.004)
    assert f["env/step_p99_s"] == 1.5  # the slowest manager's, not an average
    assert f["rollout/group_errors"] == 3  # the driver's two and a manager's one
    assert (f["rollout/tokens_generated"], f["rollout/turns"], f["rollout/backups"],
            f["rollout/rewards_here"], f["rollout/prefill_shared"]) == (42, 40, 2, 7, 3)


def test_nothing_reported_yet_gives_zeros_not_a_division_error():
    f = rollout_figures([{}], [], 0)
    assert f["rollout/prefix_reuse"] == 0.0 and f["rollout/prefill_padding"] == 0.0
    assert f["rollout/turn_overhead_s"] == 0.0 and f["env/step_p99_s"] == 0.0
    assert padding(0, 0) == 0.0 and padding(15, 10) == pytest.approx(0.5)


def test_the_agent_endpoints_counters_are_summed_into_the_row():
    """``rollout/agent_*`` (``EnvManager.stats``, from each trajectory runner) reach the
    step row, summed over the env managers."""
    managers = [_manager(4, 0.0, 0.1, **{"rollout/agent_calls": 6,
                                         "rollout/agent_rewrites": 2,
                                         "rollout/agent_dropped_tokens": 30}),
                _manager(2, 0.0, 0.1, **{"rollout/agent_calls": 1})]
    f = rollout_figures([{}], managers)
    assert (f["rollout/agent_calls"], f["rollout/agent_rewrites"],
            f["rollout/agent_dropped_tokens"]) == (7, 2, 30)
