"""benchmarks/kv_transfer.py, reward_pool.py, tool_sandbox.py, weight_sync.py,
trainer_gang.py, limits.py, calc_copy.py, inflight_learning.py, setup_times.py and elastic.py run tiny and report
figures that make sense (their full runs are scripts, not tests: see docs/benchmarks/)."""

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str, *args: str, timeout: int = 300) -> dict:
    """Run ``benchmarks/<name>.py`` with ``args``; its RESULT line as a dict of floats
    (a value that is not a number, a word such as ``graph=chat``, as its string)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return {k: _number(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def _number(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def test_raw_copy_delivers_every_byte_into_its_preallocated_buffer(monkeypatch):
    """The raw baseline: each copy lands whole in the receiver's one buffer."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # a spawned child imports it
    kv = importlib.import_module("kv_transfer")
    n = (1 << 20) + 4099  # not a multiple of a page or of recv's chunk
    raw = kv.raw_copy(n, 3)
    assert raw["sent"] == 3 * n and raw["received"] == raw["sent"]
    assert raw["intact"]  # the receiver's buffer equals what was sent (crc32)
    assert len(raw["seconds"]) == 3 and all(0 < t < 10 for t in raw["seconds"])


@pytest.mark.bench
def test_kv_transfer_tiny():
    r = _bench("kv_transfer", "--quick", "--mib", "1", "--repeats", "2", "--reps", "1",
               "--requests", "2")
    assert r["raw_bytes_ok"] == 1 and r["dask_bytes_ok"] == 1 and r["kv_mib"] == 1
    for k in ("raw_gibps_1", "tcp_gibps_1", "pd_vs_raw_tcp", "pd_vs_colo_prefill",
              "pd_vs_colo_decode", "rps_pd_prefill", "rps_colo_decode"):
        assert 0 < r[k] < math.inf, (k, r)
    # the RESULT line has 3 decimals: their rounding on top of 1 % (a loaded machine
    # moves 1 MiB at a few hundredths of a GiB/s, where 0.0005 is over 1 %)
    tol = 0.01 + 0.0005 / r["tcp_gibps_1"] + 0.0005 / r["raw_gibps_1"]
    assert math.isclose(r["pd_vs_raw_tcp"], r["tcp_gibps_1"] / r["raw_gibps_1"],
                        rel_tol=tol), r
    # the tiny model (2 layers, K and V of 128 fp32 per token) moves 2 KiB per prompt
    # token: 384 for the prefill-heavy shape, 16 for the decode-heavy one
    assert r["kv_kib_per_req_prefill"] == 768 and r["kv_kib_per_req_decode"] == 32
    assert 0 < r["prefix_reuse"] <= 1 and 0 <= r["prefix_reuse_nosticky"] <= 1


@pytest.mark.bench
def test_reward_pool_tiny():
    from rollart.reward.offload import ServerlessConfig

    r = _bench("reward_pool", "--steps", "2", "--kinds", "threads", "--judge-hidden",
               "64", "--judge-layers", "1")
    default = ServerlessConfig()
    assert r["idle_timeout"] == default.idle_timeout and r["max_batch"] == default.max_batch
    for side in ("dedicated", "serverless"):
        assert 0 < r[f"busy_{side}_threads"] <= 1, r
    # the dedicated worker was up before the run and held to its end (never retired)
    assert r["cold_starts_dedicated_threads"] == 0
    assert 0.9 * r["run_s_dedicated_threads"] <= r["worker_s_dedicated_threads"] \
        <= r["run_s_dedicated_threads"] + 0.01
    # the serverless pool started at least one worker, held no longer than its run
    assert r["cold_starts_threads"] >= 1
    assert 0 < r["worker_s_serverless_threads"] <= r["run_s_serverless_threads"] + 1
    assert math.isclose(r["worker_s_ratio_threads"], r["worker_s_serverless_threads"]
                        / r["worker_s_dedicated_threads"], rel_tol=0.01)


