"""Bad input, tried as a new user would: each case raises an error whose message says
what to change, before any cluster starts (nothing here starts one)."""

import os
import pickle
import threading
import time

import pytest

from rollart import GRPO, Graph, Policy, Pool, Resources, Rollout, train
from rollart.app.cli import main
from rollart.env.builtin.gridnav import GridNavEnv
from rollart.env.protocol import EnvOutputError, check_observation, check_step_result
from rollart.env.tasks import Task, UnknownTaskError
from rollart.config.graph import GraphError, load_graph
from rollart.model import ModelFolderError, build_tiny_model, check_model_folder
from rollart.config.preflight import preflight
from rollart.runtime.resources import ResourcesError, ResourceTagError, load_resources
from rollart.reward import RewardError, check_reward, success_reward
from rollart.types import CPU_ENV, H20, H800, REWARD, TRAIN


# -- graph and resources files ----------------------------------------------------------
@pytest.mark.parametrize("body, loader, error, needle", [
    ("def graph(:\n", load_graph, GraphError, "could not load .*SyntaxError"),
    ("X = 1\n", load_graph, GraphError, "defines no graph\\(\\) function; add"),
    ("def graph():\n    return [1]\n", load_graph, GraphError, "returned list; return a "
     "rollart.Graph"),
    ("import rollart_no_such_pkg\n", load_graph, GraphError, "No module named"),
    ("def resources(:\n", load_resources, ResourcesError, "could not load .*SyntaxError"),
    ("X = 1\n", load_resources, ResourcesError, "defines no resources\\(\\) function"),
    ("def resources():\n    return {'pools': []}\n", load_resources, ResourcesError,
     "returned dict; return a rollart.Resources"),
    ("from rollart import Pool, Resources\ndef resources():\n"
     "    return Resources(pools=(Pool('a', tag='X', kind='gpu'),))\n",
     load_resources, ResourcesError, "kind 'gpu' is unknown; use one of"),
], ids=["graph-syntax", "graph-no-fn", "graph-wrong-return", "graph-import-error",
        "resources-syntax", "resources-no-fn", "resources-wrong-return",
        "resources-bad-kind"])
def test_malformed_files(tmp_path, body, loader, error, needle):
    f = tmp_path / "bad.py"
    f.write_text(body)
    with pytest.raises(error, match=needle):
        loader(str(f))


@pytest.mark.parametrize("loader, spec, error, needle", [
    (load_graph, "graphs/missing.py", GraphError, "no graphs file .* give a path"),
    (load_resources, "resources/missing.py", ResourcesError, "no resources file"),
    (load_graph, "graphs/gridnav.py:nope", GraphError, "defines no nope\\(\\) function"),
])
def test_missing_files(loader, spec, error, needle):
    with pytest.raises(error, match=needle):
        loader(spec)


# -- wrong types and impossible values in settings -------------------------------------
@pytest.mark.parametrize("make, needle", [
    (lambda: GRPO(lr="1e-3"), "GRPO.lr must be a number, got str '1e-3'; write it without"),
    (lambda: GRPO(alpha=-1), "alpha .* must be an int ≥ 0"),
    (lambda: GRPO(alpha=1.5), "GRPO.alpha must be an int"),
    (lambda: GRPO(group_size=8.0), "group_size must be an int"),
    (lambda: Policy(temperature="hot"), "Policy.temperature must be a number"),
    (lambda: Policy(max_batch=0), "max_batch must be ≥ 1"),
    (lambda: Rollout(env_step_timeout=None), "env_step_timeout must be a number"),
    (lambda: Rollout(trajectory_timeout=0), "trajectory_timeout must be > 0 seconds or None"),
    (lambda: Rollout(reward_timeout=-1), "reward_timeout must be > 0"),
    (lambda: Rollout(inference_pools=["H800"]), "must be a non-empty tuple"),
    (lambda: Graph(name="x", steps="10"), "Graph.steps must be an int"),
    (lambda: Graph(name="x", checkpoint_every=-1), "checkpoint_every must be ≥ 0"),
    (lambda: Graph(name="x", task_weights=("a", "b", "c")), "tuple of numbers"),
    (lambda: Graph(name="x", mode="fast"), "mode 'fast' is not one of"),
], ids=["lr-str", "alpha-negative", "alpha-float", "group-size-float", "temperature-str",
        "max-batch-zero", "timeout-none", "trajectory-timeout-zero", "reward-timeout-neg",
        "pools-list", "steps-str", "checkpoint-negative", "weights-str", "mode-unknown"])
