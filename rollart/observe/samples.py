"""Trajectories as a person reads them: decoded turns from a run's stored samples.

Consumes a run directory's samples (``rollart.buffer.read_samples``: one Arrow row per
trajectory, ids with a loss mask) and a tokenizer from the run's model folders;
produces, per trajectory, its turns (the observation the env gave, the action the
policy generated and the policy version that generated it), then its reward, outcome
and state. The loss mask tells the two apart: generated ids (mask 1) are actions,
everything rollart added (mask 0: env text, and in ``chat`` form the template's role
turns) is an observation. Used by ``rollart samples RUN`` and, through ``SampleFeed``,
by the dashboard's ``/rollart`` page (the latest few trajectories per task).
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)
TOPIC_SAMPLES = "rollart-samples"  # decoded trajectories for the dashboard page
MODEL_DIRS = ("model", "warmup_model", "init_model")  # where a run's tokenizer is
_ROLES = {"system", "user", "assistant", "tool"}
MAX_CHARS = 400  # of one observation or action on the dashboard page


class SampleQueryError(ValueError):
    """``--task`` / ``--state`` that no stored trajectory has (lists the ones there are)."""


def run_tokenizer(run_dir, model_path: str | None = None):
    """The tokenizer of ``model_path``, else of the run's own model folders."""
    from rollart.model import ModelFolderError, load_tokenizer

    candidates = [model_path] if model_path else []
    candidates += [str(Path(run_dir) / d) for d in MODEL_DIRS]
    for path in candidates:
        if path and (Path(path) / "tokenizer_config.json").is_file():
            return load_tokenizer(path)
    source = _graph_json(run_dir).get("policy", {}).get("model")
    if source:  # a run that trained a model folder given on the command line
        return load_tokenizer(source)
    raise ModelFolderError(
        f"no tokenizer for {run_dir}: none of {', '.join(MODEL_DIRS)} holds one (is it a "
        f"rollart run directory?)")


def _graph_json(run_dir) -> dict:
    import json

    try:
        return json.loads((Path(run_dir) / "graph.json").read_text())
    except (OSError, ValueError):
        return {}