@pytest.mark.bench
def test_tool_sandbox_tiny():
    """Both sandboxes answered every call right and built the same warm-up batches (the
    script checks both), and the speed-ups are the ratios of the figures it printed."""
    r = _bench("tool_sandbox", "--quick")
    for side in ("fresh", "zygote"):
        for k in ("seq_ms", "cpu_ms", "par_calls_s", "calc_batches_s"):
            assert 0 < r[f"{k}_{side}"] < math.inf, (k, side, r)
    assert math.isclose(r["seq_speedup"], r["seq_ms_fresh"] / r["seq_ms_zygote"], rel_tol=0.02)
    assert math.isclose(r["par_speedup"], r["par_calls_s_zygote"] / r["par_calls_s_fresh"],
                        rel_tol=0.02)
    assert math.isclose(r["calc_speedup"],
                        r["calc_batches_s_zygote"] / r["calc_batches_s_fresh"], rel_tol=0.02)
    assert r["blocks"] == 1


@pytest.mark.bench
def test_trainer_gang_tiny():
    r = _bench("trainer_gang", "--quick", timeout=600)
    assert r["steps"] == 2 and r["rows"] == 16 and r["params_m"] > 0
    assert r["gang_step_s_1"] > 0 and r["gang_step_s_1t2"] > 0 and r["gang_step_s_2"] > 0
    assert math.isclose(r["gang_step_ratio"], r["gang_step_s_1"] / r["gang_step_s_2"],
                        rel_tol=0.02)
    assert math.isclose(r["gang_step_ratio_t2"], r["gang_step_s_1t2"] / r["gang_step_s_2"],
                        rel_tol=0.02)
    assert r["model"] == "tiny" and r["row_tokens"] > 0
    for side in ("1", "1t2", "2"):
        assert r[f"train_tok_s_{side}"] > 0, r
    # fresh processes a side: each peak is a loaded trainer's, well over an idle worker's
    for k in ("peak_rss_mb_1", "peak_rss_mb_1t2", "peak_rss_mb_2_rank0",
              "peak_rss_mb_2_rank1"):
        assert 100 < r[k] < 10_000, (k, r)


