"""Graph modules: loading by name, path and module:function; validation messages."""

from dataclasses import replace

import pytest

from rollart.env.tasks import UnknownTaskError
from rollart.config.graph import GRPO, Graph, GraphError, Policy, Rollout, load_graph


def test_default_graph_is_multitask():
    g, src = load_graph()
    assert src.endswith("graphs/multitask.py")
    assert g.task_names == ["gridnav", "guess", "boxpush"]
    assert set(g.needs()) == {"H800", "H20", "CPU_ENV", "REWARD", "TRAIN"}


def test_single_task_graph_and_module_function(tmp_path):
    g, _ = load_graph("gridnav")
    assert g.task_names == ["gridnav"]
    f = tmp_path / "mine.py"
    f.write_text("from rollart import Graph\n"
                 "def small():\n    return Graph(name='small', tasks=('guess',), steps=2)\n")
    g, src = load_graph(f"{f}:small")
    assert g.name == "small" and src == str(f)


@pytest.mark.parametrize("body, match", [
    ("x = 1\n", "defines no graph"),
    ("def graph():\n    return {'name': 'x'}\n", "returned dict"),
    ("import nonexistent_pkg\n", "could not load"),
])
def test_malformed_graph_files(tmp_path, body, match):
    f = tmp_path / "bad.py"
    f.write_text(body)
    with pytest.raises(GraphError, match=match):
        load_graph(str(f))


def test_unknown_graph_path():
    with pytest.raises(GraphError, match="multitask"):
        load_graph("graphs/does_not_exist.py")


def test_unknown_task_name_lists_known():
    with pytest.raises(UnknownTaskError, match="gridnav"):
        Graph(name="x", tasks=("sokoban9000",))


@pytest.mark.parametrize("make, match", [
    (lambda: GRPO(group_size=1), "group_size must be ≥ 2"),
    (lambda: GRPO(alpha=-1), "alpha"),
    (lambda: GRPO(off_policy="vtrace"), "off_policy"),
    (lambda: GRPO(scale_rewards="std"), "scale_rewards must be one of"),
    (lambda: GRPO(groups_per_step="4"), "groups_per_step"),
    (lambda: Policy(temperature=0), "temperature"),
    (lambda: Policy(warmup_threads=0), "warmup_threads"),
    (lambda: Policy(warmup_threads=1.5), "warmup_threads"),
    (lambda: Policy(warmup_episode_threads=0), "warmup_episode_threads"),
    (lambda: Policy(warmup_episode_threads=2.0), "warmup_episode_threads"),
    (lambda: Policy(warmup_bare_tool_steps=-1), "warmup_bare_tool_steps must be an int"),
    (lambda: Policy(warmup_bare_tool_steps=5, conversation="raw"),
     "warmup_bare_tool_steps=5 needs the chat format.*set it to 0"),
    (lambda: Policy(weight_update="fast"),
     r"Policy.weight_update must be one of \('recompute', 'keep'\), got 'fast'"),
    (lambda: Policy(engine="vllm", weight_update="keep", lora={"rank": 8}),
     "weight_update='keep' with engine='vllm' and Policy.lora.*weight_update='recompute'"),
    (lambda: Policy(warmup_pretrained="yes"), "warmup_pretrained must be True or False"),
    (lambda: Policy(warmup_tasks="calc"), "warmup_tasks must be a tuple of task names"),
    (lambda: Graph(name="x", tasks=("guess",), policy=Policy(warmup_tasks=("calc",))),
     r"Policy.warmup_tasks names \['calc'\], not among the graph's tasks \['guess'\]"),
    (lambda: Rollout(inference_pools=()), "inference_pools"),
    (lambda: Graph(name="x", steps=0), "steps"),
    (lambda: Graph(name="x", tasks=()), "tasks"),
    (lambda: Graph(name="x", task_weights=(1.0,)), "task_weights"),
    (lambda: Graph(name="x", algo={"lr": 1}), "rollart.GRPO"),
])
def test_settings_validation(make, match):
    with pytest.raises(GraphError, match=match):
        make()


def test_variant_by_replace_and_to_dict():
    g, _ = load_graph()
    v = replace(g, algo=replace(g.algo, alpha=3), steps=5)
    d = v.to_dict()
    assert d["algo"]["alpha"] == 3 and d["steps"] == 5 and d["tasks"][0] == "gridnav"


# -- one home for the staleness bound (rollart.config.graph.resolve_alpha) ---------------------
def test_unset_alpha_takes_the_modes_bound():
    assert Graph(name="x", mode="sync").algo.alpha == 0
    assert Graph(name="x", mode="one-off").algo.alpha == 1
    assert Graph(name="x").algo.alpha == 1 and GRPO().alpha == 1  # async, and outside a graph
    sync = Graph(name="x", mode="sync", algo=GRPO(group_size=4))
    assert sync.algo.group_size == 4 and not sync.algo.alpha_given
    assert replace(sync, mode="async").algo.alpha == 1  # still unset: follows the mode
    assert Graph(name="x", algo=GRPO(alpha=3)).algo.alpha == 3
    assert Graph(name="x", mode="sync", algo=GRPO(alpha=0)).algo.alpha == 0
    assert Graph(name="x", mode="sync").to_dict()["algo"]["alpha"] == 0


@pytest.mark.parametrize("mode, alpha", [("sync", 2), ("sync", 1), ("one-off", 0)])
def test_alpha_contradicting_a_baseline_mode_is_an_error(mode, alpha):
    with pytest.raises(GraphError, match=f"GRPO.alpha={alpha} contradicts mode='{mode}'.*"
                       "Leave GRPO.alpha unset.*--mode async"):
        Graph(name="x", mode=mode, algo=GRPO(alpha=alpha))
    with pytest.raises(GraphError, match="contradicts"):  # also when the mode changes later
        replace(Graph(name="x", algo=GRPO(alpha=alpha)), mode=mode)


def test_shipped_graphs_run_in_every_mode():
    """They leave alpha unset, so ``--mode sync`` / ``one-off`` need no ``--alpha``."""
    from rollart.control.prepare import override

    for name in ("multitask", "gridnav"):
        g, _ = load_graph(name)
        assert {m: override(g, mode=m).algo.alpha for m in ("async", "one-off", "sync")} \
            == {"async": 1, "one-off": 1, "sync": 0}
