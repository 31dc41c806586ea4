"""The ``rollart`` command: ``train`` a graph, ``eval`` a model, look at a run's ``samples``,
``report`` a run, ``status`` of live runs.

``rollart train`` with no arguments trains the default multi-task graph on the local
tagged cluster declared in ``resources/local.py``; ``--set FIELD=VALUE`` changes any
graph field (``rollart.config.overrides``), ``--report-to`` sends the run to experiment trackers
(``rollart.observe.trackers``). Dask's INFO logs are off unless ``--verbose`` (or a
``DASK_LOGGING__DISTRIBUTED`` level you set). Errors in user input (graph, resources,
model folder, chat template, tasks, envs, rewards, overrides, trackers; ``user_errors``)
print one readable line and exit with status 2, also when an actor raised them; with
``rollart --verbose`` (or a command's ``--verbose``) the traceback is printed instead.
"""

from __future__ import annotations

import argparse
import sys


def quiet(verbose: bool = False) -> None:
    """Keep the terminal for the progress bar: Dask INFO logs and per-load bars off
    (``verbose=True``: Dask's INFO logs on). A level set in ``ROLLART_DASK_LOGS`` or
    ``DASK_LOGGING__DISTRIBUTED`` is kept (``rollart.runtime.logs``). Set before any
    worker process starts, so the workers inherit it.

    >>> # import rollart; rollart.quiet()    # first cell of a notebook
    """
    import os

    from rollart.runtime.logs import set_dask_logs

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    set_dask_logs("info" if verbose else None)  # rollart.runtime.logs


def _train(args) -> int:
    quiet(args.verbose)
    from rollart.control.loop import train

    result = train(args.graph, args.resources, steps=args.steps, model=args.model,
                   seed=args.seed, alpha=args.alpha, mode=args.mode, run_dir=args.run_dir,
                   progress=not args.no_progress, eval_seeds=args.eval_seeds,
                   resume=args.resume, weights=args.weights,
                   checkpoint_url=args.checkpoint_url, checkpoint_every=args.checkpoint_every,
                   overwrite=args.overwrite, overrides=args.set, report_to=args.report_to)
    last = result.metrics[-1] if result.metrics else {}
    print(f"run directory: {result.run_dir}")
    print(f"final model:   {result.model_dir}")
    print(f"reward curve:  {result.run_dir}/reward.png")
    if result.evaluation:
        print(format_evaluation(result.evaluation))
    print("last step: " + " ".join(f"{k}={v:.3f}" for k, v in last.items()
                                   if k.startswith(("reward/", "success/"))
                                   and v is not None))
    if result.timings:
        print(format_timings(result.timings))
    return 0