@pytest.mark.bench
@pytest.mark.parametrize("inflight", [1, 2, "auto"])
def test_limits_tiny(inflight):
    """A run of the default graph, both bare loops and the replay of its request stream:
    the ratios are those of the figures it printed, the replay served exactly the
    requests and tokens the run's log recorded, and the shares split one capacity; the
    in-flight budget it reports is the one the steps ran under (with "auto": one to
    alpha + 1 = 2 steps' worth; that run on ``resources/laptop_engine.py``, the engine in
    a worker of its own, whose request log the probe reads there)."""
    extra = ["--max-in-flight", str(inflight)] if inflight != 1 else []
    layout = "laptop_engine" if inflight == "auto" else "laptop"
    r = _bench("limits", "--tiny", *extra, "--resources", layout, timeout=300)
    assert r["steps"] == 3 and r["groups"] == 2 and r["cores"] >= 1
    assert r["resources"] == layout
    if inflight == "auto":
        assert 1 <= r["inflight"] <= 2, r
    else:
        assert r["inflight"] == inflight
    assert r["threads_infer"] >= 1 and r["threads_train"] >= 1
    for k in ("run_tok_s", "run_tok_s_busy", "bare_tok_s", "run_train_tok_s",
              "run_train_tok_s_wait", "bare_train_tok_s", "window_s", "live_batch",
              "gen_len", "context", "prefill", "share_inference", "share_trainer",
              "control_share", "rollout_vs_replay", "rollout_vs_replay_cpu",
              "useful_share", "useful_gen_share", "useful_train_share", "replay_tok_s",
              "replay_tok_s_cpu", "run_tok_s_cpu", "replay_live_batch", "replay_prefill",
              "rollout_vs_replay_free", "replay_free_tok_s", "replay_free_live_batch"):
        assert 0 < r[k] < math.inf, (k, r)
    # the replay did the recorded work: every logged request, every token
    assert r["logged_requests"] > 0 and r["logged_tokens"] >= r["logged_requests"]
    assert r["replay_requests"] == r["logged_requests"], r
    assert r["replay_tokens"] == r["logged_tokens"], r
    assert r["replay_free_requests"] == r["logged_requests"], r
    assert r["replay_free_tokens"] == r["logged_tokens"], r
    assert r["replay_lag_s"] >= 0 and r["run_abandoned"] >= 0
    # useful work: both parts at bare speed, over the window's capacity (< 1 + noise)
    assert r["useful_share"] < 1.5, r
    assert math.isclose(r["useful_share"], r["useful_gen_share"] + r["useful_train_share"],
                        rel_tol=0.01), r
    gen = r["logged_tokens"] / r["bare_tok_s"] * r["threads_infer"]
    assert math.isclose(r["useful_gen_share"], gen / (r["window_s"] * r["cores"]),
                        rel_tol=0.01), r
    for ratio, num, den in (("rollout_vs_replay", "run_tok_s_busy", "replay_tok_s"),
                            ("rollout_vs_replay_cpu", "run_tok_s_cpu", "replay_tok_s_cpu"),
                            ("rollout_vs_replay_free", "run_tok_s_busy", "replay_free_tok_s"),
                            ("rollout_vs_bare", "run_tok_s", "bare_tok_s"),
                            ("rollout_vs_bare_busy", "run_tok_s_busy", "bare_tok_s"),
                            ("trainer_vs_bare", "run_train_tok_s", "bare_train_tok_s")):
        assert math.isclose(r[ratio], r[num] / r[den], rel_tol=0.01), (ratio, r)
    # busy time within the window's wall time; a wait within the step
    assert r["run_tok_s_busy"] >= 0.95 * r["run_tok_s"]
    assert r["run_train_tok_s"] >= r["run_train_tok_s_wait"]
    assert 0 <= r["trainer_wait"] <= 1 and r["prefill"] <= r["context"]
    shares = [v for k, v in r.items() if k.startswith("share_")] + [r["control_share"]]
    assert math.isclose(sum(shares), 1.0, abs_tol=0.01), r


