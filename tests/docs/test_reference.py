"""The reference pages generated from the code (docs/gen_reference.py, a MkDocs hook):
every configuration field has a meaning, every CLI subcommand and schema column is there."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _gen()


@pytest.mark.parametrize("title,path,name", [c[:3] for c in gen.CLASSES], ids=lambda v: v)
def test_every_field_has_a_description_in_its_source(title, path, name):
    fields = gen.field_docs(path, name)
    missing = [f["name"] for f in fields if not f["doc"]]
    assert not missing, (f"{path}: {name}'s fields {missing} have no description: add a "
                         "`# comment` at the end of the field's line (or right above it)")


def test_the_page_lists_every_field_of_the_live_dataclasses():
    from rollart import (AgentTask, Graph, GRPO, LoRA, Policy, Pool, Resources, Rollout, Task,
                         TrainerParallel)
    from rollart.runtime.waits import Waits

    classes = {"Graph": Graph, "Policy": Policy, "GRPO": GRPO, "Rollout": Rollout,
               "LoRA": LoRA, "TrainerParallel": TrainerParallel, "Resources": Resources, "Pool": Pool, "Task": Task,
               "AgentTask": AgentTask, "Waits (Dask config `rollart.waits`)": Waits}
    assert set(classes) == {c[0] for c in gen.CLASSES}
    for title, path, name, _ in gen.CLASSES:
        declared = [f["name"] for f in gen.field_docs(path, name)]
        live = [f.name for f in dataclasses.fields(classes[title])]
        if title == "AgentTask":  # its own fields and overrides; the rest are Task's
            assert set(declared) <= set(live) and "agent" in declared
        else:
            assert declared == live, title
    page = gen.config_page()
    for title, *_ in gen.CLASSES:
        assert f"## {title}\n" in page


def test_a_field_comment_above_and_at_the_end_of_the_line_are_both_read():
    doc = {f["name"]: f for f in gen.field_docs("rollart/config/graph.py", "GRPO")}
    assert doc["alpha"]["doc"].startswith("staleness bound")  # the lines above
    assert doc["group_size"]["doc"] == "trajectories per group (same task and seed)"
    assert doc["group_size"]["default"] == "8" and doc["group_size"]["type"] == "int"
    graph = {f["name"]: f for f in gen.field_docs("rollart/config/graph.py", "Graph")}
    assert graph["policy"]["default"] == "Policy()" and graph["name"]["default"] is None


def test_the_cli_page_has_every_subcommand_and_option():
    from rollart.app.cli import build_parser

    page = gen.cli_page()
    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices
               and "train" in a.choices)
    for name, p in sub.choices.items():
        assert f"## rollart {name}\n" in page
        for a in p._actions:
            for opt in a.option_strings if a.dest != "help" else ():
                assert f"`{opt}`" in page, (name, opt)
    assert "`--set`" in page and "`--report-to`" in page


def test_the_parquet_page_has_every_column():
    from rollart.buffer.schema import SCHEMA

    page = gen.parquet_page()
    for name in SCHEMA.names:
        assert f"| `{name}` |" in page
