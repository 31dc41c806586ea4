"""rollart on the Dask dashboard: the ``/rollart`` page, ``rollart_*`` Prometheus figures.

In the driver's scheduler the control loop installs ``RollartPlugin`` itself; for a
separate scheduler process preload it::

    dask scheduler --preload rollart.observe.dashboard
"""

from rollart.observe.dashboard.plugin import RollartPlugin, dask_setup, get_plugin

__all__ = ["RollartPlugin", "dask_setup", "get_plugin"]
