"""``rollart report RUN``: a finished (or running) run's plots as PNG files and one HTML page.

Reads ``metrics.jsonl`` (``rollart.observe.report.read_metrics``) and writes into the run
directory: ``reward.png`` (reward per task), ``throughput.png`` (generated tokens/s,
per inference pool when the run logged ``rollout/tokens/<pool>``), ``staleness.png``
(histogram of trained samples by versions behind, and mean staleness per step) and
``report.html`` (the three images inline, plus the last step's figures).
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from rollart.observe.report import plot_rewards, read_metrics


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rates(times: list[float], totals: list[float]) -> list[float]:
    """Per-interval rate of a cumulative counter (first interval from t=0).

    >>> rates([1.0, 3.0], [10, 30])
    [10.0, 10.0]
    """
    out, t0, c0 = [], 0.0, 0.0
    for t, c in zip(times, totals):
        out.append((c - c0) / (t - t0) if t > t0 else 0.0)
        t0, c0 = t, c
    return out


def plot_throughput(rows: list[dict], out_png: Path) -> str:
    plt = _plt()
    rows = [r for r in rows if "time" in r]
    steps, times = [r["step"] for r in rows], [r["time"] for r in rows]
    pools = sorted({k.split("/", 2)[2] for r in rows for k in r
                    if k.startswith("rollout/tokens/")})
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rates(times, [r.get("rollout/tokens_generated", 0) for r in rows]),
            label="all pools", linewidth=2, color="black")
    for pool in pools:
        ax.plot(steps, rates(times, [r.get(f"rollout/tokens/{pool}", 0) for r in rows]),
                label=pool, linewidth=1.5)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"rollart: rollout throughput ({out_png.parent.name})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return str(out_png)


def staleness_counts(rows: list[dict]) -> dict[int, int]:
    """Trained samples by versions behind, summed over steps."""
    out: dict[int, int] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("trainer/staleness/"):
                n = int(k.rsplit("/", 1)[1])
                out[n] = out.get(n, 0) + int(v)
    return dict(sorted(out.items()))


def plot_staleness(rows: list[dict], out_png: Path) -> str:
    plt = _plt()
    counts = staleness_counts(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=110)
    a.bar([str(k) for k in counts], list(counts.values()), color="tab:blue")
    a.set_xlabel("versions behind the trainer")
    a.set_ylabel("trained samples")
    a.set_title("staleness histogram")
    steps = [r["step"] for r in rows if "trainer/staleness_mean" in r]
    b.plot(steps, [r["trainer/staleness_mean"] for r in rows
                   if "trainer/staleness_mean" in r], label="mean")
    b.plot(steps, [r["trainer/staleness_max"] for r in rows
                   if "trainer/staleness_mean" in r], label="max")
    b.set_xlabel("trainer step")
    b.set_title("staleness per step")
    b.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return str(out_png)


def render_report(run_dir: str | Path) -> dict[str, str]:
    """Write the PNGs and ``report.html`` into ``run_dir``; returns ``{name: path}``."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out = {"reward": plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png"),
           "throughput": plot_throughput(rows, run_dir / "throughput.png"),
           "staleness": plot_staleness(rows, run_dir / "staleness.png")}
    out["html"] = _write_html(run_dir, rows, out)
    return out


def _write_html(run_dir: Path, rows: list[dict], images: dict[str, str]) -> str:
    last = rows[-1] if rows else {}
    keep = ("reward/", "success/", "traj/", "trainer/staleness", "version", "step", "time")
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>"
                    for k, v in last.items()
                    if k.startswith(keep) and isinstance(v, (int, float)))
    imgs = "".join(
        f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(Path(p).read_bytes()).decode()}">'
        for name, p in images.items())
    extra = ""
    if (run_dir / "eval.json").exists():
        ev = html.escape((run_dir / "eval.json").read_text())
        extra = f"<h2>held-out evaluation</h2><pre>{ev}</pre>"
    graph = ""
    if (run_dir / "graph.json").exists():
        graph = html.escape(json.dumps(json.loads((run_dir / "graph.json").read_text()),
                                       indent=1)[:4000])
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>rollart run "
            f"{html.escape(run_dir.name)}</title></head><body style='font-family:sans-serif'>"
            f"<h1>rollart run {html.escape(run_dir.name)}</h1><p>{len(rows)} trainer steps"
            f"</p><h2>last step</h2><table>{table}</table>{imgs}{extra}"
            f"<h2>graph</h2><pre>{graph}</pre></body></html>")
    path = run_dir / "report.html"
    path.write_text(page)
    return str(path)
