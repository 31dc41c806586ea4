"""``rollart status --scheduler ADDR``: a run's live figures, read from the scheduler.

Asks ``RollartPlugin`` (``run_on_scheduler``); on a scheduler without the plugin, folds
the ``rollart`` events Dask kept (the newest ones; long runs may have lost early rows).
"""

from __future__ import annotations

from rollart.observe.metrics import TOPIC, TOPIC_LIVE, fold


def _plugin_state(dask_scheduler):
    plugin = dask_scheduler.plugins.get("rollart")
    return None if plugin is None else plugin.state()


def fetch_state(client) -> dict:
    """``{run: summary}`` for every run the scheduler has heard of."""
    try:
        state = client.run_on_scheduler(_plugin_state)
    except Exception:  # noqa: BLE001 - e.g. the scheduler cannot unpickle rollart code
        state = None
    if state is None:
        events = sorted(client.get_events(TOPIC) + client.get_events(TOPIC_LIVE),
                        key=lambda e: e[0])
        runs = fold(events)
        state = {name: {**r.summary(), "rows": r.rows[-1:]} for name, r in runs.items()}
    return state


def format_status(state: dict) -> str:
    if not state:
        return "no rollart run has reported to this scheduler yet"
    lines = []
    for name, s in state.items():
        lines.append(f"run {name}: {s['status']}, {s.get('graph', '?')} graph, "
                     f"{s.get('mode', '?')} mode, step {s['step']}/{s.get('steps', '?')}, "
                     f"weights v{s['version']}, {s['elapsed_s']:.0f} s")
        if s["reward"]:
            lines.append("  reward:       " + "  ".join(f"{t}={v:.3f}"
                                                      for t, v in s["reward"].items()))
        if s["trajectories"]:
            lines.append("  trajectories: " + "  ".join(f"{k}={v}" for k, v in
                                                      s["trajectories"].items()))
        if s["staleness"]:
            lines.append("  staleness:    " + "  ".join(f"{k}:{v}" for k, v in
                                                      s["staleness"].items())
                         + "  (versions behind: trained samples)")
        if s.get("agents"):
            lines.append("  agents:       " + "  ".join(f"{k}={v}" for k, v in
                                                      s["agents"].items())
                         + "  (endpoint calls; history rewrites, generated tokens dropped)")
        if s.get("infra"):
            lines.append("  infra:        " + "  ".join(f"{k}={v}" for k, v in
                                                      s["infra"].items())
                         + "  (members lost to infrastructure; groups not trained)")
        lines.append(f"  env step:     p50 {s['env_step_p50_s'] * 1000:.1f} ms, "
                     f"p99 {s['env_step_p99_s'] * 1000:.1f} ms;  buffer {s['buffer']}")
        for pool, p in s["pools"].items():
            lines.append(f"  pool {pool:8s} {p['tokens_per_s']:8.1f} tok/s  busy "
                         f"{p['busy']:.0%}  {p['tokens']} tokens")
        for addr, w in s["workers"].items():
            lines.append(f"  worker {addr} ({w['pool']}): weights v{w['version']}")
        lines += [f"  warning:      {text}" for text in s.get("warnings", ())]
        lines += [f"  scaled:       {x['pool']} {x['from']} -> {x['to']} workers before step "
                  f"{x['step']}" for x in s.get("scales", ())]
    return "\n".join(lines)
