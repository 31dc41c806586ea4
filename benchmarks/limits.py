"""Distance to the physical limit on this machine (issue 42 item 5, issue 51 item 3):
how close a real rollart run gets to bare PyTorch on the same cores, to its own request
stream replayed into the bare engine, and where the rest of its time goes.

**The run.** The default graph (``graphs/multitask.py``, what ``python -m rollart train``
runs; with ``--model``, ``graphs/real.py``: below), async mode, on ``resources/laptop.py`` with one inference pool (as
``benchmarks/pipeline.py`` runs it: one worker process for rollout, envs and rewards, one
for the trainer and the buffer; the Dask scheduler in this process), from the built-in
model after its format warm-up (``pipeline.cached_warm_model``, shared with the pipeline
benchmark). Settings are fixed below (``QUICK``, ``FULL``, ``TINY``): ``steps`` trainer
steps of ``groups`` groups of 8. Everything is measured over a *window*: from the
metrics row of step 1 to the row of the last step (start-up, the first generation and
the first trainer step are outside it). At both ends the probe keeps the actors' stats
the row was made from and a CPU snapshot of every process (``/proc``: per thread, by
thread name, and the process total).

**Rollout.** ``run_tok_s`` = tokens the engine generated in the window ÷ the window's
wall seconds (the headline: the rollout worker's throughput as the run saw it);
``run_tok_s_busy`` = the same tokens ÷ the engine's busy seconds (inside its serve
loop). The bare loop (``_bare_loops.bare_generate``) runs afterwards, alone, on as many
torch threads as the run gave the inference worker, with the same model, the engine's
forward kind (lean or ``DynamicCache``) and the run's own shape: batch = the run's mean
live batch (tokens ÷ decode steps), new tokens per row = tokens ÷ requests, context =
prompt tokens ÷ requests, of which the part the engine forwarded (prefill tokens ÷
requests) is prefilled on the clock and the rest sits in the KV cache beforehand (the
engine's prefix cache). ``rollout_vs_bare`` = ``run_tok_s`` ÷ ``bare_tok_s``;
``rollout_vs_bare_busy`` = ``run_tok_s_busy`` ÷ ``bare_tok_s``.

**Rollout against its own request stream (issue 51).** Over the window the inference
worker keeps a request log (``InferenceWorker.start_request_log``, started by the probe
at step 1 and read back at the last step through ``Client.run``): each request that
arrived in the window and finished normally, with its arrival time, prompt ids, the part
of the prompt its prefix cache held, the tokens it generated and its sampling settings.
After the run that stream is replayed (``_replay.replay``) into the *bare engine*: a
fresh ``TorchEngine`` with the worker's engine settings, driven by its own serve loop in
this process on the worker's torch threads, without Dask, actors, the worker's queue
and thread, env managers, rewards, the trainer, weight updates or an event loop. Each
request joins no earlier than it arrived, forwards the prompt tokens the run forwarded
(its cached prefix is primed first) and generates exactly the recorded tokens (stops
that cannot fire, checked at the same cost); no re-prefills after weight swaps, no
aborted work. ``replay_requests`` / ``replay_tokens`` must equal ``logged_requests`` /
``logged_tokens`` (else the script fails). The engine, not a hand-written loop, so the
replay does the run's work (arrivals, continuous batching, prefix reuse, each request's
sampler and stop checks) and the ratio isolates what the framework costs it.

Two clocks, both reported: the arrivals pace both sides, so wall-clock rates agree by
construction. ``rollout_vs_replay`` = ``run_tok_s_busy`` ÷ ``replay_tok_s`` (tokens per
second of the engine's serve loop, run ÷ replay): it counts against the run the
engine's per-request work in the worker, weight swaps and re-prefills, and the time the
engine thread waits for the GIL or a core while busy (the event loops', the control
plane's, also the trainer's process). ``rollout_vs_replay_cpu`` = ``run_tok_s_cpu`` ÷
``replay_tok_s_cpu`` (tokens per CPU second of the engine thread): the issue's "same CPU
share", the engine given exactly the CPU it got; it leaves those waits out, so it is the
kinder of the two. Both are kind to the run where the replay batches less than the run
did (an engine alone finishes rows sooner, so fewer are live at once:
``replay_live_batch`` against ``live_batch``). The same stream replayed *free* of its
arrivals (all of it there from the start, in arrival order, ``max_batch`` at a time)
bounds that from the other side: ``rollout_vs_replay_free`` = ``run_tok_s_busy`` ÷
``replay_free_tok_s``, which also counts against the run the smaller batches its
arrivals allowed (``replay_free_live_batch``).

**Useful work.** ``useful_share`` = (``logged_tokens`` ÷ ``bare_tok_s`` × the inference
threads + the window's trained tokens ÷ ``bare_train_tok_s`` × the trainer's threads) ÷
(``window_s`` × ``cores``): the core-seconds the window's generation and training would
take at bare speed, over the machine's capacity (threads 1 each on ``laptop``). Useful
generation is the logged requests' tokens, with the prefill the bare loop's shape
counts; re-prefills after weight swaps, aborted requests and requests in flight at
either end of the window are not counted (``useful_gen_share``, ``useful_train_share``:
the two parts).

**Trainer.** ``run_train_tok_s`` = trained tokens (``trainer/tokens``) of the window's
steps ÷ their ``trainer/step_s`` less ``trainer/wait_s`` (the step as the trainer
computes and publishes it, without waiting for its batch); ``run_train_tok_s_wait`` counts
the wait too. The bare loop (``_bare_loops.bare_train``) trains the very batches those
steps trained (read back from the run's samples by ``trained_step``), from the same
model, on as many threads as the run's trainer: forward, backward, clip, AdamW (and the
KL reference's forward: the default graph has ``kl_coef > 0``), at the trainer's full
strength: the same micro-batches, a group's shared prompt computed once and only the
loss's columns through the head (``logits_to_keep``), as issue 51 asked. (Records before
2026-12-06 19:10 held the run against the textbook loop without those two, which the
run could beat.) ``trainer_vs_bare`` = ``run_train_tok_s`` ÷ ``bare_train_tok_s``.

**Where the rest goes.** Capacity = the window's wall seconds × ``cores``. Each
``share_*`` is CPU seconds ÷ capacity: ``inference`` (the engine thread),
``trainer`` (the trainer's compute thread), ``env`` (env step threads), ``reward``
(reward threads), ``render`` (rendering and tokenising turns on the rollout worker's
event loop: ``EnvManager.stats()["render_cpu_s"]``), ``loop`` (the rest of the workers'
event loops: actor calls, the proxy, the buffer, Dask comm), ``other`` (weight
prefetch and bucket threads, buffer I/O, Dask's own threads, native threads and threads
that ended in the window) and ``control_share``: the CPU seconds of this driver process
(the control loop, the Dask scheduler, which runs in it, and the run's monitor) and of
the workers' nanny processes, ÷ capacity. ``share_idle`` = 1 − the sum (capacity the
run left unused; another load on the machine shows here). Waiting, as fractions of the
window's wall time: ``inference_idle`` (the engine outside its serve loop),
``trainer_idle`` (not computing or publishing a step), ``trainer_wait`` (inside a step,
waiting for its batch).

Other RESULT keys: ``run_requests`` (the engine's admissions in the window),
``run_abandoned`` (requests their callers aborted in it: their tokens count in the run's
rates, not in the replay's),
``replay_lag_s`` (mean wait past a request's arrival in the replay), ``replay_prefill``
(prompt tokens it forwarded per request; the run's: ``prefill``), ``replay_free_tok_s``,
``replay_free_requests``, ``replay_free_tokens``, ``bare_tok_s``,
``bare_train_tok_s``, ``live_batch``, ``gen_len``,
``context``, ``prefill`` (the bare loop's shape), ``window_s``, ``steps``, ``groups``,
``threads_infer``, ``threads_train``, ``cores``, ``graph`` (the graph's name) and
``model`` (``built-in`` or what ``--model`` named). The record also keeps every snapshot
delta. Run it alone on an idle machine::

    flock /tmp/rollart-bench.lock python benchmarks/limits.py
    python benchmarks/limits.py --quick     # a smoke run (~2 minutes on 2 cores)

**On a pretrained model** (``--model smollm2-135m-instruct``, or a model folder): the run
is ``graphs/real.py`` (full fine-tuning, async, its own 4 groups of 8 a step) on that
model, measured by the same probe and bare loops (given the model's folder); no format
warm-up (a pretrained model has none). Sized before any run (``REAL``): 4 steps (the
window: steps 2 to 4) and 2,000 bare tokens, about 12 minutes on 2 cores, where a step of
that graph costs about a minute::

    flock /tmp/rollart-bench.lock python benchmarks/limits.py --model smollm2-135m-instruct

``--max-in-flight 2`` runs the same with two steps' worth of groups in flight (a
diagnostic: with one, rollout waits for the trainer to free slots; ``inflight`` in the
RESULT line says which).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _results.py, pipeline.py

from _results import Run, add_arguments  # noqa: E402
from pipeline import WARM_CACHE  # noqa: E402

# sized before any measurement (a step of the default graph takes about a second on 2
# cores): --quick ~2 minutes (its warm model cached), the full run ~5; --tiny is the smoke
# test's (the untrained model). groups None: the graph's (12)
QUICK = {"steps": 12, "groups": None, "warmup_steps": 60, "bare_tokens": 10000}
FULL = {"steps": 60, "groups": None, "warmup_steps": None, "bare_tokens": 50000}
TINY = {"steps": 3, "groups": 2, "warmup_steps": 0, "bare_tokens": 500}
#: ``--model``: graphs/real.py on a pretrained model (no format warm-up: it has none), its
#: own groups (4 of 8); a step of it costs about a minute on 2 cores, so 4 steps (the
#: window: steps 2-4) and a short bare generation: about 12 minutes in all
REAL = {"steps": 4, "groups": None, "warmup_steps": 0, "bare_tokens": 2000}
#: thread name prefix -> share (``cpu_delta``); every other Python thread is "other"
THREADS = (("rollart-engine", "inference"), ("rollart-trainer", "trainer"),
           ("rollart-env", "env"), ("rollart-sandbox", "env"), ("rollart-reward", "reward"),
           ("MainThread", "loop"))
SHARES = ("inference", "trainer", "env", "reward", "render", "loop", "other")


def cpu_snapshot() -> dict:
    """This process's CPU seconds: in all, and per live thread ``{tid: (name, s)}``
    (a thread Python did not start is ``native``). Linux ``/proc``; runs in every
    process of the cluster (``Client.run``)."""
    import os
    import threading

    tick = os.sysconf("SC_CLK_TCK")

    def cpu(path: str) -> float:
        fields = open(path).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    names = {t.native_id: t.name for t in threading.enumerate()}
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            threads[int(tid)] = (names.get(int(tid), "native"),
                                 cpu(f"/proc/self/task/{tid}/stat"))
    return {"process": cpu("/proc/self/stat"), "threads": threads}


def thread_group(name: str) -> str:
    return next((g for prefix, g in THREADS if name.startswith(prefix)), "other")


def cpu_delta(a: dict, b: dict, group=thread_group) -> dict[str, float]:
    """CPU seconds between two ``cpu_snapshot``s of one process, by ``group(thread
    name)``; ``exited``: the process's rest (threads that ended in between)."""
    out: dict[str, float] = defaultdict(float)
    for tid, (name, s) in b["threads"].items():
        before = a["threads"].get(tid)
        s0 = before[1] if before is not None and before[0] == name else 0.0
        out[group(name)] += s - s0
    out["exited"] = b["process"] - a["process"] - sum(out.values())
    return dict(out)