@pytest.mark.bench
def test_weight_sync_tiny():
    r = _bench("weight_sync", "--updates", "1", "--hidden", "64", "--layers", "1",
               "--load", "2", "--prompt", "32", "--turns", "2", "--batch", "4",
               "--settle", "0.5", "--lora", "8", timeout=600)
    assert r["context"] == 32 + 2 * (32 + 32) and r["updates"] == 1
    for k in ("tok_s_base_a", "tok_s_base_b", "tok_s_fsspec", "tok_s_keep", "tok_s_mooncake",
              "tok_s_lora8", "trainer_step_s", "trainer_step_s_lora8", "params_m",
              "rss_peak_mib_full", "rss_peak_mib_lora8"):
        assert r[k] > 0, (k, r)
    assert math.isclose(r["tok_s_base"], (r["tok_s_base_a"] + r["tok_s_base_b"]) / 2,
                        rel_tol=0.01)
    assert r["model"] == "tiny"
    # a version's cost on each side: the trainer's put, the worker's pull + swap
    assert r["publish_s"] == r["put_s_fsspec"]
    assert math.isclose(r["update_s_fsspec"], r["update_s"], rel_tol=1e-3)
    assert math.isclose(r["update_s"], r["fetch_s_fsspec"]
                        + r["engine_stall_ms_fsspec"] / 1000, rel_tol=0.01, abs_tol=1e-3)
    # the two modes side by side: recompute is the fsspec run; keep re-prefills nothing
    assert r["stall_recompute"] == r["stall_fsspec"] and r["recompute_tokens_keep"] == 0
    for s in ("fsspec", "keep", "mooncake", "lora8"):
        assert math.isclose(r[f"stall_{s}"], 1 - r[f"tok_s_{s}"] / r["tok_s_base"],
                            rel_tol=0.01, abs_tol=1e-3)
        assert r[f"put_s_{s}"] > 0  # the trainer did publish to this store
    assert r["engine_stall_ms_lora8"] >= 0 and r["swaps_lora8"] >= 0
    # Mooncake's stall split: watching it (idle run against the baseline), its updates
    # (against the idle run); every run watched its store
    assert math.isclose(r["stall_mooncake_idle"], 1 - r["tok_s_mooncake_idle"] / r["tok_s_base"],
                        rel_tol=0.01, abs_tol=1e-3)
    assert math.isclose(r["stall_mooncake_updates"],
                        1 - r["tok_s_mooncake"] / r["tok_s_mooncake_idle"],
                        rel_tol=0.01, abs_tol=1e-3)
    # looks at the store are timed (a window this short may hold none: the watch looks
    # once per 0.25 s; its rate is tested in tests/rollout/test_inference_worker.py)
    for s in ("base_a", "fsspec", "mooncake_idle", "mooncake"):
        assert r[f"watches_s_{s}"] >= 0 and r[f"watch_cpu_ms_{s}"] >= 0, (s, r)
        assert (r[f"watch_ms_{s}"] > 0) == (r[f"watches_s_{s}"] > 0), (s, r)
    # the adapter alone is published: fewer bytes than every weight
    assert 0 < r["bytes_lora8"] < r["bytes_full"]
    assert math.isclose(r["bytes_ratio_lora8"], r["bytes_lora8"] / r["bytes_full"],
                        rel_tol=0.01)
    for c in ("full", "lora8"):  # the peak is over the loaded model, never under
        assert 0 <= r[f"rss_train_mib_{c}"] < r[f"rss_peak_mib_{c}"], (c, r)
    # fan-out: K readers through the relay; K = 1 reads every byte from the origin (plus
    # the manifest), more readers share one copy of it (16 buckets: each read once)
    assert r["fanout_mib"] > 0 and r["fanout_buckets"] > 1
    for k in (1, 2, 4, 8):
        assert r[f"fanout_s_{k}"] > 0 and r[f"fanout_s_{k}_norelay"] > 0, (k, r)
        assert math.isclose(r[f"fanout_speedup_{k}"],
                            r[f"fanout_s_{k}_norelay"] / r[f"fanout_s_{k}"], rel_tol=0.01)
    assert 1 <= r["origin_bytes_ratio_1"] < 1.05
    for k in (2, 4, 8):
        assert r[f"origin_bytes_ratio_{k}"] < 1.5 / k + 0.05, (k, r)
    assert r["origin_bytes_ratio_8"] <= 0.3


