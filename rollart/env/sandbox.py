"""Deprecated: ``rollart.env.sandbox`` is now ``rollart.env.adapters.sandbox``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.env.adapters.sandbox import *  # noqa: F401,F403
from rollart.env.adapters.sandbox import _ZYGOTE_PROCESS  # noqa: F401 (old tests' names)

warnings.warn("rollart.env.sandbox moved to rollart.env.adapters.sandbox "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