class Probe:
    """Wraps ``rollart.control.loop.step_row`` for one run: at steps ``1`` and ``last``
    keeps the row, the actors' stats it was made from and a CPU snapshot of this
    process, every worker and every nanny (two ``Client.run`` broadcasts each); the
    inference workers' request logs run from the first to the last (``logs``)."""

    def __init__(self, client, last: int):
        self.client, self.last, self.marks = client, last, {}

    @contextlib.contextmanager
    def installed(self):
        from rollart.control import loop
        from rollart.rollout.request_log import start_request_logs, take_request_logs

        real = loop.step_row

        def step_row(trainer, sample, **kwargs):
            row = real(trainer, sample, **kwargs)
            if row["step"] in (1, self.last):
                self.marks[row["step"]] = {
                    "row": row, "workers": [s for _, _, s in sample.workers],
                    "managers": list(sample.managers), "at": time.perf_counter(),
                    "driver": cpu_snapshot(), "cluster": self.client.run(cpu_snapshot),
                    "nannies": self.client.run(cpu_snapshot, nanny=True)}
                if row["step"] == 1:
                    self.client.run(start_request_logs)
                else:
                    self.marks[row["step"]]["logs"] = [
                        log for logs in self.client.run(take_request_logs).values()
                        for log in logs]
            return row

        loop.step_row = step_row
        try:
            yield self
        finally:
            loop.step_row = real