def test_settings(make, needle):
    with pytest.raises(GraphError, match=needle):
        make()


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(UnknownTaskError, match="unknown task 'sokoban'; known tasks: boxpush"):
        Graph(name="x", tasks=("sokoban",))


@pytest.mark.parametrize("make, needle", [
    (lambda: Pool("p", tag=TRAIN, kind="trainer", workers="2"), "workers must be a whole"),
    (lambda: Pool("p", tag=TRAIN, kind="trainer", threads=0), "threads must be a whole"),
    (lambda: Pool("p", tag=TRAIN, kind="trainer", slots=0), "slots must be > 0"),
    (lambda: Resources(), "declare at least one Pool or an address"),
    (lambda: Resources(pools=(_pool("a", TRAIN), _pool("a", REWARD))), "pool names repeat"),
    (lambda: Resources(pools=(_pool("a", TRAIN),), security={"tls": True}),
     "security must be a distributed.security.Security"),
    (lambda: Resources(pools=(_pool("a", TRAIN),), host=""), "host must be an interface"),
], ids=["workers-str", "threads-zero", "slots-zero", "no-pools", "names-repeat",
        "security-dict", "host-empty"])
def test_resources(make, needle):
    with pytest.raises(ResourcesError, match=needle):
        make()


def _pool(name, tag, workers=1):
    kind = {TRAIN: "trainer", REWARD: "reward", CPU_ENV: "cpu_env", H800: "compute_gpu",
            H20: "bandwidth_gpu"}.get(tag, "cpu")
    return Pool(name, tag=tag, kind=kind, workers=workers)


def _local(**workers) -> Resources:
    tags = {"h800": H800, "h20": H20, "env": CPU_ENV, "reward": REWARD, "trainer": TRAIN}
    return Resources(pools=tuple(_pool(n, t, workers.get(n, 1)) for n, t in tags.items()),
                     processes=False, source="resources/mine.py")


# -- settings that cannot work together (rollart.config.preflight) -----------------------------
def test_zero_workers_in_a_required_pool():
    with pytest.raises(ResourceTagError, match="pool\\(s\\) \\['trainer'\\] in "
                       "resources/mine.py have workers=0; set workers ≥ 1"):
        preflight(Graph(name="x"), _local(trainer=0))


def test_misspelt_inference_pool_tag():
    g = Graph(name="x", rollout=Rollout(inference_pools=("H100",)))
    with pytest.raises(ResourceTagError, match="'H100' is not one of rollart's tags .* check "
                       "the spelling in Rollout.inference_pools"):
        preflight(g, _local())


def test_lockstep_batch_larger_than_env_concurrency():
    g = Graph(name="x", mode="sync", algo=GRPO(group_size=8, groups_per_step=4),
              rollout=Rollout(env_concurrency=16))
    with pytest.raises(GraphError, match="32 members per env manager, more than "
                       "Rollout.env_concurrency=16. Lower GRPO.group_size"):
        preflight(g, _local())
    preflight(g, _local(env=2))  # two env workers: 16 each, fits


