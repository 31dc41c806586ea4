"""``RollartPlugin``: the scheduler side of rollart's live figures.

Consumes the ``rollart`` events the driver's ``Monitor`` publishes (``log_event`` hook)
and keeps one ``RunState`` per run. At start it adds, to whatever scheduler it runs in
(the driver's, or a separate ``dask scheduler --preload rollart.observe.dashboard``):

- the Bokeh page ``/rollart`` (``rollart.observe.dashboard.page``), linked from the nav bar;
- ``rollart_*`` samples on the scheduler's Prometheus ``/metrics``;
- a ``rollart_state`` handler, so ``rollart status`` can ask for the figures.

It also keeps the latest decoded trajectories of each run (topic ``rollart-samples``,
published by ``rollart.observe.samples.SampleFeed``) for the page's trajectories section.
"""

from __future__ import annotations

import logging
import weakref

from distributed.diagnostics.plugin import SchedulerPlugin

from rollart.observe.metrics import TOPIC, TOPIC_LIVE, RunState
from rollart.observe.samples import TOPIC_SAMPLES

logger = logging.getLogger(__name__)
PAGE = "rollart"
_PLUGINS: weakref.WeakSet = weakref.WeakSet()  # live plugins in this process (Prometheus)
_COLLECTOR = None


class RollartPlugin(SchedulerPlugin):
    """Holds the runs' figures on the scheduler and serves them."""

    name = "rollart"
    idempotent = True  # registering again (driver + preload) keeps the first one

    def __init__(self):
        self.runs: dict[str, RunState] = {}
        self.samples: dict[str, list[dict]] = {}  # run -> latest decoded trajectories
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["rollart_state"] = self.state
        for topic in (TOPIC, TOPIC_LIVE, TOPIC_SAMPLES):  # published before install
            for _, msg in scheduler.get_events(topic):
                self.log_event(topic, msg)
        _cap_live_events(scheduler)
        _PLUGINS.add(self)
        _register_prometheus()
        try:
            _add_page(scheduler)
        except Exception as e:  # noqa: BLE001 - no dashboard (bokeh missing, disabled)
            logger.warning("rollart dashboard page not added: %s: %s", type(e).__name__, e)

    async def close(self) -> None:
        _PLUGINS.discard(self)

    def log_event(self, topic, msg) -> None:
        if not isinstance(msg, dict) or "run" not in msg:
            return
        if topic == TOPIC_SAMPLES:
            self.samples[msg["run"]] = list(msg.get("trajectories", []))
            return
        if topic not in (TOPIC, TOPIC_LIVE):
            return
        self.runs.setdefault(msg["run"], RunState(msg["run"])).ingest(msg)

    def latest(self) -> RunState | None:
        """The run updated last (the one the page shows by default)."""
        return max(self.runs.values(), key=lambda r: r.updated, default=None)

    def state(self, run: str | None = None) -> dict:
        """``{run: summary}`` of every run, or of ``run``."""
        runs = self.runs if run is None else {run: self.runs[run]} if run in self.runs else {}
        return {name: {**r.summary(), "rows": r.rows[-1:]} for name, r in runs.items()}


def _cap_live_events(scheduler, keep: int = 600) -> None:
    """Keep only the latest snapshots in Dask's event log (we hold what we need)."""
    from collections import deque

    try:
        topic = scheduler._broker._topics[TOPIC_LIVE]  # internal: best effort
        topic.events = deque(topic.events, maxlen=keep)
    except Exception:  # noqa: BLE001 - only memory is at stake
        pass


def get_plugin(scheduler) -> RollartPlugin | None:
    return scheduler.plugins.get(RollartPlugin.name)


def _add_page(scheduler) -> None:
    """Serve ``/rollart`` from the running dashboard and link it in the nav bar."""
    if getattr(scheduler, "http_application", None) is None:
        return
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    from rollart.observe.dashboard.page import rollart_doc  # import cycle: page reads us

    if any(getattr(a, "_rollart", False) for a in scheduler.http_application.applications):
        return
    prefix = getattr(scheduler, "http_prefix", None) or "/"
    variables = template_variables(scheduler)  # memoized; shared with the other pages
    if PAGE not in variables["pages"]:
        variables["pages"].append(PAGE)  # the nav bar link on every dashboard page
    app = BokehApplication({f"/{PAGE}": rollart_doc}, scheduler, prefix=prefix,
                           template_variables=variables)
    app._rollart = True
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()


def _register_prometheus() -> None:
    """One collector per process, reading every live plugin's runs."""
    global _COLLECTOR
    if _COLLECTOR is not None:
        return
    try:
        import prometheus_client
    except ImportError:
        return
    _COLLECTOR = _Collector()
    prometheus_client.REGISTRY.register(_COLLECTOR)


class _Collector:
    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, GaugeMetricFamily] = {}
        for plugin in list(_PLUGINS):
            for run in list(plugin.runs.values()):
                for name, help_, labels, value in run.prometheus():
                    fam = families.get(name)
                    if fam is None:
                        fam = families[name] = GaugeMetricFamily(
                            name, help_, labels=sorted(labels))
                    fam.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()

    def describe(self):
        return []


def dask_setup(scheduler) -> None:
    """Preload entry point: ``dask scheduler --preload rollart.observe.dashboard``."""
    scheduler.add_plugin(RollartPlugin(), name=RollartPlugin.name)