def run_graph(client, a, model: str, run_dir: Path) -> tuple:
    """Train the run's graph (module doc) with the probe in; (graph, rows, marks)."""
    import rollart

    base, _ = rollart.load_graph(a.graph)
    graph = replace(base, steps=a.steps, seed=a.seed,
                    policy=replace(base.policy, model=model),
                    algo=replace(base.algo, groups_per_step=a.groups or base.algo.groups_per_step,
                                 alpha=None),
                    rollout=replace(base.rollout, inference_pools=("H800",),
                                    max_in_flight=a.max_in_flight))
    probe = Probe(client, graph.steps)
    with probe.installed():
        result = rollart.train(graph, client=client, run_dir=run_dir, progress=False,
                               eval_seeds=0)
    if set(probe.marks) != {1, graph.steps}:
        raise RuntimeError(f"the probe saw steps {sorted(probe.marks)}, not 1 and "
                           f"{graph.steps}")
    return graph, result.metrics, probe.marks


def window(graph, rows: list[dict], marks: dict) -> dict:
    """The run's figures over the window (module doc)."""
    first, last = marks[1], marks[graph.steps]
    wall = last["row"]["time"] - first["row"]["time"]

    def d(key: str, side: str = "workers") -> float:
        return sum(s.get(key, 0) for s in last[side]) - sum(s.get(key, 0) for s in first[side])

    tokens, requests = d("tokens_generated"), max(d("requests"), 1)
    steps = [r for r in rows if 1 < r["step"] <= graph.steps]
    step_s = sum(r["trainer/step_s"] for r in steps)
    wait_s = sum(r["trainer/wait_s"] for r in steps)
    trained = sum(r["trainer/tokens"] for r in steps)
    out = {"window_s": wall, "tokens": tokens, "busy_s": d("busy_seconds"),
           "requests": d("requests"), "abandoned": d("abandoned"),
           "run_tok_s": tokens / wall, "run_tok_s_busy": tokens / max(d("busy_seconds"), 1e-9),
           "live_batch": tokens / max(d("decode_steps"), 1), "gen_len": tokens / requests,
           "context": d("prefix_prompt_tokens") / requests,
           # forwarded by prefills, less re-prefills after weight swaps (not the bare
           # loop's work)
           "prefill": (d("prefill_tokens") - d("recompute_tokens")) / requests,
           "train_tokens": trained, "train_steps": [r["step"] for r in steps],
           "run_train_tok_s": trained / max(step_s - wait_s, 1e-9),
           "run_train_tok_s_wait": trained / max(step_s, 1e-9),
           "inference_idle": 1 - d("busy_seconds") / wall,
           "trainer_idle": 1 - (step_s - wait_s) / wall, "trainer_wait": wait_s / wall,
           "render_cpu_s": d("render_cpu_s", "managers"), "env_s": d("env_s", "managers")}
    return out