def _span(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def format_timings(t: dict) -> str:
    """Where a run's wall time went (``RunResult.timings``), as ``train`` prints it.

    >>> format_timings({"total_s": 300.0, "rl_s": 240.0, "rl_steps": 100, "other_s": 60.0})
    'time: 5.0 min: 100 RL steps 4.0 min (2.40 s a step), the rest (start-up, saving) 60 s'
    """
    parts = []
    if t.get("warmup_s"):
        parts.append(f"warm-up {_span(t['warmup_s'])}")
    if t.get("rl_steps"):
        parts.append(f"{t['rl_steps']} RL steps {_span(t['rl_s'])} "
                     f"({t['rl_s'] / t['rl_steps']:.2f} s a step)")
    if t.get("evaluation_s"):
        parts.append(f"evaluation {_span(t['evaluation_s'])}")
    parts.append(f"the rest (start-up, saving) {_span(t.get('other_s', 0.0))}")
    return f"time: {_span(t['total_s'])}: " + ", ".join(parts)


def format_evaluation(ev: dict) -> str:
    """Held-out success per task (warm-up -> trained where both exist), as ``train`` and
    ``eval`` print it."""
    lines = [f"held-out success over {ev['seeds']} seeds per task (sampling, T=1):"]
    for task, after in ev["trained"].items():
        before = ev.get("warmup", {}).get(task)
        b = f"{before:.2f} -> " if before is not None else ""
        lines.append(f"  {task:10s} {b}{after:.2f}")
    return "\n".join(lines)


def _eval(args) -> int:
    import json

    quiet(args.verbose)
    from rollart.app.runs import evaluate_target

    ev = evaluate_target(args.target, args.graph, args.seeds)
    print(json.dumps(ev, indent=1) if args.json else
          f"model: {ev['model']}\ngraph: {ev['graph']}\n" + format_evaluation(ev))
    return 0


def _model(args) -> int:
    """``rollart model fetch NAME`` / ``rollart model convert FILE.gguf [DIR]``: the folder."""
    quiet(False)
    from rollart import pretrained

    if args.action == "fetch":
        name = args.source
        if name not in pretrained.KNOWN:
            raise pretrained.PretrainedError(f"unknown model {name!r}: the known ones are "
                                             f"{', '.join(pretrained.KNOWN)}")
        print(f"{name}: {pretrained.KNOWN[name].about}", file=sys.stderr)
        out = pretrained.fetch(name, args.cache)
    else:
        out = (pretrained.convert_gguf(args.source, args.out) if args.out
               else pretrained.convert_cached(args.source))
    print(out)
    return 0


def _export(args) -> int:
    from pathlib import Path

    from rollart.app.runs import is_run_dir
    from rollart.model import adapter_base, export_merged

    src = Path(args.source)
    model = src / "model" if is_run_dir(src) else src
    out = Path(args.merged)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: give a new folder")
    export_merged(model, out)
    how = "the adapter merged into its base" if adapter_base(model) else "as trained"
    print(f"wrote {out}: {model}, {how}, as a full Hugging Face model folder")
    return 0


def _samples(args) -> int:
    import json

    quiet()
    from rollart.observe.samples import format_trajectory, read_decoded

    trajs = read_decoded(args.run, task=args.task, state=args.state, n=args.n)
    if args.json:
        print(json.dumps(trajs, indent=1, default=str))
    elif not trajs:
        print(f"no finished trajectories in {args.run} yet")
    else:
        print("\n\n".join(format_trajectory(t) for t in trajs))
    return 0


def _report(args) -> int:
    from pathlib import Path

    from rollart.observe.report import plot_rewards, read_metrics

    rows = read_metrics(args.run)
    out = plot_rewards(Path(args.run) / "metrics.jsonl", Path(args.run) / "reward.png")
    print(f"{len(rows)} steps; reward curve written to {out}")
    if not args.reward_only:
        from rollart.observe.plots import render_report

        for name, path in render_report(args.run).items():
            print(f"{name + ':':12s}{path}")
    return 0


def _status(args) -> int:
    import json

    from rollart.control.prepare import open_client
    from rollart.observe.dashboard.status import fetch_state, format_status

    with open_client(args.scheduler, timeout=args.timeout) as client:
        state = fetch_state(client)
        if args.run:
            state = {k: v for k, v in state.items() if k == args.run}
        print(json.dumps(state, indent=1, default=str) if args.json else format_status(state))
        if client.dashboard_link:
            print(f"dashboard: {client.dashboard_link.rsplit('/', 1)[0]}/rollart",
                  file=sys.stderr)
    return 0


def _scale(args) -> int:
    from rollart.control.prepare import open_client
    from rollart.control.scaling import SCALE_TOPIC, ScaleError, check_count
    from rollart.observe.dashboard.status import fetch_state

    from pathlib import Path

    run = Path(args.run).name
    asks = []
    for item in args.sizes:
        pool, _, n = item.partition("=")
        if not pool or not n.strip().isdigit():
            raise ScaleError(f"{item!r}: write POOL=N, e.g. env=3 or infer-h20=2")
        check_count(int(n))
        asks.append((pool, int(n)))
    with open_client(args.scheduler, timeout=args.timeout) as client:
        live = sorted(fetch_state(client))
        if run not in live:
            raise ScaleError(f"no live run named {run!r} on {args.scheduler} (live: "
                             f"{', '.join(live) or 'none'})")
        for pool, n in asks:
            client.log_event(SCALE_TOPIC, {"run": run, "pool": pool, "n": n})
            print(f"asked {run} to run {n} worker(s) in {pool} from its next trainer step; "
                  "its console and recovery.json say what was done")
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int ≥ 1, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from rollart.config.graph import MODES

    p = argparse.ArgumentParser(prog="rollart", description=__doc__.split("\n")[0])
    p.add_argument("--verbose", dest="top_verbose", action="store_true",
                   help="on an error in your input, print its traceback (not one line); "
                        "train/eval: also show Dask's INFO logs")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a graph (default: the multi-task graph)")
    t.add_argument("graph", nargs="?", default=None,
                   help="graph file, name in graphs/, or module:function")
    t.add_argument("--resources", default=None,
                   help="resources file, name in resources/, or a scheduler address")
    t.add_argument("--steps", type=int, default=None, help="trainer steps")
    t.add_argument("--model", default=None, help="a Hugging Face model folder on disk, a "
                   ".gguf chat model, or a known name (smollm2-135m-instruct: fetched and "
                   "converted on first use)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--mode", choices=MODES, default=None,
                   help="async (default: trajectory-level, bounded staleness), areal "
                        "(AReaL: bound checked when a trajectory starts, no abort), "
                        "one-off (one-step off-policy), sync+ (trajectories run free, "
                        "rollout stops while the trainer steps: the paper's main "
                        "baseline) or sync (a barrier at every turn)")
    t.add_argument("--alpha", type=int, default=None, help="staleness bound (versions)")
    t.add_argument("--run-dir", default=None, help="where outputs go (default runs/NAME-TIME);"
                   " a directory that holds a run is refused (see --resume, --overwrite)")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the outputs of the run already in --run-dir (and the "
                        "versions in --weights, the checkpoints in --checkpoint-url) first")
    t.add_argument("--eval-seeds", type=int, default=64,
                   help="held-out episodes per task for the before/after evaluation (0: none)")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--resume", default=None, metavar="RUN",
                   help="continue the run directory RUN from its newest checkpoint "
                        "(--steps is then the new total)")
    t.add_argument("--weights", default=None, metavar="BACKEND",
                   help="weight store: fsspec (default), mooncake (a local master on "
                        "127.0.0.1), or a store URL (mooncake://HOST:PORT/PREFIX?metadata=…)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="checkpoint every N steps (always at the end)")
    t.add_argument("--checkpoint-url", default=None,
                   help="where checkpoints go, any fsspec URL (default RUN/checkpoints)")
    t.add_argument("--set", action="extend", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="change a graph field, e.g. --set algo.lr=1e-4 "
                        "rollout.redundancy=1.5 policy.temperature=0.8 steps=40 "
                        "(repeatable; graph.json records the result)")
    t.add_argument("--report-to", default=None, metavar="TRACKERS",
                   help="experiment trackers, comma-separated: tensorboard, mlflow, wandb "
                        "(offline, under the run directory; extras rollart[NAME])")
    t.add_argument("--verbose", action="store_true", help="show Dask's INFO logs (and "
                   "the traceback of an error in your input)")
    t.set_defaults(func=_train)
    e = sub.add_parser("eval", help="held-out success per task of a model folder or a "
                       "run's final model (the evaluation train prints)")
    e.add_argument("target", metavar="MODEL_OR_RUN",
                   help="a run directory (its model/ and graph) or a model folder")
    e.add_argument("graph", nargs="?", default=None,
                   help="graph whose tasks to play (default: the run's, else the default "
                        "graph)")
    e.add_argument("--seeds", type=_positive, default=64, help="held-out episodes per task")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.add_argument("--verbose", action="store_true", help="show Dask's INFO logs")
    e.set_defaults(func=_eval)
    x = sub.add_parser("export", help="write a run's final model (a LoRA run's adapter "
                       "merged into its base) as a full Hugging Face model folder")
    x.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a run directory (its model/) or a model or adapter folder")
    x.add_argument("--merged", required=True, metavar="DIR", help="the folder to write")
    x.set_defaults(func=_export)
    mo = sub.add_parser("model", help="get a real pretrained model as a folder rollart "
                        "trains: fetch a known one, or convert a GGUF chat model")
    mo.add_argument("action", choices=("fetch", "convert"))
    mo.add_argument("source", metavar="NAME_OR_GGUF",
                    help="fetch: a known name (smollm2-135m-instruct); convert: a .gguf file")
    mo.add_argument("out", nargs="?", default=None, metavar="DIR",
                    help="convert: the folder to write (default: the model cache)")
    mo.add_argument("--cache", default=None, help="fetch: the cache folder (default "
                    "$ROLLART_MODEL_CACHE or ~/.cache/rollart/models)")
    mo.set_defaults(func=_model)
    sm = sub.add_parser("samples", help="print a run's latest trajectories, decoded turn "
                        "by turn")
    sm.add_argument("run", help="run directory")
    sm.add_argument("--task", default=None, help="only this task")
    sm.add_argument("--state", default=None,
                    help="only rows in this state (trained, dropped, failed, ...)")
    sm.add_argument("-n", type=_positive, default=5, help="trajectories per task (latest)")
    sm.add_argument("--json", action="store_true", help="print JSON")
    sm.set_defaults(func=_samples)
    r = sub.add_parser("report", help="render a run's plots (reward, throughput, "
                       "staleness) to PNG and report.html")
    r.add_argument("run", help="run directory")
    r.add_argument("--reward-only", action="store_true", help="only reward.png")
    r.set_defaults(func=_report)
    st = sub.add_parser("status", help="print the live figures of the runs a scheduler "
                        "knows about")
    st.add_argument("--scheduler", required=True, help="scheduler address, tcp://HOST:PORT")
    st.add_argument("--run", default=None, help="only this run (its directory name)")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--timeout", default="10s", help="connect timeout")
    st.set_defaults(func=_status)
    sc = sub.add_parser("scale", help="resize a pool of a live run between its trainer "
                        "steps (rollart.control.scaling)")
    sc.add_argument("run", help="the run (its directory, or the directory's name)")
    sc.add_argument("sizes", nargs="+", metavar="POOL=N",
                    help="a Pool.name of the cluster rollart made, or a resource tag, and "
                         "the number of workers wanted: env=3 infer-h20=2")
    sc.add_argument("--scheduler", required=True, help="scheduler address, tcp://HOST:PORT")
    sc.add_argument("--timeout", default="10s", help="connect timeout")
    sc.set_defaults(func=_scale)
    return p


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's to fix (their message says how): ``main`` prints
    them as one line (with a run's latest errors, for a failure storm or a stall). Dask re-raises an actor's error as its own class, so a warm-up's
    ``WarmupEnvError`` on the trainer's worker arrives here as one."""
    from rollart.config.graph import GraphError
    from rollart.config.preflight import RunDirError
    from rollart.control.checkpoint import CheckpointError
    from rollart.control.prepare import SchedulerConnectError
    from rollart.control.scaling import ScaleError
    from rollart.control.supervisor import FailureStormError, StallError
    from rollart.chat.conversation import ConversationError
    from rollart.env.protocol import EnvOutputError
    from rollart.env.tasks import UnknownTaskError
    from rollart.chat.template_support import ChatTemplateError
    from rollart.model import ModelFolderError
    from rollart.observe.samples import SampleQueryError
    from rollart.observe.trackers import TrackerError
    from rollart.policy.quarantine import TasksStoppedError
    from rollart.reward.functions import RewardError
    from rollart.runtime.resources import ResourcesError
    from rollart.trainer.gang_faults import GangWaitError
    from rollart.trainer.warmup import WarmupEnvError
    from rollart.weights.lora import LoRATargetError
    from rollart.weights.mooncake import MooncakeError

    return (GraphError, ResourcesError, ModelFolderError, UnknownTaskError,
            FileNotFoundError, FileExistsError, LoRATargetError, CheckpointError,
            MooncakeError, RunDirError, TrackerError,
            SampleQueryError, ConversationError, ChatTemplateError, EnvOutputError,
            WarmupEnvError, RewardError, SchedulerConnectError, GangWaitError,
            TasksStoppedError, FailureStormError, StallError, ScaleError)


def main(argv=None) -> int:
    import traceback

    args = build_parser().parse_args(argv)
    verbose = bool(args.top_verbose or getattr(args, "verbose", False))
    if hasattr(args, "verbose"):
        args.verbose = verbose
    try:
        return args.func(args)
    except user_errors() as e:
        if verbose:
            traceback.print_exc()
        else:
            print(f"rollart: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
