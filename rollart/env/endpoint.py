"""Deprecated: ``rollart.env.endpoint`` is now ``rollart.agents.endpoint``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.agents.endpoint import *  # noqa: F401,F403

warnings.warn("rollart.env.endpoint moved to rollart.agents.endpoint "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
