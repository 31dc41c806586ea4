"""A live progress widget for a ``rollart.app.api.Run`` in a notebook.

An ``ipywidgets`` box (progress bar + a line of figures) refreshed from the run's
``metrics.jsonl`` by a daemon thread until the run ends; without ipywidgets, an object
whose ``repr`` is the same line (good for scripts and plain consoles).
"""

from __future__ import annotations

import threading


def describe(run) -> str:
    """One line: status, step, reward per task, trajectory counts, throughput."""
    rows = run.rows()
    last = rows[-1] if rows else {}
    rewards = " ".join(f"{k[7:]}={v:.2f}" for k, v in sorted(last.items())
                       if k.startswith("reward/") and k != "reward/mean" and v is not None)
    tok = last.get("rollout/tokens_generated", 0)
    rate = tok / last["time"] if last.get("time") else 0.0
    return (f"{run.name}: {run.status}, step {last.get('step', 0)}/{run.steps} "
            f"{rewards} | trained {last.get('traj/trained', 0)}, "
            f"in flight {last.get('traj/in_flight', 0)} | {rate:.0f} tok/s")


class TextProgress:
    def __init__(self, run):
        self.run = run

    def __repr__(self) -> str:
        return describe(self.run)


def progress_widget(run, interval: float = 1.0):
    try:
        import ipywidgets as w
    except ImportError:
        return TextProgress(run)
    bar = w.IntProgress(value=0, min=0, max=run.steps, description="rollart",
                        bar_style="info")
    text = w.HTML(value=describe(run))
    link = w.HTML(value=f'<a href="{run.dashboard_link}" target="_blank">dashboard</a>'
                  if run.dashboard_link else "")
    box = w.VBox([w.HBox([bar, link]), text])

    def refresh():
        bar.value, text.value = run.step, describe(run)

    def loop():
        while not run.done():
            refresh()
            run._thread.join(interval)
        refresh()
        bar.bar_style = {"finished": "success", "stopped": "warning"}.get(run.status,
                                                                         "danger")

    threading.Thread(target=loop, daemon=True, name=f"rollart-widget-{run.name}").start()
    return box