def _text(tokenizer, ids) -> str:
    """Decoded text without special tokens and without the chat template's role lines."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    lines = [ln for ln in text.split("\n") if ln.strip() not in _ROLES]
    return "\n".join(lines).strip()


def decode(row: dict, tokenizer) -> dict:
    """One stored row as ``{task, seed, reward, outcome, state, version, turns: [{
    observation, action, version}]}``."""
    turns: list[dict] = [{"observation": list(row["prompt_ids"]), "action": [],
                          "versions": []}]
    for tok, mask, ver in zip(row["response_ids"], row["loss_mask"], row["versions"]):
        if mask:
            turns[-1]["action"].append(tok)
            turns[-1]["versions"].append(ver)
        elif turns[-1]["action"]:  # the env's (or template's) text after an action
            turns.append({"observation": [tok], "action": [], "versions": []})
        else:
            turns[-1]["observation"].append(tok)
    out = [{"observation": _text(tokenizer, t["observation"]),
            "action": _text(tokenizer, t["action"]),
            "version": max(t["versions"]) if t["versions"] else None} for t in turns]
    return {k: row[k] for k in ("traj_id", "task", "seed", "reward", "outcome", "state",
                                "version", "num_turns", "error")} | {"turns": out}


def select(table, task: str | None = None, state: str | None = None, n: int = 5):
    """The latest ``n`` rows per task (of ``task`` only, in ``state`` only), as dicts,
    in the order they were written."""
    rows = table.to_pylist()
    if task is not None:
        rows = [r for r in rows if r["task"] == task]
    if state is not None:
        rows = [r for r in rows if r["state"] == state]
    keep: dict[str, list] = {}
    for r in reversed(rows):
        if len(keep.setdefault(r["task"], [])) < n:
            keep[r["task"]].append(r)
    chosen = {id(r) for rs in keep.values() for r in rs}
    return [r for r in rows if id(r) in chosen]


def read_decoded(run_dir, task: str | None = None, state: str | None = None,
                 n: int = 5) -> list[dict]:
    """``decode`` of the latest ``n`` trajectories per task of the run in ``run_dir``.

    Unknown ``task`` / ``state`` values are a ``SampleQueryError`` listing the ones there
    are.
    """
    from rollart.buffer import read_samples

    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"no run directory {run_dir}")
    table = read_samples(str(run_dir))
    for name, value in (("task", task), ("state", state)):
        have = sorted(set(table.column(name).to_pylist())) if table.num_rows else []
        if value is not None and value not in have:
            raise SampleQueryError(f"--{name} {value}: no trajectory of that {name} in "
                             f"{run_dir}; there are: {', '.join(have) or 'none yet'}")
    rows = select(table, task, state, n)
    tokenizer = run_tokenizer(run_dir) if rows else None
    return [decode(r, tokenizer) for r in rows]


def format_trajectory(t: dict) -> str:
    """A decoded trajectory as text lines (what ``rollart samples`` prints)."""
    lines = [f"== {t['task']} seed {t['seed']}  {t['outcome']}  reward {t['reward']:.3f}  "
             f"state {t['state']}  version {t['version']}  ({t['traj_id']})"]
    for i, turn in enumerate(t["turns"], 1):
        lines.append(f"  turn {i} observation: {_indent(turn['observation'])}")
        if turn["action"] or turn["version"] is not None:
            lines.append(f"  turn {i} action (v{turn['version']}): "
                         f"{_indent(turn['action'])}")
    if t.get("error"):
        lines.append(f"  error: {t['error']}")
    lines.append(f"  outcome: {t['outcome']}, reward {t['reward']:.3f}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return text.replace("\n", "\n      ")


# -- the dashboard's trajectories ---------------------------------------------------------
class SampleFeed:
    """Publishes the latest decoded trajectories per task to the scheduler (topic
    ``rollart-samples``) for the ``/rollart`` page, at most every ``interval`` seconds.

    Reads only the newest ``samples/part-*.parquet`` files the driver can see (on a
    remote cluster whose buffer writes elsewhere there are none: nothing is shown).
    Never stops a run: a failure is logged once.
    """

    def __init__(self, client, run_dir, model_path: str, graph, per_task: int = 3,
                 interval: float = 10.0):
        self.client, self.run_dir, self.model_path = client, Path(run_dir), model_path
        self.per_task, self.interval = per_task, interval
        self.tasks = list(graph.task_names)
        self._last = 0.0
        self._tokenizer = None
        self._warned = False

    def maybe_publish(self, force: bool = False) -> bool:
        if not force and time.time() - self._last < self.interval:
            return False
        self._last = time.time()
        try:
            trajs = self.latest()
            if trajs:
                self.client.log_event(TOPIC_SAMPLES, {"kind": "samples",
                                                      "run": self.run_dir.name,
                                                      "trajectories": trajs})
            return bool(trajs)
        except Exception as e:  # noqa: BLE001 - the page is best effort
            (logger.debug if self._warned else logger.warning)(
                "rollart: decoded samples not published: %s: %s", type(e).__name__, e)
            self._warned = True
            return False

    def latest(self) -> list[dict]:
        """The newest ``per_task`` trajectories of each task, decoded, texts capped."""
        import pyarrow as pa

        from rollart.buffer import read_parts

        parts = sorted((self.run_dir / "samples").glob("part-*.parquet"), reverse=True)
        tables, seen = [], {}
        for part in parts:  # newest first, until every task has enough
            t = read_parts(str(part))
            tables.insert(0, t)
            for name in t.column("task").to_pylist():
                seen[name] = seen.get(name, 0) + 1
            if all(seen.get(k, 0) >= self.per_task for k in self.tasks):
                break
        if not tables:
            return []
        if self._tokenizer is None:
            self._tokenizer = run_tokenizer(self.run_dir, self.model_path)
        rows = select(pa.concat_tables(tables), n=self.per_task)
        return [_capped(decode(r, self._tokenizer)) for r in rows]


def _capped(t: dict) -> dict:
    for turn in t["turns"]:
        for k in ("observation", "action"):
            if len(turn[k]) > MAX_CHARS:
                turn[k] = turn[k][:MAX_CHARS] + " …"
    return t


def samples_html(trajectories: list[dict]) -> str:
    """The page's trajectories section: per task, the latest trajectories' turns."""
    if not trajectories:
        return "<i>no finished trajectories yet</i>"
    by_task: dict[str, list] = {}
    for t in trajectories:
        by_task.setdefault(t["task"], []).append(t)
    out = []
    for task, trajs in sorted(by_task.items()):
        out.append(f"<h4>{html.escape(task)}</h4>")
        for t in reversed(trajs):  # newest first
            out.append(
                f"<div class='rollart-traj'><b>seed {t['seed']}</b> — "
                f"{html.escape(str(t['outcome']))}, reward {t['reward']:.3f}, "
                f"{html.escape(str(t['state']))}, version {t['version']}<ol>")
            for turn in t["turns"]:
                act = ("" if turn["version"] is None else
                       f"<br>&rarr; <code>{html.escape(turn['action'])}</code> "
                       f"<small>(v{turn['version']})</small>")
                out.append(f"<li><pre style='display:inline;white-space:pre-wrap'>"
                           f"{html.escape(turn['observation'])}</pre>{act}</li>")
            out.append("</ol></div>")
    return "\n".join(out)