class LockedReward:
    """A reward holding a lock: it cannot travel to the REWARD pool."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, episode):
        return 1.0


class Sandbox:
    def __init__(self, path):
        self.handle = open(path, "w")

    def make_env(self):
        return GridNavEnv()


@pytest.mark.parametrize("field", ["reward_fn", "env_factory"])
def test_non_picklable_task_parts(tmp_path, field):
    parts = {"reward_fn": LockedReward(), "env_factory": Sandbox(tmp_path / "f").make_env}
    task = Task(name="mine", **{"env_factory": GridNavEnv, "reward_fn": success_reward,
                                field: parts[field]}, max_turns=3)
    with pytest.raises(GraphError, match=f"task 'mine': {field} .* cannot be pickled .* "
                       "make it a module-level function"):
        preflight(Graph(name="x", tasks=(task,)), None)


def test_train_refuses_before_any_cluster_or_model(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ResourceTagError, match="workers=0"):
        train(Graph(name="x", steps=1), _local(reward=0), run_dir=tmp_path / "run")
    assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "run").exists()  # nothing was written, nothing started


# -- model folders ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "model", ["a b c"], hidden_size=32,
                            num_layers=1)


def _copy_without(src, dst, drop=(), edit=None):
    import shutil

    shutil.copytree(src, dst)
    for name in drop:
        os.remove(os.path.join(dst, name))
    if edit:
        edit(dst)
    return str(dst)


@pytest.mark.parametrize("drop, edit, needle", [
    (("model.safetensors",), None, "has no weights .* finish the download"),
    (("tokenizer.json",), None, "has no tokenizer .* tokenizer.save_pretrained"),
    (("config.json",), None, "has no config.json"),
    ((), lambda d: open(os.path.join(d, "config.json"), "w").write("{oops"),
     "config.json is not valid JSON"),
    ((), lambda d: open(os.path.join(d, "config.json"), "w").write('{"a": 1}'),
     "config.json has no model_type"),
    ((), lambda d: _truncate(os.path.join(d, "model.safetensors")),
     "model.safetensors is unreadable .* fetch it again"),
], ids=["no-weights", "no-tokenizer", "no-config", "config-not-json", "config-no-type",
        "weights-truncated"])
def test_model_folder(small_model, tmp_path, drop, edit, needle):
    path = _copy_without(small_model, tmp_path / "m", drop, edit)
    with pytest.raises(ModelFolderError, match=needle):
        check_model_folder(path)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_model_folder_that_does_not_exist():
    with pytest.raises(ModelFolderError, match="does not exist: pass a local folder"):
        check_model_folder("/no/such/model")


# -- env outputs and reward values ------------------------------------------------------
@pytest.mark.parametrize("value, needle", [
    (("obs", 1.0, False), "returned a 3-tuple; expected rollart.types.StepResult"),
    ({"observation": "x"}, "returned dict; expected"),
    (("obs", "1", False, {}), "reward is str .* expected a real number"),
    (("obs", float("inf"), False, {}), "reward is inf; expected a finite number"),
    (("obs", 1.0, "yes", {}), "done is str; expected bool"),
    ((b"obs", 1.0, False, {}), "observation is bytes; expected str"),
    (("obs", 1.0, False, ["success"]), "info is list; expected dict"),
], ids=["3-tuple", "dict", "reward-str", "reward-inf", "done-str", "obs-bytes", "info-list"])
def test_env_step_outputs(value, needle):
    with pytest.raises(EnvOutputError, match=needle):
        check_step_result(value, "MyEnv")


def test_env_reset_output():
    with pytest.raises(EnvOutputError, match="MyEnv.reset returned NoneType; expected a str"):
        check_observation(None, "MyEnv")


@pytest.mark.parametrize("value", ["high", None, float("nan"), True])
def test_reward_values(value):
    with pytest.raises(RewardError, match="reward function judge returned .*expected a finite"):
        check_reward(value, "judge")


# -- weights and checkpoints ------------------------------------------------------------
def test_unreadable_weight_version_is_named_and_skipped(tmp_path):
    import torch

    from rollart.weights import WeightStore
    from rollart.weights.store import UnreadableWeightsError

    store = WeightStore(str(tmp_path / "w"))
    store.put(0, {"w": torch.zeros(3)})
    store.put(1, {"w": torch.ones(3)})
    _truncate(str(tmp_path / "w" / "v00000001.safetensors"))
    with pytest.raises(UnreadableWeightsError, match="weight version 1 .* is unreadable .* "
                       "Delete it so the previous version is used"):
        store.get(1)
    version, state = store.get_newest_readable()
    assert version == 0 and state["w"].sum() == 0


def test_unreadable_checkpoint(tmp_path):
    from rollart.control import checkpoint

    path = checkpoint.step_dir(str(tmp_path), 3)
    os.makedirs(path)
    files = checkpoint.write_bytes(path, "state.json", b'{"step": 3, "version": 3}')
    checkpoint.write_bytes(path, "manifest.json", pickle.dumps(files))  # not JSON
    open(os.path.join(path, checkpoint.MARKER), "w").write("3")
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is corrupt"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint under"):
        train("gridnav", resume=str(tmp_path / "never-ran"))


# -- the command line -------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["train", "--steps", "0"], "Graph.steps must be an int ≥ 1"),
    (["train", "--alpha", "-2"], "alpha"),
    (["train", "gridnav", "--model", "/no/such/model"], "does not exist"),
], ids=["cli-steps-zero", "cli-alpha-negative", "cli-model-missing"])
def test_cli(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart: error:") and needle in err


# -- run directories and weight stores used by another run (rollart.config.preflight) ----------
def _old_run(path):
    (path / "samples").mkdir(parents=True)
    (path / "graph.json").write_text("{}")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "notes.txt").write_text("mine")
    return path


def test_run_dir_holding_a_run_is_refused_or_overwritten(tmp_path):
    from rollart.config.preflight import RunDirError, check_run_dir

    check_run_dir(tmp_path / "new")  # a fresh (or empty) folder is fine
    old = _old_run(tmp_path / "old")
    with pytest.raises(RunDirError, match="already holds a run .*--resume .*old.*new "
                       "--run-dir.*--overwrite"):
        check_run_dir(old)
    assert (old / "metrics.jsonl").exists()
    check_run_dir(old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]  # only a run's outputs


def test_overwrite_refuses_a_folder_that_is_not_a_run_dir(tmp_path):
    from rollart.config.preflight import RunDirError, check_run_dir

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(RunDirError, match="does not look like a rollart run directory; "
                       "nothing was removed"):
        check_run_dir(tmp_path, overwrite=True)
    assert (tmp_path / "model" / "config.json").exists()


def test_a_weight_store_of_another_run_is_refused(tmp_path):
    """The re-used run directory's hang, directly: the first run left versions 4..6; the
    new trainer's garbage collection (keep the newest 3) deleted each version it published,
    so its inference workers never loaded one. Refused now, or emptied with overwrite."""
    import torch

    from rollart.config.preflight import RunDirError, check_weight_store
    from rollart.weights import WeightStore

    url, w = str(tmp_path / "weights"), {"w": torch.zeros(2)}
    store = WeightStore(url)
    for v in (4, 5, 6):
        store.put(v, w)
    store.hold("reader-of-the-old-run", 5)
    for v in (0, 1):  # what the second run's trainer did
        store.put(v, w)
        store.gc(3)
    assert store.versions() == [4, 5, 6] and store.latest() == 1  # its own versions: gone
    with pytest.raises(RunDirError, match="already holds versions 4..6 .*--weights .*"
                       "--overwrite"):
        check_weight_store(url)
    check_weight_store(url, overwrite=True)
    assert store.versions() == [] and store.latest() == -1 and store.holds() == {}
    for v in (0, 1, 2, 3):
        store.put(v, w)
        store.gc(3)
    assert store.versions() == [1, 2, 3]
    check_weight_store(None)  # the default store is in the run directory: checked with it


def test_a_checkpoint_url_of_another_run_is_refused(tmp_path):
    from rollart.control import checkpoint
    from rollart.config.preflight import RunDirError, check_checkpoints

    path = checkpoint.step_dir(str(tmp_path), 40)
    os.makedirs(path)
    open(os.path.join(path, checkpoint.MARKER), "w").write("40")
    with pytest.raises(RunDirError, match="steps 40..40.*--checkpoint-url.*--overwrite"):
        check_checkpoints(str(tmp_path))
    check_checkpoints(str(tmp_path), overwrite=True)
    assert checkpoint.steps(str(tmp_path)) == []


def test_an_agent_that_does_not_pickle_is_named(tmp_path):
    from rollart.agents.agent import AgentTask

    task = AgentTask(name="mine", agent=Sandbox(tmp_path / "f").make_env, max_turns=2)
    with pytest.raises(GraphError, match="task 'mine': agent .* cannot be pickled"):
        preflight(Graph(name="x", tasks=(task,)), None)