def breakdown(marks: dict, first: int, last: int, render_s: float, cores: int) -> dict:
    """``share_*`` and ``control_share`` (module doc) from the two ends' snapshots."""
    a, b = marks[first], marks[last]
    capacity = (b["at"] - a["at"]) * cores
    cpu: dict[str, float] = defaultdict(float)
    for addr, snap in b["cluster"].items():
        if addr in a["cluster"]:
            for k, v in cpu_delta(a["cluster"][addr], snap).items():
                cpu[k] += v
    driver = b["driver"]["process"] - a["driver"]["process"]
    nannies = sum(snap["process"] - a["nannies"][addr]["process"]
                  for addr, snap in b["nannies"].items() if addr in a["nannies"])
    control = driver + nannies
    cpu["render"] = render_s
    cpu["loop"] -= render_s
    cpu["other"] += cpu.pop("exited", 0.0) + cpu.pop("native", 0.0)
    out = {f"share_{k}": cpu.get(k, 0.0) / capacity for k in SHARES}
    out["control_share"] = control / capacity
    out["share_idle"] = 1 - sum(out.values())
    out["cpu_s"] = {**cpu, "control": control, "control_driver": driver,
                    "control_nannies": nannies, "capacity": capacity}
    # the driver's own threads by name (digits dropped): where the control plane's goes
    out["driver_cpu_s"] = cpu_delta(a["driver"], b["driver"],
                                    lambda name: name.rstrip("0123456789-_"))
    return out


