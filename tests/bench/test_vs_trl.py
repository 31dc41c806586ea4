"""benchmarks/vs_trl.py and its TRL adapter (benchmarks/_trl_env.py) keep working.

The adapter tests need only transformers; the ones that drive TRL are skipped when the
``bench`` extra (trl) is not installed.
"""

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trl_env():
    return _load("_trl_env")


def _messages(observations, actions):
    """An episode as TRL's tool loop records it."""
    msgs = [{"role": "user", "content": observations[0]}]
    for action, obs in zip(actions, observations[1:]):
        call = {"type": "function", "function": {"name": "act", "arguments": {"action": action}}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "name": "act", "content": obs}]
    return msgs


def test_trl_chat_format_is_rollart_token_layout(tiny_model, trl_env):
    from rollart.env.trajectory import TokenLog
    from rollart.model import encode

    tok = trl_env.GameTokenizer.from_model_folder(tiny_model)
    env = trl_env.env_class("guess")()
    obs = [env.reset(seed=7)]
    actions = ["1", "up", "9", "5"]
    for a in actions:
        obs.append(env.act(a))
        if env.done:
            break
    actions = actions[:len(obs) - 1]
    log = TokenLog()  # what rollart's TrajectoryRunner records for the same episode
    log.add_observation(encode(tok, obs[0]))
    for a, o in zip(actions, obs[1:]):
        log.add_generation(encode(tok, a) + [tok.eos_token_id])
        log.add_observation(encode(tok, o))
    ids = tok.apply_chat_template(_messages(obs, actions), tokenize=True, return_dict=False)
    assert ids == log.ids
    assert "invalid" in obs[2].split()  # "up" is not a guess: both see the penalty


@pytest.fixture(scope="module")
def chat_toy(tmp_path_factory):
    from rollart.corpus import chat_corpus
    from rollart.model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("chat-toy")),
                            chat_corpus(["guess", "gridnav"]), chat=True)


def test_trl_chat_format_is_rollart_chat_conversation(chat_toy, trl_env):
    """--conversation chat: TRL's tool loop rendered by the adapter's template gives the
    ids of rollart's chat conversation (ChatML: observations as user turns, actions as
    assistant turns ending with <|im_end|>) for the same episode."""
    from rollart.chat.conversation import ConversationFormat, TokenLog
    from rollart.env.tasks import get_task

    tok = trl_env.ChatGameTokenizer.from_model_folder(chat_toy)
    env = trl_env.env_class("guess")()
    obs = [env.reset(seed=7)]
    actions = ["1", "up", "9", "5"]
    for a in actions:
        obs.append(env.act(a))
        if env.done:
            break
    actions = actions[:len(obs) - 1]
    from rollart.model import load_tokenizer

    fmt = ConversationFormat(load_tokenizer(chat_toy), "chat", max_context=2048)
    conv = fmt.start(TokenLog(), get_task("guess"), obs[0])
    for a, o in zip(actions, obs[1:]):
        conv.add_text_generation(a)
        conv.add_user(o)
    ids = tok.apply_chat_template(_messages(obs, actions), tokenize=True, return_dict=False,
                                  add_generation_prompt=True)
    assert ids == conv.log.ids
    # the reply to an observation that asks for a move is an act call; after the end
    # (no "act :" in the last user turn) a closing message
    reply = list(tok.encode("5", add_special_tokens=False)) + [tok.eos_token_id]
    prompt = tok.apply_chat_template(_messages(obs[:1], []), tokenize=True,
                                     return_dict=False, add_generation_prompt=True)
    assert tok.parse_response(reply, prefix=prompt)["tool_calls"][0]["function"] == \
        {"name": "act", "arguments": {"action": "5"}}
    over = tok.apply_chat_template(_messages(["guess : success ."], []), tokenize=True,
                                   return_dict=False, add_generation_prompt=True)
    assert tok.parse_response(reply, prefix=over) == {"role": "assistant", "content": "5"}


def test_parse_response_calls_act_until_the_episode_ends(tiny_model, trl_env):
    from rollart.model import encode

    tok = trl_env.GameTokenizer.from_model_folder(tiny_model)
    prompt = encode(tok, "guess : pick 1 to 9 . left 1 2 3 4 6 7 8 9 5 . act :")
    reply = encode(tok, "5") + [tok.eos_token_id]
    msg = tok.parse_response(reply, prefix=prompt)
    assert msg["tool_calls"] == [{"type": "function",
                                  "function": {"name": "act", "arguments": {"action": "5"}}}]
    over = prompt + reply + encode(tok, "guess : success .")
    assert tok.parse_response(reply, prefix=over) == {"role": "assistant", "content": "5"}


