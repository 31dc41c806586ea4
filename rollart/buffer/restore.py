"""A ``SampleBuffer`` continued from durable state: a checkpoint's snapshot, or the run
dir's journal after the buffer's worker was lost. Plain functions over the buffer's
parts, each handed to them explicitly; the ``SampleBuffer`` (``rollart.buffer.buffer``)
calls them and does the rest (its ledger moves, journal entries, slots).

* ``snapshot_of`` / ``write_snapshot`` / ``read_snapshot`` / ``restore_groups``: the
  buffer's part of a checkpoint (``rollart.control.checkpoint``, through
  ``SampleBuffer.snapshot/restore``): ``buffer.parquet`` (every row held: buffered
  groups, complete or not, and taken ones) and ``buffer.json`` (counters, ledger totals,
  next part and journal entry, groups); a snapshot then compacts the journal entries
  written since the previous one (``Journal.compact``).
* ``read_journal``: what ``SampleBuffer(run_dir, recover=True)`` rebuilds from
  ``rollart.buffer.journal``: complete groups that were buffered are buffered again;
  taken batches stay taken for their step (the next ``get_table`` or ``release_taken``
  settles them); trajectories in flight on the lost buffer's ledger, and members of its
  incomplete groups (never durable), become ``failed`` (counted ``orphaned``; a late
  arrival of one is ignored) and their groups are closed; rows that left but never
  reached a part are written as one; the counts continue.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from rollart.buffer import journal
from rollart.buffer.group import Group, Groups
from rollart.buffer.ledger import BUFFERED, FINAL, IN_FLIGHT, TAKEN, Ledger
from rollart.buffer.schema import SCHEMA, conform, read_parts, write_parquet
from rollart.buffer.taken import TakenBatches
from rollart.types import TrajState

ABORTED = TrajState.ABORTED.value

logger = logging.getLogger(__name__)


# -- checkpoints -------------------------------------------------------------------------
def snapshot_of(groups: Groups, taken: TakenBatches, meta: dict) -> tuple[pa.Table, dict]:
    """Every row held (complete groups, open ones, taken ones) and ``buffer.json``:
    ``meta`` (counters, ledger totals, next part and entry, taken steps) plus the
    groups. ``meta``'s ``next_part``/``next_entry`` mark exactly which files belong to
    the checkpointed run (the caller flushed first)."""
    held = [(g, True, None) for g in groups.complete.values()] + \
           [(g, False, None) for g in groups.open.values()] + \
           [(g, True, s) for s, g in taken.groups()]
    batches = [b for g, _, _ in held for b in g.arrow()]
    meta = {**meta, "groups": [{"id": g.group_id, "size": g.size, "arrived": g.arrived,
                                "rows": g.rows, "complete": done, "taken": step}
                               for g, done, step in held]}
    return pa.Table.from_batches(batches, schema=SCHEMA), meta


def write_snapshot(url: str, table: pa.Table, meta: dict) -> dict:
    """Write ``buffer.parquet`` and ``buffer.json`` under ``url``; the manifest entries."""
    from rollart.runtime.storage import write_bytes

    out = io.BytesIO()
    pq.write_table(table, out)
    files = write_bytes(url, "buffer.parquet", out.getvalue())
    files.update(write_bytes(url, "buffer.json", json.dumps(meta, indent=1).encode()))
    return files


def read_snapshot(url: str) -> tuple[dict, pa.Table]:
    """``buffer.json`` and ``buffer.parquet`` of a snapshot under ``url``."""
    fs, root = fsspec.core.url_to_fs(str(url))
    root = root.rstrip("/")
    with fs.open(f"{root}/buffer.json", "r") as f:
        meta = json.load(f)
    with fs.open(f"{root}/buffer.parquet", "rb") as f:
        table = conform(pq.read_table(io.BytesIO(f.read())))
    return meta, table


def restore_groups(meta: dict, table: pa.Table, ledger: Ledger, groups: Groups,
                   taken: TakenBatches) -> list[Group]:
    """A snapshot's groups back in ``groups`` (complete ones, in their order) and
    ``taken`` (taken ones stay taken); their ids the ``ledger`` (loaded from the snapshot)
    lacks are assumed. Returns the incomplete ones, closed here: their missing members
    died with the old run, so the caller drops their rows."""
    rows_by_group: dict[str, list[int]] = {}
    for i, gid in enumerate(table.column("group_id").to_pylist()):
        rows_by_group.setdefault(gid, []).append(i)
    steps = {int(s): m for s, m in meta.get("taken", {}).items()}
    incomplete = []
    for info in meta["groups"]:
        part = table.take(pa.array(rows_by_group.get(info["id"], []), pa.int64())).combine_chunks()
        group = Group(info["id"], info["size"], arrived=info["arrived"],
                      batches=part.to_batches(), versions=part.column("version").to_pylist())
        step = info.get("taken")
        for traj_id in part.column("traj_id").to_pylist():  # ids an old checkpoint lacks
            ledger.assume(traj_id, BUFFERED if step is None else TAKEN)
        if step is not None:
            groups.close(group.group_id)
            taken.adopt(step, steps[step], group)
        elif info["complete"]:
            groups.add_complete(group)
        else:
            groups.close(group.group_id)
            incomplete.append(group)
    return incomplete


def restore_state(meta: dict, table: pa.Table, run_dir: str | None, *, ledger: Ledger,
                  groups: Groups, taken: TakenBatches, arrivals, store, journal_) -> list[Group]:
    """Load a snapshot (``read_snapshot``) into a fresh buffer's parts: counters, ledger
    (in flight at the snapshot: aborted) and the part and journal counters continue;
    the old run's later parts and entries are set aside; groups as ``restore_groups``.
    Returns the incomplete groups, whose rows the caller drops."""
    arrivals.load(meta.get("counts"))
    store.parts = int(meta["next_part"])
    set_aside_parts_after(run_dir, store.parts)
    state = {}
    if run_dir is not None and "next_entry" in meta:
        journal_.next_entry = int(meta["next_entry"])
        journal.set_aside(run_dir, journal_.next_entry)
        record = journal.read_ledger(run_dir)
        state = {t: s for t, (s, _) in record.latest.items()}
        arrivals.load(meta.get("counts"), record.orphans)
    ledger.load(state, dict(meta["ledger"]))
    ledger.end_in_flight(ABORTED)  # they died with the old run
    return restore_groups(meta, table, ledger, groups, taken)


def _part_index(path: str) -> int:
    return int(path.rsplit("-", 1)[-1].split(".")[0])


def set_aside_parts_after(run_dir: str | None, next_part: int) -> None:
    """Move the part files ``>= next_part`` (a lost run's, after the checkpoint a run
    resumes from) to ``samples/after-resume-{k}/``."""
    if run_dir is None:
        return
    fs, root = fsspec.core.url_to_fs(f"{run_dir}/samples")
    if not fs.exists(root):
        return
    later = [p for p in fs.glob(f"{root}/part-*.parquet") if _part_index(p) >= next_part]
    if later:
        k = len(fs.glob(f"{root}/after-resume-*"))
        fs.makedirs(f"{root}/after-resume-{k}", exist_ok=True)
        for p in later:
            fs.mv(p, f"{root}/after-resume-{k}/{p.rsplit('/', 1)[-1]}")


# -- recovery after the buffer's worker was lost -----------------------------------------
@dataclass
class Recovered:
    """What the journal of a lost buffer says, ready to load into a fresh one."""

    state: dict[str, str]  # traj_id -> ledger state (members never durable: in flight)
    counts: dict | None  # ledger totals, None: count them from ``state``
    meta: dict  # the newest entry's metadata (counters, taken steps)
    orphans: set[str]
    complete: list[Group] = field(default_factory=list)  # buffered, in completion order
    taken: list[tuple[int, dict, Group]] = field(default_factory=list)  # step, meta, group
    seen: set[str] = field(default_factory=set)  # every group id the journal names
    next_part: int = 0
    next_entry: int = 0
    rewritten: int = 0  # rows that left but reached no part, written as one now


def read_journal(run_dir: str) -> Recovered:
    """Replay the journal under ``run_dir`` (in the calling thread); rows that left the
    lost buffer but reached no part are written as one part now."""
    record = journal.read_ledger(run_dir)
    # rows of an entry the lost buffer wrote but never made (killed before its ledger
    # file): set aside, or this buffer's entry of that number would make them its own
    journal.set_aside(run_dir, record.next_entry, folder="uncommitted")
    parts = read_parts(run_dir)
    fs, root = fsspec.core.url_to_fs(f"{run_dir}/samples")
    names = fs.glob(f"{root}/part-*.parquet") if fs.exists(root) else []
    meta = record.meta or {}
    pending = journal.read_pending(run_dir, record.made)
    state = {t: s for t, (s, _) in record.latest.items()}
    counts = dict(meta["ledger"]) if "ledger" in meta else None
    held = _held_groups(pending, record.latest)
    durable = {t for rows in held.values() for t in rows.column("traj_id").to_pylist()}
    never = [t for t, s in state.items() if s in (BUFFERED, TAKEN) and t not in durable]
    for t in never:  # an open group's member: never durable, so it never arrived
        if counts is not None:
            counts[state[t]] -= 1
            counts[IN_FLIGHT] = counts.get(IN_FLIGHT, 0) + 1
        state[t] = IN_FLIGHT
    rec = Recovered(state, counts, meta, set(record.orphans), next_entry=record.next_entry,
                    next_part=max([_part_index(p) + 1 for p in names]
                                  + [meta.get("next_part", 0)]))
    taken = {int(s): m for s, m in meta.get("taken", {}).items()}
    for gid, rows in held.items():
        group = Group(gid, rows.num_rows, arrived=rows.num_rows, batches=rows.to_batches(),
                      versions=rows.column("version").to_pylist())
        first = rows.column("traj_id")[0].as_py()
        if state[first] == BUFFERED:
            rec.complete.append(group)
        else:
            step = record.latest[first][1]
            # the newest entry lists every step holding a batch; if the one that did was
            # unreadable, take the batch as not yet published (re-used, never "trained"
            # on a guess)
            rec.taken.append((step, taken.get(step) or {"min_version": group.version,
                                                         "take": "recovered"}, group))
    rec.seen = {t.rsplit("-", 1)[0] for t in state} | set(pending.column("group_id").to_pylist())
    rec.rewritten = _write_unwritten(run_dir, rec.next_part, pending, parts, record.latest)
    rec.next_part += 1 if rec.rewritten else 0
    return rec


def load_recovered(rec: Recovered, *, ledger: Ledger, groups: Groups, taken: TakenBatches,
                   arrivals, store, journal_) -> None:
    """Load ``rec`` (``read_journal``) into a fresh buffer's parts; what was in flight is
    left in flight for the caller to orphan."""
    store.parts, journal_.next_entry = rec.next_part, rec.next_entry
    ledger.load(rec.state, rec.counts)
    arrivals.load(rec.meta.get("counts"), rec.orphans)
    for g in rec.complete:
        groups.add_complete(g)
    for step, meta, g in rec.taken:
        taken.adopt(step, meta, g)
    groups.close_all(rec.seen - {g.group_id for g in rec.complete})


def _held_groups(pending: pa.Table, latest: dict) -> dict[str, pa.Table]:
    """Rows of trajectories whose latest state is buffered or taken, by group, in the
    order their groups completed."""
    ids = pending.column("traj_id").to_pylist()
    keep = [i for i, t in enumerate(ids) if latest.get(t, ("",))[0] in (BUFFERED, TAKEN)]
    rows = pending.take(pa.array(keep, pa.int64()))
    by_group: dict[str, list[int]] = {}
    for i, gid in enumerate(rows.column("group_id").to_pylist()):
        by_group.setdefault(gid, []).append(i)
    return {gid: rows.take(idx).combine_chunks() for gid, idx in by_group.items()}


def _write_unwritten(run_dir: str, part: int, pending: pa.Table, parts: pa.Table,
                     latest: dict) -> int:
    """Rows that left the lost buffer but reached no part: part ``part`` now (so the
    ``samples/`` parts hold every row that left). Returns rows written."""
    rows = journal.unwritten(pending, parts, latest)
    gone = [i for i, s in enumerate(rows.column("state").to_pylist()) if s in FINAL]
    if not gone:
        return 0
    write_parquet(rows.take(gone), f"{run_dir}/samples/part-{part:05d}.parquet")
    return len(gone)