def trained_batches(run_dir: Path, steps: list[int]) -> list[list]:
    """The trajectories each of ``steps`` trained, from the run's samples."""
    import pyarrow.compute as pc

    from rollart.buffer import read_samples
    from rollart.buffer.schema import from_table

    table = read_samples(str(run_dir))
    return [from_table(table.filter(pc.equal(table["trained_step"], s))) for s in steps]


def role_kwargs(graph, model: str, run_dir: Path) -> tuple[dict, dict]:
    """The keyword arguments the run gave its inference worker and its trainer (torch
    ``threads``; the worker's ``max_batch``, ``engine`` and ``engine_options``)."""
    from rollart.control.stages import role_specs

    specs = {s.role: s for s in role_specs(graph, model, run_dir)}
    return specs["inference"].kwargs, specs["trainer"].kwargs


def against_replay(fig: dict, cpu_s: dict, rep: dict, bare_tok_s: float,
                   bare_train_s: float, threads: tuple[int, int], cores: int) -> dict:
    """``rollout_vs_replay`` (per engine-busy second), ``rollout_vs_replay_cpu`` (per
    engine-thread CPU second), ``useful_share`` and their parts (module doc), from the
    window's figures, its CPU seconds, the replay's and the bare loops' (``bare_train_s``:
    seconds the bare trainer took for the window's batches)."""
    run_tok_s_cpu = fig["tokens"] / max(cpu_s.get("inference", 0.0), 1e-9)
    # core-seconds the window's useful work takes at bare speed
    gen = rep["logged_tokens"] / bare_tok_s * threads[0]
    train = bare_train_s * threads[1]
    capacity = fig["window_s"] * cores
    return {"rollout_vs_replay": fig["run_tok_s_busy"] / rep["tok_s"],
            "useful_share": (gen + train) / capacity,
            "rollout_vs_replay_cpu": run_tok_s_cpu / rep["tok_s_cpu"],
            "rollout_vs_replay_free": fig["run_tok_s_busy"] / rep["free_tok_s"],
            "useful_gen_share": gen / capacity, "useful_train_share": train / capacity,
            "run_tok_s_cpu": run_tok_s_cpu, "replay_tok_s": rep["tok_s"],
            "replay_tok_s_cpu": rep["tok_s_cpu"], "replay_requests": rep["requests"],
            "replay_tokens": rep["tokens"], "logged_requests": rep["logged_requests"],
            "logged_tokens": rep["logged_tokens"], "replay_live_batch": rep["live_batch"],
            "replay_lag_s": rep["lag_s"], "replay_free_tok_s": rep["free_tok_s"],
            "replay_free_live_batch": rep["free_live_batch"],
            "replay_free_requests": rep["free_requests"],
            "replay_free_tokens": rep["free_tokens"], "run_requests": fig["requests"],
            "run_abandoned": fig["abandoned"],
            # prompt tokens forwarded per request (the run's: ``prefill``)
            "replay_prefill": rep["prefill_tokens"] / max(rep["requests"], 1)}


