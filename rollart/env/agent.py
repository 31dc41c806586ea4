"""Deprecated: ``rollart.env.agent`` is now ``rollart.agents.agent``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.agents.agent import *  # noqa: F401,F403
from rollart.agents.agent import Task  # noqa: F401 (it re-exported Task)

warnings.warn("rollart.env.agent moved to rollart.agents.agent "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
