"""Deprecated: ``rollart.env.workload`` is now ``rollart.chaos.workload``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chaos.workload import *  # noqa: F401,F403

warnings.warn("rollart.env.workload moved to rollart.chaos.workload "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
