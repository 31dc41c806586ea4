"""``--set FIELD=VALUE``: typed by the field's annotation, checked by the dataclasses' own
``__post_init__``, unknown keys listing the valid ones; the CLI's bad input exits 2."""

import pytest

from rollart.app.cli import main
from rollart.config.graph import GRPO, Graph, GraphError, load_graph
from rollart.config.overrides import OverrideError, apply_overrides, parse_value, valid_keys


def test_each_kind_of_field_parses_to_its_type():
    g, _ = load_graph("gridnav")
    g2 = apply_overrides(g, ["algo.lr=1e-4", "rollout.redundancy=1.5",
                             "policy.temperature=0.8", "steps=41", "seed=7",
                             "rollout.local_reward=false", "policy.max_context=none",
                             "rollout.inference_pools=H800,H20", "policy.system_prompt=be brief",
                             "rollout.trajectory_timeout=12"])
    assert (g2.algo.lr, g2.rollout.redundancy, g2.policy.temperature) == (1e-4, 1.5, 0.8)
    assert (g2.steps, g2.seed, g2.rollout.local_reward) == (41, 7, False)
    assert g2.policy.max_context is None and g2.policy.system_prompt == "be brief"
    assert g2.rollout.inference_pools == ("H800", "H20")
    assert g2.rollout.trajectory_timeout == 12.0 and type(g2.rollout.trajectory_timeout) is float
    d = g2.to_dict()  # what graph.json records
    assert d["algo"]["lr"] == 1e-4 and d["steps"] == 41 and d["rollout"]["redundancy"] == 1.5
    assert g.algo.lr != 1e-4 and g.steps != 41  # a copy: the graph itself is untouched


def test_an_unknown_key_lists_the_valid_ones():
    g = Graph(name="g")
    for key in ("algo.nope", "nope", "policy", "algo.lr.x", "trainer.lr"):
        with pytest.raises(OverrideError) as e:
            apply_overrides(g, [f"{key}=1"])
        assert f"--set {key}: no such graph field" in str(e.value)
        assert "algo.lr" in str(e.value) and "rollout.redundancy" in str(e.value)
    assert set(valid_keys(g)) >= {"steps", "mode", "algo.alpha", "policy.temperature"}


@pytest.mark.parametrize("assignment, needle", [
    ("algo.lr=fast", "GRPO.lr must be a number, got 'fast'"),
    ("steps=many", "Graph.steps must be an int, got 'many'"),
    ("rollout.local_reward=maybe", "Rollout.local_reward must be true or false"),
    ("policy.max_batch=2.5", "Policy.max_batch must be an int, got '2.5'"),
    ("algo.lr", "write FIELD=VALUE"),
])
def test_wrong_type_names_the_field(assignment, needle):
    with pytest.raises(OverrideError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        apply_overrides(Graph(name="g"), [assignment])


@pytest.mark.parametrize("assignment, needle", [
    ("rollout.redundancy=20", "Rollout.redundancy must be a factor in [1, 8], got 20.0"),
    ("algo.lr=-1", "GRPO.lr must be > 0, got -1.0"),
    ("policy.temperature=0", "Policy.temperature must be > 0"),
    ("mode=fast", "Graph.mode 'fast' is not one of"),
    ("steps=0", "Graph.steps must be an int ≥ 1, got 0"),
    ("policy.weight_update=fast", "Policy.weight_update must be one of ('recompute', "
                                  "'keep'), got 'fast'"),
])
def test_out_of_range_is_the_dataclasss_own_error(assignment, needle):
    with pytest.raises(GraphError) as e:
        apply_overrides(Graph(name="g"), [assignment])
    assert needle in str(e.value)


def test_alpha_left_to_the_mode_follows_a_later_mode():
    """Replacing another GRPO field must not freeze the mode's alpha: a sync graph
    given --set algo.lr=... mode=async gets async's bound (1), not sync's 0."""
    g = Graph(name="g", mode="sync")
    assert g.algo.alpha == 0
    g2 = apply_overrides(g, ["algo.lr=1e-3", "mode=async"])
    assert g2.algo.alpha == 1 and g2.algo.lr == 1e-3
    g3 = apply_overrides(Graph(name="g"), ["algo.alpha=3"])
    assert g3.algo.alpha == 3
    with pytest.raises(GraphError, match="contradicts mode='sync'"):
        apply_overrides(g3, ["mode=sync"])  # a set alpha stays set: a contradiction
    assert apply_overrides(g3, ["algo.alpha=none", "mode=sync"]).algo.alpha == 0
    assert GRPO(alpha=None).alpha == 1


def test_parse_value_without_eval():
    assert parse_value("__import__('os')", str) == "__import__('os')"
    with pytest.raises(ValueError):
        parse_value("__import__('os')", float)
    assert parse_value("(1, 2.5)", tuple[float, ...]) == (1.0, 2.5)
    assert parse_value("null", float | None) is None


@pytest.mark.parametrize("argv, needle", [
    (["--set", "algo.nope=1"], "--set algo.nope: no such graph field; valid fields:"),
    (["--set", "rollout.redundancy=20"], "Rollout.redundancy must be a factor in [1, 8]"),
    (["--set", "algo.lr=abc"], "GRPO.lr must be a number, got 'abc'"),
    (["--steps", "3", "--set", "steps=4"], "--steps and --set steps=... both set steps"),
    (["--alpha", "2", "--set", "algo.alpha=1"], "--alpha and --set algo.alpha=..."),
])
def test_cli_bad_overrides_exit_2_before_a_cluster(argv, needle, capsys):
    assert main(["train", "gridnav", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart: error:") and needle in err
