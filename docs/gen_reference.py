"""Reference pages generated from the code, at build time (a MkDocs hook, mkdocs.yml).

Produces five pages that are not in git: ``reference/config.md`` (every field of the
configuration dataclasses and of the Dask config section ``rollart.waits``: type,
default and meaning), ``reference/cli.md`` (every
``rollart`` subcommand and option, from ``rollart.app.cli.build_parser``),
``reference/parquet.md`` (the Arrow schema of ``rollart.buffer.schema``) and
``benchmarks/results.md`` (every record of ``benchmarks/results/*.jsonl``), and
``reference/api.md`` (mkdocstrings directives for every public name of ``rollart``);
it also copies ``benchmarks/figures/*.png`` into the site, and replaces a benchmark page's
``<!-- results: SCRIPT -->`` with a table of ``benchmarks/SCRIPT.py``'s newest records
(``latest_records``): the figures a page shows come from the log, not from prose.
The set-up times and the default run's held-out table on ``README.md`` and
``docs/quickstart.md`` come from ``benchmarks/setup_times.py``'s records too: each sits
between ``<!-- setup_times: KEY -->`` and ``<!-- /setup_times -->`` and is written in
place by ``python docs/gen_reference.py --times`` (``fill_times``; the pages are read raw
on GitHub, so not at build time); ``tests/docs/test_times.py`` fails when a page differs.
So do README's benchmark figures between ``<!-- figures: KEY -->`` and ``<!-- /figures -->``
(``fill_figures``, the same command: the pipeline's paired headline from the newest
``benchmarks/pipeline.py`` record that has it, or "not measured yet"); on the pipeline's
page ``<!-- paired: pipeline -->`` becomes that record's paired table at build time.

A field's meaning is its comment in the dataclass source: the comment at the end of its
line, the ``#`` lines right above it, or both. ``tests/docs/test_reference.py`` fails
when a field has none. The dataclasses are read with ``ast`` (nothing is imported for
them); the CLI and the schema are imported.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (title, source file, class name, a sentence on where it is used)
CLASSES = [
    ("Graph", "rollart/config/graph.py", "Graph",
     "A training run: tasks, policy, algorithm, rollout settings. A function in "
     "`graphs/` returns one; `--set FIELD=VALUE` overrides a field."),
    ("Policy", "rollart/config/policy.py", "Policy",
     "`Graph.policy`: the model, how it samples, its engines (`--set policy.FIELD=...`)."),
    ("GRPO", "rollart/config/graph.py", "GRPO",
     "`Graph.algo`: the optimisation settings (`--set algo.FIELD=...`)."),
    ("Rollout", "rollart/config/graph.py", "Rollout",
     "`Graph.rollout`: where and how trajectories run (`--set rollout.FIELD=...`)."),
    ("LoRA", "rollart/config/training.py", "LoRA",
     "`Policy.lora`: low-rank adapters instead of full fine-tuning "
     "(`--set policy.lora.rank=16`)."),
    ("TrainerParallel", "rollart/config/training.py", "TrainerParallel",
     "`Policy.trainer_parallel`: how a trainer gang of N TRAIN workers is laid out, "
     "tensor x data parallel (`--set policy.trainer_parallel.tp=2`)."),
    ("Resources", "rollart/runtime/resources.py", "Resources",
     "What a file in `resources/` returns: pools to start, or a scheduler address."),
    ("Pool", "rollart/runtime/resources.py", "Pool",
     "One pool of tagged Dask workers (`Resources.pools`)."),
    ("Task", "rollart/env/tasks.py", "Task",
     "One task: env, reward and how the model talks to it (`Graph.tasks`)."),
    ("Waits (Dask config `rollart.waits`)", "rollart/runtime/waits.py", "Waits",
     "Bounds on what start-up, recovery and shutdown wait for, so no wait is silent: set "
     "in Dask's config, `dask.config.set({'rollart.waits.start': 1800})`, or in the "
     "driver's environment, `DASK_ROLLART__WAITS__START=1800` (a field's underscore is a "
     "dash there: `warmup-step`). Past a bound, `StuckError` names what is stuck. These "
     "are the only Dask config keys rollart reads."),
    ("AgentTask", "rollart/agents/agent.py", "AgentTask",
     "A `Task` played by an agent function against rollart's OpenAI-compatible "
     "endpoint. The fields below are the ones it declares or overrides; every other "
     "field is `Task`'s."),
]


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_docs(path: str, name: str) -> list[dict]:
    """The fields a dataclass declares in its own body, in order: ``name``, ``type``,
    ``default`` (source text; ``None`` when required) and ``doc`` (its comments)."""
    source = (ROOT / path).read_text()
    lines = source.splitlines()
    comments = _comments(source)
    cls = next(n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.ClassDef) and n.name == name)
    fields = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = comments.get(node.end_lineno) if node.end_lineno != line else None
        doc = " ".join(above + ([trailing] if trailing else []))
        default = None
        if node.value is not None:
            default = ast.get_source_segment(source, node.value)
            if (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "")
                    == "field"):
                kw = {k.arg: k.value for k in node.value.keywords}
                if "default_factory" in kw:
                    default = ast.get_source_segment(source, kw["default_factory"]) + "()"
        fields.append({"name": node.target.id, "doc": doc, "default": default,
                       "type": ast.get_source_segment(source, node.annotation)})
    return fields


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_page() -> str:
    out = ["# Configuration fields", "",
           "Generated from the dataclasses' source by `docs/gen_reference.py`: a field's",
           "meaning is its comment in the code. Validation (`__post_init__`) rejects bad",
           "values with a message saying what to change.", ""]
    for title, path, name, intro in CLASSES:
        out += [f"## {title}", "", f"`{path}` · {intro}", "",
                "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in field_docs(path, name):
            default = "required" if f["default"] is None else f"`{_cell(f['default'])}`"
            out.append(f"| `{f['name']}` | `{_cell(f['type'])}` | {default} | "
                       f"{_cell(f['doc'])} |")
        out.append("")
    return "\n".join(out)


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`" + (" (optional)" if action.nargs == "?" else "")
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.metavar:
        names += f" `{action.metavar}`"
    elif action.choices:
        names += " `{" + ",".join(map(str, action.choices)) + "}`"
    return names


def cli_page() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rollart.app.cli import build_parser

    parser = build_parser()
    out = ["# Command line", "",
           "Generated from `rollart.app.cli.build_parser` by `docs/gen_reference.py`.",
           "`rollart` and `python -m rollart` are the same command; `rollart COMMAND -h`",
           "prints the same text.", "", "```text", parser.format_usage().strip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, p in sub.choices.items():
        out += [f"## rollart {name}", "", _cell(helps.get(name) or ""), "",
                "```text", p.format_usage().strip(), "```", "",
                "| argument | default | meaning |", "|---|---|---|"]
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            default = "" if a.default in (None, False, argparse.SUPPRESS) else f"`{a.default}`"
            out.append(f"| {_option(a)} | {default} | {_cell(a.help or '')} |")
        out.append("")
    return "\n".join(out)


def parquet_page() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rollart.buffer.schema import SCHEMA, SCHEMA_VERSION

    out = ["# Parquet schema", "",
           "Generated from `rollart.buffer.schema.SCHEMA` by `docs/gen_reference.py`. One",
           "row per trajectory in `samples/*.parquet` (schema metadata",
           f"`rollart_schema_version = \"{SCHEMA_VERSION}\"`). Read it back with",
           "`rollart.buffer.read_samples(run_dir)` or any Parquet reader.", "",
           "| column | type | nullable | meaning |", "|---|---|---|---|"]
    for f in SCHEMA:
        doc = (f.metadata or {}).get(b"doc", b"").decode()
        out.append(f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} | "
                   f"{_cell(doc)} |")
    return "\n".join(out) + "\n"


def _figures(record: dict) -> str:
    """A record's scalar figures as ``key=value`` (nested ``result``/``summary`` dicts too)."""
    flat = {}
    for key, value in record.items():
        if key in ("date", "commit", "command", "load_before"):
            continue
        if isinstance(value, dict):
            flat.update({k: v for k, v in value.items() if isinstance(v, (int, float, str))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = value
    return " ".join(f"{k}={round(v, 4) if isinstance(v, float) else v}"
                    for k, v in flat.items())


def _records(script: str) -> list[dict]:
    """``benchmarks/results/<script>.jsonl``'s records, newest first (``[]``: none)."""
    path = ROOT / "benchmarks/results" / f"{script}.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r.get("date", ""), reverse=True)


def _table(records: list[dict]) -> list[str]:
    out = ["| date | commit | load before | command | figures |", "|---|---|---|---|---|"]
    for r in records:
        load = r.get("load_before")
        if isinstance(load, (list, tuple)):  # os.getloadavg(); older records say it in words
            load = " / ".join(f"{x:.2f}" for x in load)
        out.append(f"| {r.get('date', '')} | `{r.get('commit', '')}` | {_cell(load or '')} | "
                   f"`{_cell(r.get('command', '')).strip()}` | {_cell(_figures(r))} |")
    return out


def latest_records(script: str, n: int = 3, log: str = "results.md") -> str:
    """The newest ``n`` records of ``benchmarks/<script>.py`` as a table, for its page
    (``log``: the results log's address from that page)."""
    if not (ROOT / "benchmarks" / f"{script}.py").exists():
        raise ValueError(f"<!-- results: {script} -->: there is no benchmarks/{script}.py")
    records = _records(script)
    if not records:
        return (f"No record yet: a run of `python benchmarks/{script}.py` (not `--quick`, "
                f"not `--no-record`) appends one to `benchmarks/results/{script}.jsonl`.")
    shown = records[:n]
    return "\n".join([f"The newest {len(shown)} of {len(records)} record(s) in "
                      f"`benchmarks/results/{script}.jsonl` (all of them: [results log]"
                      f"({log})), generated at build time:", "", *_table(shown)])


RESULTS_MARKER = re.compile(r"<!-- results: ([A-Za-z0-9_]+) -->")


def results_page() -> str:
    """Every record of ``benchmarks/results/*.jsonl``, newest first, per benchmark."""
    out = ["# Results log", "",
           "Generated by `docs/gen_reference.py` from `benchmarks/results/*.jsonl`: the records",
           "the benchmark scripts append (date, commit, load average before the run, command,",
           "figures), newest first. Lists of per-step timings and per-run details stay in the",
           "files.", ""]
    for path in sorted((ROOT / "benchmarks/results").glob("*.jsonl")):
        records = _records(path.stem)
        out += [f"## {path.stem}", "", f"`benchmarks/results/{path.name}`, "
                f"{len(records)} record(s).", "", *_table(records), ""]
    return "\n".join(out)


COSTS_MARKER = "<!-- costs -->"
REAL_MARKER = "<!-- real_model_figures -->"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _first(record: dict, *keys):
    """The first of ``keys`` the record has (a figure renamed since: its older name)."""
    return next((record[k] for k in keys if k in record), None)


def costs_table() -> str:
    """What each failure and each resize cost, from the newest full record of every
    kind (``benchmarks/results/elastic.jsonl``: per pool, size, way and model;
    ``chaos.jsonl``): the reliability page's table."""
    out = ["| event | model | what it cost | lost / duplicated | record |",
           "|---|---|---|---|---|"]
    seen = set()
    for r in _records("elastic"):
        key = (r.get("pool", "infer-h20"), r.get("to", 2), r.get("hand", 0),
               r.get("model", "toy"))
        if key in seen:
            continue
        seen.add(key)
        pool, to, hand, model = key
        join_s = r["join_to_first_request_s"]
        join = _first(r, "join_steps", "join_in_steps")
        stall = _first(r, "scale_down_stall_steps", "shrink_stall_steps")
        step = r.get("step_s_median")
        how = " (workers started by hand)" if hand else ""
        out.append(f"| resize `{pool}` 1 → {to} → 1{how} | {model} | a new worker's first "
                   f"work {_fmt(join_s)} s after the grow = {_fmt(join)} trainer steps "
                   f"(a step: {_fmt(step)} s); the scale-down's step {_fmt(stall)} steps "
                   f"longer than the median | {r['lost']} / {r['duplicated']} | "
                   f"{r['date'][:10]} `{r['commit']}` |")
    for r in _records("chaos")[:1]:
        out.append(f"| SIGKILL of the `{r.get('killed')}` worker and of the trainer's "
                   f"worker mid-step, with {_fmt(r.get('failed_frac'))} of trajectories "
                   f"failing in their envs | toy | longest recovery {_fmt(r['max_recovery_s'])}"
                   f" s; {r.get('restarted_groups')} groups re-run; {r['steps']} steps | "
                   f"{r['lost']} / {r['duplicated']} | {r['date'][:10]} `{r['commit']}` |")
    if len(out) == 2:
        return "No record yet: `benchmarks/elastic.py` and `benchmarks/chaos.py` write them."
    return "\n".join(["Generated from the newest record of each kind in "
                      "`benchmarks/results/elastic.jsonl` and `chaos.jsonl` (all of them: "
                      "[results log](../benchmarks/results.md)):", "", *out])


#: (script, title, figures shown) of the real model's table (``REAL_MARKER``)
REAL_FIGURES = (
    ("trainer_gang", "trainer: one rank against a two-rank FSDP2 gang",
     ("gang_step_s_1", "gang_step_s_2", "gang_step_ratio_t2", "train_tok_s_1",
      "train_tok_s_2", "peak_rss_mb_1", "peak_rss_mb_2_rank0", "peak_rss_mb_2_rank1")),
    ("weight_sync", "weight sync of the full fp32 model",
     ("bytes_full", "publish_s", "update_s", "stall_fsspec", "stall_keep")),
    ("limits", "rollout and trainer against bare PyTorch",
     ("rollout_vs_bare", "trainer_vs_bare", "run_tok_s", "bare_tok_s", "run_train_tok_s",
      "bare_train_tok_s")),
    ("engine_real", "the engine against bare generate and vLLM",
     ("engine_vs_bare", "engine_tok_s", "bare_tok_s", "vllm_tok_s", "batching_gain",
      "sharing_gain")),
    ("elastic", "a decode worker joining and leaving mid-run",
     ("join_to_first_request_s", "join_steps", "scale_down_stall_steps", "lost",
      "duplicated")),
)


def real_model_table() -> str:
    """The newest record on a real model (its ``model`` is not the toy) of each script in
    ``REAL_FIGURES``, as one table: the real-model how-to's figures."""
    out = ["| what | figures | record |", "|---|---|---|"]
    for script, title, keys in REAL_FIGURES:
        real = [r for r in _records(script) if r.get("model", "toy") not in ("toy", None)
                and not str(r.get("model", "")).startswith("tiny")]
        if not real:
            out.append(f"| {title} (`{script}.py`) | no record on a real model yet | |")
            continue
        r = real[0]
        figures = ", ".join(f"`{k}`={_fmt(r[k])}" for k in keys if k in r)
        out.append(f"| {title} (`{script}.py`, `{r['model']}`) | {figures} | "
                   f"{r['date'][:10]} `{r['commit']}` |")
    return "\n".join(["Generated from the newest real-model record of each benchmark in "
                      "`benchmarks/results/` (all of them: "
                      "[results log](../benchmarks/results.md)):", "", *out])


SETUP_TIMES = re.compile(r"<!-- setup_times: (\w+) -->(.*?)<!-- /setup_times -->", re.S)
TIMED_PAGES = ("README.md", "docs/quickstart.md")
#: the default graph's tasks, as the held-out table names them
TASK_NAMES = {"gridnav": "gridnav (grid navigation)",
              "guess": "guess (guess the number with feedback)",
              "boxpush": "boxpush (1-D box pushing)"}


def _newest(script: str, key: str) -> dict:
    """The newest record of ``benchmarks/<script>.py`` that holds ``key`` (a step that
    exited 0, for a time)."""
    step = key[:-2] if key.endswith("_s") else None
    for r in _records(script):
        if key in r and (step is None or r.get(f"{step}_rc", 0) == 0):
            return r
    raise ValueError(f"no record of benchmarks/{script}.py holds {key!r} (with its step "
                     f"passing): run python benchmarks/{script}.py --steps "
                     f"{step or 'main'} on a quiet machine")


def _minutes(seconds: float) -> str:
    return f"about {max(1, round(seconds / 60))} minutes"


def _heldout_table() -> str:
    r = _newest("setup_times", "main_s")
    base = _records("baselines")
    base = base[0] if base else {}
    tasks = [k[len("heldout_after_"):] for k in r if k.startswith("heldout_after_")]
    out = ["", "| task | warm-up policy | after RL | random player | one-rule heuristic |",
           "|---|---|---|---|---|"]
    for t in tasks:
        cells = [r.get(f"heldout_warm_{t}"), r[f"heldout_after_{t}"],
                 base.get(f"{t}_random"), base.get(f"{t}_heuristic")]
        out.append(f"| {TASK_NAMES.get(t, t)} | " +
                   " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    took = r["main_s"]
    out += ["", f"From `benchmarks/setup_times.py`'s record of {r['date'][:10]} "
                f"({r.get('cores', '?')} cores: `python -m rollart train` "
                f"took {int(took // 60)} min {int(took % 60)} s); the scripted players' "
                f"columns are `benchmarks/baselines.py`'s record of {base.get('date', '?')[:10]} "
                f"({base.get('seeds', '?')} seeds).", ""]
    return "\n".join(out)


def fill_times(text: str) -> str:
    """``text`` with every ``<!-- setup_times: KEY -->…<!-- /setup_times -->`` written
    from the newest record: KEY ``heldout`` is the default run's held-out table, any other
    a step of ``benchmarks/setup_times.py`` (``main``, ``suite``, ``slow``, ``bench``,
    ``matrix``, ``learning``) as ``about N minutes``."""
    def one(m):
        key = m.group(1)
        body = _heldout_table() if key == "heldout" else \
            _minutes(_newest("setup_times", f"{key}_s")[f"{key}_s"])
        return f"<!-- setup_times: {key} -->{body}<!-- /setup_times -->"
    return SETUP_TIMES.sub(one, text)


FIGURES = re.compile(r"<!-- figures: (\w+) -->(.*?)<!-- /figures -->", re.S)
PAIRED_MARKER = "<!-- paired: pipeline -->"
#: the pipeline's headline measurement (run on a quiet machine; README names it)
PIPELINE_COMMAND = "python benchmarks/pipeline.py --redundant '' --eval-seeds 128"
#: the paired comparisons: record key -> how a page names the baseline
PAIRED_NAMES = {"syncplus": "sync+", "areal": "areal (its own budget)",
                "areal_at_async": "areal at async's budget", "sync": "sync",
                "oneoff": "one-off"}
SYNCPLUS_GOAL = 2.05  # the paper's speed-up over sync+ (fixed before any run)


def _paired_record() -> dict | None:
    """The newest ``benchmarks/pipeline.py`` record with the paired figures against both
    sync+ and areal (None: no record has them yet)."""
    return next((r for r in _records("pipeline")
                 if r.get("pairs_vs_syncplus") and r.get("pairs_vs_areal")), None)


def _x(value, none: str = "–") -> str:
    """A ratio to two decimals; ``none`` for JSON null: a paired ratio of at least one
    pair is never nan, so null is an infinity there (``_json_safe``), ``none="∞"``."""
    if value is None:
        return none
    return "∞" if value == float("inf") else f"{value:.2f}"


def _ratio_range(r: dict, key: str) -> str:
    """``1.20× (0.90–1.50)``: the paired ratio against ``key`` and its range."""
    med, lo, hi = (_x(r.get(f"speedup_vs_{key}{k}"), "∞") for k in ("_paired", "_min", "_max"))
    return f"{med}× ({lo}–{hi})"


def _pair(r: dict, key: str, name: str, bold: bool = False) -> str:
    """``**1.20× sync+** (0.90–1.50; first on 4 of 5 seeds)``: the paired ratio against
    ``key`` (called ``name``) from ``r``."""
    ratio, spread = _ratio_range(r, key).split(" ", 1)
    star = "**" if bold else ""
    return (f"{star}{ratio} {name}{star} {spread[:-1]}; first on {r.get(f'wins_vs_{key}')} "
            f"of {r.get(f'pairs_vs_{key}')} seeds)")


def pipeline_figures(key: str) -> str:
    """README's pipeline row: ``pipeline_command`` (the command cell) or ``pipeline``
    (the figure cell), from ``_paired_record``; "not measured yet" without one."""
    r = _paired_record()
    if key == "pipeline_command":
        if r is None:
            return f"`{PIPELINE_COMMAND}`"
        labels = list(dict.fromkeys(x["label"] for x in r.get("runs", [])))
        return (f"`python benchmarks/{r['command']}` ({', '.join(labels)}; "
                f"{r.get('steps')} steps, {r.get('seeds')} seeds)")
    if r is None:
        old = next((o for o in _records("pipeline") if o.get("speedup_vs_syncplus")
                    and o.get("speedup_vs_areal")), None)
        before = "" if old is None else (
            f" (the newest full record before them, a ratio of medians over "
            f"{old.get('seeds')} seeds: async {_x(old['speedup_vs_syncplus'])}× sync+, "
            f"{_x(old['speedup_vs_areal'])}× areal)")
        return ("time to a held-out target, paired per seed: **not measured yet**, no "
                "record of `benchmarks/pipeline.py` has the paired figures" + before +
                " — [why](docs/benchmarks/pipeline.md)")
    paired = r["speedup_vs_syncplus_paired"]
    met = "met" if paired is None or paired >= SYNCPLUS_GOAL else "not met"  # None: ∞
    return (f"time to a held-out target, median of the per-seed ratios (min–max): async "
            f"{_pair(r, 'syncplus', 'sync+', True)} (the paper's goal ≥ {SYNCPLUS_GOAL}×: "
            f"{met}), {_pair(r, 'areal', 'areal', True)} at areal's own budget, "
            f"{_pair(r, 'areal_at_async', 'areal')} at async's, {_pair(r, 'sync', 'sync')}; "
            f"groups in flight, mean: async {_x(r.get('inflight_async'))}, areal "
            f"{_x(r.get('inflight_areal'))} steps' worth — [why](docs/benchmarks/pipeline.md)")


def fill_figures(text: str) -> str:
    """``text`` with every ``<!-- figures: KEY -->…<!-- /figures -->`` written from the
    records (``pipeline_figures``)."""
    return FIGURES.sub(lambda m: f"<!-- figures: {m.group(1)} -->"
                       f"{pipeline_figures(m.group(1))}<!-- /figures -->", text)


def paired_table() -> str:
    """The pipeline page's paired figures and per-seed times, from ``_paired_record``."""
    r = _paired_record()
    if r is None:
        return ("Not measured yet: no record of `benchmarks/pipeline.py` has the paired "
                f"figures. Run `{PIPELINE_COMMAND}` on a quiet machine.")
    load = r.get("load_before")
    if isinstance(load, (list, tuple)):
        load = " / ".join(f"{x:.2f}" for x in load)
    out = [f"From the record of {r['date']} (commit `{r['commit']}`, load before "
           f"{_cell(load)}): `python benchmarks/{r['command']}`, target "
           f"{_fmt(r.get('target'))}, generated at build time.", "",
           "| async against | paired ratio, median (min–max) | async first on | "
           "groups in flight, mean (steps' worth) |", "|---|---|---|---|"]
    inflight = {"areal": r.get("inflight_areal"),
                "areal_at_async": r.get("inflight_areal_at_async")}
    for key, name in PAIRED_NAMES.items():
        if not r.get(f"pairs_vs_{key}"):
            continue
        theirs = inflight.get(key)
        out.append(f"| {name} | {_ratio_range(r, key)} | {r[f'wins_vs_{key}']} of "
                   f"{r[f'pairs_vs_{key}']} seeds | async "
                   f"{_x(r.get('inflight_async'))}"
                   + ("" if theirs is None else f", {name.split(' ')[0]} {_x(theirs)}") + " |")
    runs = r.get("runs", [])
    labels = list(dict.fromkeys(x["label"] for x in runs))
    cell = {(x["label"], x["seed"]): x for x in runs}
    out += ["", "Per seed: time to target in s (`∞`: never reached) · trajectories/s · last "
            "held-out success.", "", "| seed | " + " | ".join(labels) + " |",
            "|---" * (len(labels) + 1) + "|"]
    for seed in sorted({x["seed"] for x in runs}):
        row = [cell.get((label, seed)) for label in labels]
        out.append(f"| {seed} | " + " | ".join(
            "failed" if x is None else
            f"{'∞' if x['time_to_target_s'] is None else _fmt(x['time_to_target_s'])} · "
            f"{_fmt(x['traj_per_s'])} · {_fmt(x['heldout'])}" for x in row) + " |")
    return "\n".join(out)


def api_page() -> str:
    """``::: module.Name`` for every public name of ``rollart`` (its lazy exports), for
    mkdocstrings to render from the docstrings."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import rollart

    out = ["# Python API", "",
           "Every public name of `rollart` (`from rollart import NAME`), rendered from its",
           "docstring by mkdocstrings; the list is `rollart._EXPORTS` (generated by",
           "`docs/gen_reference.py`). Resource tags (`H800`, `H20`, `CPU_ENV`, `REWARD`,",
           "`TRAIN`) are plain strings from `rollart.types`.", ""]
    for module, names in sorted(rollart._EXPORTS.items()):
        shown = [n for n in names if not n.isupper()]
        if not shown:
            continue
        out += [f"## `{module}`", ""]
        for name in sorted(shown, key=str.lower):
            out += [f"::: {module}.{name}", "    options:", "      heading_level: 3",
                    "      show_root_full_path: false", ""]
    return "\n".join(out)


PAGES = {"reference/api.md": api_page, "reference/config.md": config_page,
         "reference/cli.md": cli_page,
         "reference/parquet.md": parquet_page, "benchmarks/results.md": results_page}


def on_files(files, config):
    """MkDocs hook: add the generated pages to the site."""
    from mkdocs.structure.files import File

    for uri, make in PAGES.items():
        files.append(File.generated(config, uri, content=make()))
    for png in sorted((ROOT / "benchmarks/figures").glob("*.png")):
        files.append(File.generated(config, f"benchmarks/figures/{png.name}",
                                    abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    """MkDocs hook: ``<!-- results: SCRIPT -->`` becomes SCRIPT's newest records,
    ``<!-- costs -->`` the costs of failures and resizes, ``<!-- real_model_figures -->``
    the real model's figures."""
    here = os.path.dirname(page.file.src_uri) if page is not None else "benchmarks"
    log = os.path.relpath("benchmarks/results.md", here or ".")
    markdown = markdown.replace(COSTS_MARKER, costs_table())
    markdown = markdown.replace(REAL_MARKER, real_model_table())
    markdown = markdown.replace(PAIRED_MARKER, paired_table())
    return RESULTS_MARKER.sub(lambda m: latest_records(m.group(1), log=log), markdown)


if __name__ == "__main__":
    if sys.argv[1:] == ["--times"]:  # write the recorded figures into the pages that state them
        for name in TIMED_PAGES:
            page = ROOT / name
            page.write_text(fill_figures(fill_times(page.read_text())))
    else:  # print a page: python docs/gen_reference.py reference/cli.md
        print(PAGES[sys.argv[1]]())
