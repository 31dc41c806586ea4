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
(``latest_records``): the figures a page shows come from the log, not from prose
(those record tables and the figures below are made by ``docs/gen_figures.py``).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gen_figures, beside this file

import gen_figures as figures  # noqa: E402
from gen_figures import (COSTS_MARKER, PAIRED_MARKER, REAL_FIGURES, REAL_MARKER,  # noqa: E402,F401
                         RESULTS_MARKER, SETUP_TIMES, TIMED_PAGES, PIPELINE_COMMAND, _cell,
                         costs_table, fill_figures, fill_times, latest_records,
                         paired_table, pipeline_figures, real_model_table, results_page)

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