def test_env_reward_and_latency_match_rollart(trl_env):
    from rollart.chaos.faults import Faults, Latency
    from rollart.env.tasks import get_task
    from rollart.types import Episode

    task = get_task("guess")
    env = trl_env.env_class(task)()
    obs = [env.reset(seed=3)]
    for a in ["x", "1", "2", "3"]:
        obs.append(env.act(a))
        if env.done:
            break
    ep = Episode("guess", 3, obs, env.actions, env.rewards, env.info)
    assert env.get_reward() == task.reward_fn(ep) < 1.0  # one invalid action: -0.1
    with pytest.raises(RuntimeError, match="over"):
        env.act("4")
    slow = trl_env.env_class(task, Faults(step=Latency("fixed", seconds=0.01)))()
    slow.reset(seed=3)
    slow.act("5")
    assert slow.env.latency_seconds == pytest.approx(0.01)


def test_group_seeds_follow_rollart_pipeline():
    from rollart import GRPO, Graph
    from rollart.control.fleet import Fleet
    from rollart.control.modes import SyncPipeline
    from rollart.control.stages import Actors

    vs_trl = _load("vs_trl")
    graph = Graph(name="g", tasks=("guess",), algo=GRPO(group_size=2, groups_per_step=2))
    pipe = SyncPipeline(Fleet(Actors()), graph)
    assert vs_trl.group_seeds(graph.seed, 6) == [pipe.next_group()[1] for _ in range(6)]
    assert len(set(vs_trl.group_seeds(1, 6))) == 6


def test_trl_accepts_the_chat_format(tiny_model, trl_env):
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    tok = trl_env.GameTokenizer.from_model_folder(tiny_model)
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)


def test_trl_accepts_the_chat_toy_format(chat_toy, trl_env):
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    tok = trl_env.ChatGameTokenizer.from_model_folder(chat_toy)
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)


def test_time_to_a_heldout_target_is_fixed_and_misses_are_reported():
    """The target is never lowered: a runner that stays below it has no time (inf) and
    a speed-up against it is 0 (or nan when both missed), never a figure re-timed to a
    lower reward."""
    vs_trl = _load("vs_trl")
    curve = [(0, 0.0, 0.3), (5, 10.0, 0.48), (10, 20.0, 0.52)]
    assert vs_trl.time_to(curve, 0.5) == 20.0
    assert vs_trl.time_to(curve, 0.6) == math.inf
    runs = {"trl": {"time_to_target_s": 40.0, "heldout_final": 0.5, "traj_per_s": 10.0},
            "async": {"time_to_target_s": 20.0, "heldout_final": 0.6, "traj_per_s": 30.0},
            "sync": {"time_to_target_s": math.inf, "heldout_final": 0.4, "traj_per_s": 12.0}}
    r = vs_trl.ratios(runs)
    assert r["speedup_async"] == 2.0 and r["speedup_sync"] == 0.0
    assert r["throughput_async"] == 3.0
    assert (r["tps_trl"], r["tps_async"], r["t_sync"]) == (10.0, 30.0, math.inf)
    figures = {f"{k}_w": v for k, v in r.items()}
    v = vs_trl.verdict(figures, "w", ("sync", "async"))
    assert v == {"best_mode_w": "async", "trl_faster_than_w": "sync"}
    assert math.isnan(vs_trl.speedup(math.inf, math.inf))
    assert vs_trl.Settings().target == 0.5  # fixed in advance, in the code


def test_trl_snapshot_is_a_model_folder_rollart_evaluates(tiny_model, tmp_path, trl_env):
    """A TRL-side snapshot (the weights + the word-level tokenizer) evaluates with
    rollart's held-out evaluation exactly as the folder it came from."""
    from rollart.env.scripted import heldout_seeds
    from rollart.env.tasks import get_task
    from rollart.observe.evaluate import evaluate
    from rollart.model import load_model

    snap = trl_env.save_snapshot(load_model(tiny_model), tiny_model, str(tmp_path / "snap"))
    task, seeds = get_task("gridnav"), heldout_seeds(6)
    assert evaluate(snap, [task], seeds, conversation="raw") == \
        evaluate(tiny_model, [task], seeds, conversation="raw")


