"""The ``/rollart`` Bokeh page: one run's live figures, refreshed twice a second.

Reads the ``RunState`` kept by ``RollartPlugin`` on the scheduler (the latest run, or
``/rollart?run=NAME``). Each plot's data source is named ``rollart-<plot>`` so a test
(or a curious user in the browser console) can read what is drawn. Below the plots, the
``rollart-samples`` section shows the latest decoded trajectories of each task (turn by
turn: observation, action and its policy version; reward, outcome), as
``rollart.observe.samples.SampleFeed`` published them. Silent tasks
(``rollart.observe.silent``) are named under the header in ``rollart-warning`` lines
while they last.
"""

from __future__ import annotations

import html

from bokeh.layouts import column, gridplot, row
from bokeh.models import Button, ColumnDataSource, Div, FactorRange, Spinner, TextInput
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from rollart.observe.metrics import LATENCY_EDGES, SCALE_TOPIC, TRAJ_STATES, RunState
from rollart.observe.samples import samples_html

PLOTS = ("reward", "states", "staleness", "latency", "tokens", "busy", "versions", "buffer")
MARKS = ("scales",)  # drawn over plots: the pools resized (empty in a run never resized)


def _fig(title: str, **kw):
    f = figure(title=title, height=260, sizing_mode="stretch_width",
               tools="pan,wheel_zoom,box_zoom,reset,hover", **kw)
    f.toolbar.logo = None
    return f


