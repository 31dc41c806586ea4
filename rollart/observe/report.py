"""Run outputs a person reads: the JSONL metrics log and the reward-curve PNG.

``MetricsLog`` appends one JSON object per trainer step to ``metrics.jsonl``;
``plot_rewards`` draws ``reward/<task>`` per step (raw and smoothed) to ``reward.png``.
Called by the control loop and by ``rollart report RUN``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """Append-only JSONL log; keeps the rows in memory too."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=_jsonable) + "\n")


def _jsonable(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics log at {path}: is this a rollart run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int = 5) -> list[float]:
    """Trailing moving average.

    >>> smooth([0, 2, 4, 6], window=2)
    [0.0, 1.0, 3.0, 5.0]
    """
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_rewards(metrics_path: str | Path, out_png: str | Path) -> str:
    """Reward per task over trainer steps, raw (faint) and smoothed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    keys = sorted({k for r in rows for k in r if k.startswith("reward/") and k != "reward/mean"})
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for k in keys:
        steps = [r["step"] for r in rows if r.get(k) is not None]  # None: none that step
        vals = [r[k] for r in rows if r.get(k) is not None]
        line, = ax.plot(steps, smooth(vals), label=k[len("reward/"):], linewidth=2)
        ax.plot(steps, vals, color=line.get_color(), alpha=0.25, linewidth=1)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward of trained batch")
    ax.set_title(f"rollart: reward per task ({Path(metrics_path).parent.name})")
    ax.grid(alpha=0.3)
    if keys:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return str(out_png)