def test_calc_copy_scores_a_turn_by_what_it_holds_of_the_question(monkeypatch):
    """benchmarks/calc_copy.py's scoring of one generated turn (the Hermes call format)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from calc_copy import score

    from rollart.chat.tools import format_tool_call

    right = score(format_tool_call("python", {"code": "4 - 6"}), "4 - 6")
    assert right == {"calls": True, "copies": True, "digit1": True, "op": True,
                     "digit2": True}
    wrong = score(format_tool_call("python", {"code": "4 + 8"}), "4 - 6")
    assert wrong == {"calls": True, "copies": False, "digit1": True, "op": False,
                     "digit2": False}
    answer = score("answer 7", "4 - 6")
    assert not any(answer.values())


@pytest.mark.bench
@pytest.mark.parametrize("variant, steps", [((), 4), (("--also-bare",), 4),
                                            (("--only", "calc", "--bare-first", "2"), 6),
                                            (("--bare-tool-steps", "2"), 6)])
def test_calc_copy_tiny(variant, steps):
    r = _bench("calc_copy", "--steps", "4", "--every", "2", "--probes", "4", *variant)
    assert r["steps"] == steps and r["probes"] == 4  # a curriculum's first stage counts
    for k in ("calls", "copies", "digit1", "op", "digit2", "answers"):
        assert 0 <= r[k] <= 4, (k, r)
    assert r["copies"] <= min(r["calls"], r["digit1"], r["op"], r["digit2"]), r


def test_calc_copy_bare_calc_puts_the_question_near_the_call(monkeypatch, tmp_path):
    """``--no-tools``: calc with its tool undeclared renders no system turn, so the question
    sits a few dozen tokens before the demonstrated call instead of ~250 (the graph's)."""
    import random

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.syspath_prepend(str(ROOT))
    from calc_copy import bare_calc_task

    from graphs.chat import tasks as chat_tasks
    from rollart.chat.conversation import ConversationFormat
    from rollart.corpus import chat_corpus
    from rollart.model import build_tiny_model, load_tokenizer
    from rollart.trainer.warmup import play_random

    tasks = chat_tasks()
    calc = next(t for t in tasks if t.name == "calc")
    tok = load_tokenizer(build_tiny_model(tmp_path / "toy", chat_corpus(tasks), chat=True))
    fmt = ConversationFormat(tok, "chat", max_context=2048)
    real = tok.decode(play_random(calc, tok, 3, random.Random(3), fmt).ids)
    bare = tok.decode(play_random(bare_calc_task(calc), tok, 3, random.Random(3), fmt).ids)
    call = '"arguments": {"code": "'
    assert "<|im_start|>system" in real and "<|im_start|>system" not in bare
    assert call in real and call in bare
    assert bare.index(call) < 200 < real.index(call) - bare.index(call)


@pytest.mark.bench
def test_agent_endpoint_tiny():
    r = _bench("agent_endpoint", "--quick", timeout=600)
    assert r["agents"] == 4 and r["calls"] == 2 and r["rounds"] == 1
    assert r["call_ms_direct"] > 0 and r["call_ms_endpoint"] > 0
    assert math.isclose(r["endpoint_overhead"] + 1,
                        r["call_ms_endpoint"] / r["call_ms_direct"], rel_tol=0.02)
    assert r["traj_s_env"] > 0 and r["traj_s_agent"] > 0


@pytest.mark.bench
def test_inflight_learning_tiny():
    """benchmarks/inflight_learning.py --quick: a short warm-up, each in-flight setting
    trained a few steps and evaluated against the warm-up policy on the same seeds."""
    r = _bench("inflight_learning", "--quick", timeout=900)
    for s in ("one", "two", "two_start"):
        for k in (f"gain_{s}", f"gridnav_{s}", f"guess_{s}", f"boxpush_{s}", f"worst_{s}"):
            assert -1 <= r[k] <= 1, (k, r)
        assert r[f"worst_{s}"] <= r[f"gain_{s}"] + 1e-9, r  # the smallest task gain
    assert r["seeds"] == 1 and r["steps"] == 4 and 0 <= r["warm_gridnav"] <= 1


@pytest.mark.bench
def test_inflight_learning_chat_tiny():
    """benchmarks/inflight_learning.py --graph chat --quick: the chat graph's own warm-up
    on the seed (a one-step run whose warm-up model is kept), then two settings' RL runs
    from it (today's default and the candidate ``new``: "auto" in flight, stale members
    re-scored), calc included, evaluated against it on the same seeds."""
    r = _bench("inflight_learning", "--graph", "chat", "--quick", "--settings",
               "one,new", timeout=900)
    for s in ("one", "new"):
        for t in ("gridnav", "guess", "boxpush", "calc"):
            assert -1 <= r[f"{t}_{s}"] <= 1, (t, s, r)
        assert r[f"worst_{s}"] <= r[f"gain_{s}"] + 1e-9, r
    assert "gain_two" not in r and r["graph"] == "chat" and r["steps"] == 3, r
    assert 0 <= r["warm_calc"] <= 1


def test_real_model_curve_is_drawn_from_the_newest_full_records(tmp_path, monkeypatch):
    """``real_model.py --plot``: the newest full record of each method (a ``--quick``
    record is skipped), one panel per task; no full record is one line, exit."""
    import json

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    real_model = importlib.import_module("real_model")
    tasks = ("guess_number", "calculator")

    def rec(method, command, steps):
        runs = [{"after": {t: 0.3 for t in tasks},
                 "reward": {f"success/{t}": [0.1 * (i % 3)] * steps for t in tasks}}
                for i in range(3)]
        return {"command": command, "method": method, "runs": runs, "eval_seeds": 128,
                "before": {t: 0.2 for t in tasks}}

    records = tmp_path / "real_model.jsonl"
    records.write_text(json.dumps(rec("lora", "real_model.py --quick", 2)) + "\n")
    with pytest.raises(SystemExit, match="no full record"):
        real_model.plot(tmp_path / "c.png", records)
    with open(records, "a") as f:
        for r in (rec("lora", "real_model.py --method lora", 40),
                  rec("full", "real_model.py --method full", 40)):
            f.write(json.dumps(r) + "\n")
    out = real_model.plot(tmp_path / "c.png", records)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.bench
def test_setup_times_quick():
    """The README's main job (2 steps) and its doc test, timed: both exit 0, the run's
    held-out figures per task are read from its eval.json."""
    r = _bench("setup_times", "--quick", timeout=600)
    assert r["failed"] == "none" and r["main_rc"] == 0 and r["suite_rc"] == 0, r
    assert r["main_s"] > 0 and r["suite_s"] > 0 and r["suite_passed"] >= 1, r
    for task in ("gridnav", "guess", "boxpush"):
        assert 0 <= r[f"heldout_warm_{task}"] <= 1 and 0 <= r[f"heldout_after_{task}"] <= 1


@pytest.mark.bench
def test_elastic_quick():
    """An inference pool grown 1 -> 2 and shrunk back mid-run (in-process): the new
    worker serves, the shrink leaves nothing to re-run, and the audit, apart from the
    ledger, finds nothing lost or duplicated."""
    r = _bench("elastic", "--quick", timeout=600)
    assert r["lost"] == 0 and r["duplicated"] == 0, r
    assert r["steps"] == 12 and r["groups_left_by_shrink"] == 0, r
    assert 0 < r["join_to_first_request_s"] < math.inf, r
    assert r["grow_step"] <= r["joined_step"] <= r["shrink_step"], r  # may serve in that step
    for k in ("tps_before", "tps_during", "tps_after"):
        assert r[k] > 0, (k, r)


def test_the_full_strength_bare_train_step_makes_the_textbook_update(monkeypatch, tiny_model):
    """limits.py's bare trainer shares a group's prompt and keeps only the loss's logits,
    as rollart's trainer does: its update is the textbook loop's (whole sequences, every
    logit) within float rounding. Plain SGD, so the update is the gradient itself: under
    AdamW's first step (g / (|g| + eps)) a gradient near eps turns a rounding difference
    of 1e-9 into a visible step, and the comparison then depended on the CPU's kernels."""
    import copy

    from rollart import GRPO
    from rollart.model import load_model
    from rollart.testing import random_batch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _bare_loops as bare

    m0 = load_model(tiny_model)
    algo = GRPO(group_size=3, groups_per_step=3, lr=1e-2, kl_coef=0.05,
                micro_batch_tokens=60)
    batch = random_batch(m0.config.vocab_size, groups=3, size=3, shared_prompt=True, seed=1)
    out = []
    for step in (bare._train_step, bare._full_step):
        m, ref = copy.deepcopy(m0).train(), copy.deepcopy(m0).eval()
        opt = torch.optim.SGD(m.parameters(), lr=algo.lr)
        step(m, ref, opt, batch, algo, 1.0)
        out.append(m.state_dict())
    diff = max(float((out[0][k] - out[1][k]).abs().max()) for k in out[0])
    moved = max(float((out[1][k] - v).abs().max()) for k, v in m0.state_dict().items())
    assert moved > 0 and diff < 1e-3 * moved, (diff, moved)