@pytest.mark.slow
@pytest.mark.bench
def test_benchmark_runs_end_to_end(capsys):
    """Both workloads × TRL, rollart sync+, sync, async with tiny settings; every
    runner's snapshots evaluated on the held-out seeds."""
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    random.seed(0)
    out = _load("vs_trl").main(["--steps", "2", "--warmup-steps", "10", "--group-size", "2",
                                "--groups-per-step", "2", "--in-process", "--seeds", "1",
                                "--eval-every", "1", "--eval-seeds", "4",
                                "--workloads", "no_latency,latency"])
    for workload in ("no_latency", "latency"):
        for runner in ("trl", "sync+", "sync", "async"):
            run = out["runs"][workload][runner]
            assert run["steps"] == 2, (workload, runner)
            assert [st for st, _, _ in run["curve"]] == [0, 1, 2], (workload, runner)
            times = [t for _, t, _ in run["curve"]]
            assert times == sorted(times) and times[-1] <= run["wall_s"] + 1e-6
            assert run["tokens_per_s"] > 0 and run["wall_s"] > 0
            assert all(0.0 <= v <= 1.0 for _, _, v in run["curve"])
    # every runner starts from the same warmed-up model: the same step-0 success
    assert len({r["curve"][0][2] for w in out["runs"].values() for r in w.values()}) == 1
    # with step latency TRL steps its envs one after another: slower than without
    assert out["runs"]["latency"]["trl"]["wall_s"] > out["runs"]["no_latency"]["trl"]["wall_s"]
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")]
    assert len(line) == 1
    for k in ("speedup_async_no_latency=", "speedup_syncplus_latency=", "best_mode_latency=",
              "target=0.5"):
        assert k in line[0], k
    assert not math.isnan(out["result"]["total_s"])


@pytest.mark.slow
@pytest.mark.bench
def test_benchmark_chat_runs_end_to_end(capsys):
    """--conversation chat: TRL's tool loop and rollart's chat conversations on the chat
    toy, tiny settings; every runner's snapshots evaluated in chat form."""
    pytest.importorskip("trl", reason="TRL is the bench extra: pip install -e '.[bench]'")
    out = _load("vs_trl").main(["--steps", "2", "--warmup-steps", "10", "--group-size", "2",
                                "--groups-per-step", "2", "--in-process", "--seeds", "1",
                                "--eval-every", "2", "--eval-seeds", "4",
                                "--conversation", "chat", "--modes", "sync+,async"])
    for runner in ("trl", "sync+", "async"):
        run = out["runs"]["no_latency"][runner]
        assert run["steps"] == 2 and [st for st, _, _ in run["curve"]] == [0, 2], runner
        assert run["tokens_per_s"] > 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT ")]
    assert len(line) == 1 and "conversation=chat" in line[0]


def test_aggregate_takes_medians_and_ranges_of_one_seed_runs(tmp_path):
    """--aggregate FILE...: the RESULT lines of single-seed runs (as `--seeds 1 --seed N`
    prints them) become medians with min and max, the verdict follows the median times
    (a seed that missed counts inf, a both-missed nan is left out), and runs of different
    settings are refused."""
    vs_trl = _load("vs_trl")
    runs = [  # (t_trl, t_async, t_sync, speedup_sync, heldout_async, tps_async)
        ("30", "10", "inf", "0", "0.6", "20"), ("50", "inf", "inf", "nan", "0.4", "40"),
        ("40", "20", "60", "0.667", "0.5", "30")]
    paths = []
    for n, (trl, asy, syn, sp, ho, tps) in enumerate(runs):
        path = tmp_path / f"seed{n}.log"
        path.write_text(f"seed {n}: noise\nRESULT speedup_sync_w={sp} t_trl_w={trl} "
                        f"t_async_w={asy} t_sync_w={syn} heldout_async_w={ho} "
                        f"tps_async_w={tps} best_mode_w=x seeds={n} target=0.5 "
                        f"conversation=raw steps_w=60 eval_seeds=64 trl_threads=1 "
                        f"total_s=300\n")
        paths.append(str(path))
    agg = vs_trl.aggregate_files(paths)
    assert (agg["t_trl_w"], agg["t_trl_w_min"], agg["t_trl_w_max"]) == (40.0, 30.0, 50.0)
    assert (agg["t_async_w"], agg["t_async_w_max"]) == (20.0, math.inf)
    assert agg["t_sync_w"] == math.inf and agg["t_sync_w_min"] == 60.0
    assert agg["speedup_sync_w"] == pytest.approx(0.3335)  # the nan seed left out
    assert agg["heldout_async_w"] == 0.5 and agg["tps_async_w_min"] == 20.0
    assert (agg["best_mode_w"], agg["trl_faster_than_w"]) == ("async", "sync")
    assert agg["seeds"] == "0/1/2" and agg["target"] == 0.5 and agg["total_s"] == 900
    assert "steps_w_min" not in agg and "target_min" not in agg
    other = tmp_path / "other.log"
    other.write_text(Path(paths[0]).read_text().replace("target=0.5", "target=0.4"))
    with pytest.raises(SystemExit, match="different target"):
        vs_trl.aggregate_files(paths[:2] + [str(other)])
    with pytest.raises(SystemExit, match="0 RESULT lines"):
        vs_trl.aggregate_files([str(tmp_path / "seed0.log"), str(_empty(tmp_path))])


def _empty(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("no result here\n")
    return path