class RollartPage:
    """The figures and how one ``RunState`` fills them."""

    def __init__(self, plugin, run: str | None = None):
        self.plugin, self.run = plugin, run
        self.sources = {p: ColumnDataSource(name=f"rollart-{p}") for p in PLOTS + MARKS}
        self.header = Div(name="rollart-header", text="<b>RollArt</b>: waiting for a run "
                          "(start one with rollart.train or rollart.start_run)",
                          sizing_mode="stretch_width")
        self._seen = None
        self._samples_seen = None
        self.samples = Div(name="rollart-samples", sizing_mode="stretch_width",
                           text="<h3>Latest trajectories</h3>" + samples_html([]))
        s = self.sources
        s["reward"].data = {"xs": [], "ys": [], "task": [], "color": []}
        s["tokens"].data = {"xs": [], "ys": [], "pool": [], "color": []}
        s["states"].data = {"state": list(TRAJ_STATES), "count": [0] * len(TRAJ_STATES)}
        s["staleness"].data = {"behind": [], "count": []}
        s["latency"].data = {"left": [], "right": [], "count": []}
        s["busy"].data = {"xs": [], "ys": [], "pool": [], "color": []}
        s["versions"].data = {"worker": [], "version": []}
        s["buffer"].data = {"t": [], "rows": []}
        s["scales"].data = {"step": [], "t": [], "label": []}  # pools resized: the marks

        reward = _fig("Reward per task (trained batch mean)", x_axis_label="trainer step")
        reward.multi_line("xs", "ys", color="color", legend_field="task", line_width=2,
                          source=s["reward"])
        reward.ray(x="step", y=0, length=0, angle=90, angle_units="deg", color="#888",
                   line_dash="dashed", source=s["scales"])  # each resize, at its step
        states = _fig("Trajectories by state", x_range=FactorRange(*TRAJ_STATES))
        states.vbar(x="state", top="count", width=0.8, source=s["states"])
        states.xaxis.major_label_orientation = 0.6
        stale = _fig("Staleness of trained samples", x_axis_label="versions behind trainer")
        stale.vbar(x="behind", top="count", width=0.8, source=s["staleness"])
        lat = _fig("Env step latency (last 1000 steps)", x_axis_type="log",
                   x_axis_label="seconds")
        lat.quad(left="left", right="right", top="count", bottom=0, source=s["latency"])
        tokens = _fig("Generated tokens/s per inference pool", x_axis_label="seconds")
        tokens.multi_line("xs", "ys", color="color", legend_field="pool", line_width=2,
                          source=s["tokens"])
        tokens.ray(x="t", y=0, length=0, angle=90, angle_units="deg", color="#888",
                   line_dash="dashed", source=s["scales"])  # ... and at its time
        busy = _fig("Busy fraction per inference pool", x_axis_label="seconds",
                    y_range=(0, 1.05))
        busy.multi_line("xs", "ys", color="color", legend_field="pool", line_width=2,
                        source=s["busy"])
        self.version_range = FactorRange()
        versions = _fig("Weight version per inference worker", y_range=self.version_range)
        versions.hbar(y="worker", right="version", height=0.6, source=s["versions"])
        buffer = _fig("Sample buffer size (trajectories)", x_axis_label="seconds")
        buffer.line("t", "rows", line_width=2, source=s["buffer"])
        grid = gridplot([[reward, states], [stale, lat], [tokens, busy], [versions, buffer]],
                        sizing_mode="stretch_width", toolbar_location="right")
        # resize a pool of the run between its steps (rollart.control.scaling, as
        # `rollart scale` does: a request on the scheduler's event topic)
        self.scale_pool = TextInput(name="rollart-scale-pool", title="pool (name or tag)",
                                    value="env", width=160)
        self.scale_n = Spinner(name="rollart-scale-n", title="workers", low=0, step=1,
                               value=1, width=90)
        self.scale_button = Button(name="rollart-scale", label="scale", width=80)
        self.scale_button.on_click(self.ask_scale)
        self.scale_said = Div(name="rollart-scale-said", text="")
        scale = row(self.scale_pool, self.scale_n, self.scale_button, self.scale_said)
        self.root = column(self.header, scale, grid, self.samples,
                           sizing_mode="stretch_width", name="rollart")

    def ask_scale(self) -> None:
        """The scale control: ask the shown run to run ``n`` workers in the pool."""
        r, pool, n = self.state(), self.scale_pool.value.strip(), int(self.scale_n.value)
        scheduler = getattr(self.plugin, "scheduler", None)
        if r is None or r.status != "running" or scheduler is None or not pool:
            self.scale_said.text = "no running run to scale"
            return
        scheduler.log_event(SCALE_TOPIC, {"run": r.run, "pool": pool, "n": n})
        self.scale_said.text = (f"asked {html.escape(r.run)} to run {n} worker(s) in "
                                f"{html.escape(pool)} from its next step")

    def state(self) -> RunState | None:
        if self.run and self.run in self.plugin.runs:
            return self.plugin.runs[self.run]
        return self.plugin.latest()

    def update(self) -> None:
        r = self.state()
        if r is not None:
            self._update_samples(r.run)
        if r is None or (r.run, r.updated) == self._seen:
            return
        self._seen = (r.run, r.updated)
        s, snap, summ = self.sources, r.snapshot, r.summary()
        curves = r.reward_curves()
        colors = [Category10_10[i % 10] for i in range(len(curves))]
        s["reward"].data = {"xs": [c[0] for c in curves.values()],
                            "ys": [c[1] for c in curves.values()],
                            "task": list(curves), "color": colors}
        states = snap.get("states", {})
        s["states"].data = {"state": list(TRAJ_STATES),
                            "count": [states.get(k, 0) for k in TRAJ_STATES]}
        s["staleness"].data = {"behind": list(r.staleness), "count": list(r.staleness.values())}
        counts = snap.get("env_latency", [])
        if counts:
            edges = list(LATENCY_EDGES)
            s["latency"].data = {"left": edges, "right": edges[1:] + [edges[-1] * 10 ** 0.25],
                                 "count": counts}
        pools = sorted(snap.get("pools", {}))
        t0 = r.series[0]["time"] if r.series else 0
        for name, key in (("tokens", "tokens_per_s"), ("busy", "busy")):
            s[name].data = {
                "xs": [[p["time"] - t0 for p in r.series] for _ in pools],
                "ys": [[p.get(f"{key}/{pool}", 0) for p in r.series] for pool in pools],
                "pool": pools, "color": [Category10_10[i % 10] for i in range(len(pools))]}
        t_scale = [x["time"] - t0 if x.get("time") and t0 else 0 for x in summ["scales"]]
        s["scales"].data = {"step": [x["step"] for x in summ["scales"]], "t": t_scale,
                            "label": [f"{x['pool']} {x['from']} -> {x['to']} workers before "
                                      f"step {x['step']}" for x in summ["scales"]]}
        workers = snap.get("workers", {})
        names = [f"{w['pool']} {a.split('://')[-1]}" for a, w in sorted(workers.items())]
        self.version_range.factors = names
        s["versions"].data = {"worker": names,
                              "version": [w["version"] for _, w in sorted(workers.items())]}
        s["buffer"].data = {"t": [p["time"] - t0 for p in r.series],
                            "rows": [p["buffer"] for p in r.series]}
        info = r.info
        self.header.text = (
            f"<b>RollArt run {r.run}</b> — {info.get('graph', '?')} graph, "
            f"{info.get('mode', '?')} mode (alpha {info.get('alpha', '?')}) — "
            f"<span id='rollart-status'>{r.status}</span>, step {summ['step']}"
            f"/{info.get('steps', '?')}, {summ['elapsed_s']:.0f} s, "
            f"{states.get('launched', 0)} trajectories launched, "
            f"env step p99 {summ['env_step_p99_s'] * 1000:.0f} ms"
            + "".join(f"<br><span class='rollart-warning' style='color:#b00'>warning: "
                      f"{html.escape(text)}</span>" for text in summ["warnings"])
            + "".join(f"<br><span class='rollart-scale'>scaled: {html.escape(x)}</span>"
                      for x in s["scales"].data["label"]))


    def _update_samples(self, run: str) -> None:
        trajs = getattr(self.plugin, "samples", {}).get(run, [])
        if (run, id(trajs)) == self._samples_seen:
            return
        self._samples_seen = (run, id(trajs))
        self.samples.text = "<h3>Latest trajectories</h3>" + samples_html(trajs)


def rollart_doc(scheduler, extra, doc) -> None:
    """Bokeh document factory, as ``distributed.dashboard`` calls it."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    from rollart.observe.dashboard.plugin import get_plugin  # import cycle: plugin serves us

    args = doc.session_context.request.arguments if doc.session_context else {}
    run = args.get("run", [b""])[0].decode() or None
    page = RollartPage(get_plugin(scheduler), run)
    page.update()
    doc.add_periodic_callback(page.update, 500)
    doc.add_root(page.root)
    doc.title = "Dask: RollArt"
    doc.theme = BOKEH_THEME
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
