"""Deprecated: ``rollart.env.faults`` is now ``rollart.chaos.faults``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chaos.faults import *  # noqa: F401,F403

warnings.warn("rollart.env.faults moved to rollart.chaos.faults "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