def in_flight(text: str) -> float | str:
    """``--max-in-flight``: steps' worth of groups, or ``auto``."""
    return text if text == "auto" else float(text)


def used_in_flight(graph, rows: list[dict]) -> float:
    """The in-flight limit the run's steps ran under, in steps' worth of groups: the
    mean of the rows' ``rollout/inflight_limit`` (the buffer's; it moves with
    ``max_in_flight="auto"``), else the configured one."""
    got = [r["rollout/inflight_limit"] for r in rows if "rollout/inflight_limit" in r]
    limit = sum(got) / len(got) if got else \
        slot_capacity(graph.algo, graph.max_in_flight)
    return limit / graph.algo.groups_per_step


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (~2 minutes)")
    p.add_argument("--tiny", action="store_true",
                   help="the smoke test's size: the untrained model, 3 short steps")
    p.add_argument("--model", default=None,
                   help="a pretrained model folder or known name (smollm2-135m-instruct): "
                        "graphs/real.py on it instead of the default graph (REAL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-cache", default=None,
                   help="a folder to keep the warmed-up model in (default: the pipeline "
                        "benchmark's; '' = a temporary folder)")
    p.add_argument("--resources", default="laptop",
                   help="the layout (resources/NAME.py): laptop, or laptop_engine (the "
                        "engine in a worker of its own)")
    p.add_argument("--max-in-flight", type=in_flight, default=None,
                   help="Rollout.max_in_flight for the run, in steps' worth of groups, "
                        "or 'auto' (adapted each step; default: the graph's, one step's "
                        "worth): a diagnostic of how much the trainer's pace holds "
                        "rollout back")
    add_arguments(p)
    a = p.parse_args(argv)
    if a.model and (a.quick or a.tiny):
        p.error("--quick and --tiny are the default graph's smoke runs: leave out --model "
                "(or them)")
    for k, v in (REAL if a.model else TINY if a.tiny else QUICK if a.quick else FULL).items():
        setattr(a, k, v)
    a.graph = "real" if a.model else None
    if a.warm_cache is None:
        a.warm_cache = "" if a.tiny else WARM_CACHE
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    run = Run("limits", a, argv)
    from rollart.app.cli import quiet

    quiet()
    from distributed import Client

    import rollart
    from _bare_loops import bare_generate, bare_train
    from _replay import replay_window
    from pipeline import cached_warm_model
    from rollart.policy.admission import slot_capacity
    from rollart.runtime.resources import usable_cores

    from rollart.pretrained import resolve_model

    base, _ = rollart.load_graph(a.graph)
    warm_steps = base.policy.warmup_steps if a.warmup_steps is None else a.warmup_steps
    t_all = time.time()
    with tempfile.TemporaryDirectory(prefix="rollart-limits-") as tmp:
        if a.model:  # a pretrained model: no format warm-up
            model = resolve_model(a.model)
            print(f"model {model} (graphs/real.py)", flush=True)
        else:
            model, reused = cached_warm_model(a.warm_cache or tmp, base.tasks, warm_steps)
            print(f"model {model} ({warm_steps} warm-up steps, "
                  f"{'reused' if reused else 'built'})", flush=True)
        run_dir = Path(tmp) / "run"
        with rollart.load_resources(a.resources).make_cluster() as cluster, \
                Client(cluster) as client:
            graph, rows, marks = run_graph(client, a, model, run_dir)
        cores = usable_cores()
        fig = window(graph, rows, marks)
        shares = breakdown(marks, 1, graph.steps, fig["render_cpu_s"], cores)
        infer, train = role_kwargs(graph, model, run_dir)
        t_infer, t_train = infer["threads"], train["threads"]
        rep = replay_window(model, marks[graph.steps]["logs"], infer)
        batches = trained_batches(run_dir, fig["train_steps"])
        bare = bare_generate(
            model, batch=max(1, round(fig["live_batch"])), new=max(1, round(fig["gen_len"])),
            context=max(1, round(fig["context"])),
            prefill=max(1, min(round(fig["prefill"]), round(fig["context"]))),
            threads=t_infer, tokens=a.bare_tokens, temperature=graph.policy.temperature)
        bare_train_s = bare_train(model, batches, graph.algo, threads=t_train,
                                  temperature=graph.policy.temperature)["seconds"]
    bare_tokens = sum(sum(t.loss_mask) for batch in batches for t in batch)
    if bare_tokens != fig["train_tokens"]:
        raise RuntimeError(f"the samples' trained tokens ({bare_tokens}) are not the "
                           f"metrics' ({fig['train_tokens']})")
    bare_train_tok_s = bare_tokens / sum(bare_train_s)
    vs = against_replay(fig, shares["cpu_s"], rep, bare["tok_s"], sum(bare_train_s),
                        (t_infer, t_train), cores)
    out = {"rollout_vs_replay": vs.pop("rollout_vs_replay"),
           "useful_share": vs.pop("useful_share"),
           "trainer_vs_bare": fig["run_train_tok_s"] / bare_train_tok_s,
           "rollout_vs_bare": fig["run_tok_s"] / bare["tok_s"],
           "control_share": shares["control_share"], **vs,
           "rollout_vs_bare_busy": fig["run_tok_s_busy"] / bare["tok_s"],
           "run_tok_s": fig["run_tok_s"], "run_tok_s_busy": fig["run_tok_s_busy"],
           "bare_tok_s": bare["tok_s"], "run_train_tok_s": fig["run_train_tok_s"],
           "run_train_tok_s_wait": fig["run_train_tok_s_wait"],
           "bare_train_tok_s": bare_train_tok_s,
           **{k: v for k, v in shares.items() if k.startswith("share_")},
           "inference_idle": fig["inference_idle"], "trainer_idle": fig["trainer_idle"],
           "trainer_wait": fig["trainer_wait"], "live_batch": fig["live_batch"],
           "gen_len": fig["gen_len"], "context": fig["context"], "prefill": fig["prefill"],
           "window_s": fig["window_s"], "steps": graph.steps,
           "groups": graph.algo.groups_per_step, "threads_infer": t_infer,
           "threads_train": t_train, "cores": cores,
           "inflight": used_in_flight(graph, rows),
           "graph": graph.name, "model": a.model or "built-in", "resources": a.resources}
    details = {"forward": bare["kind"], "bare_batches": bare["batches"],
               "bare_train_s": bare_train_s, "cpu_s": shares["cpu_s"],
               "driver_cpu_s": shares["driver_cpu_s"],
               "warmup_steps": warm_steps, "seed": a.seed, "run_tokens": fig["tokens"],
               "engine_busy_s": fig["busy_s"], "env_s": fig["env_s"],
               "replay": {k: v for k, v in rep.items() if not isinstance(v, list)},
               "total_s": round(time.time() - t_all)}
    for what, cpu in (("run", shares["cpu_s"]), ("driver", shares["driver_cpu_s"])):
        print(f"cpu seconds in the window, {what}: " + " ".join(
            f"{k}={v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])),
            flush=True)
    run.result(out, details)
    return out


if __name__ == "__main__":
    main()
