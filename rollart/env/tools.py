"""Deprecated: ``rollart.env.tools`` is now ``rollart.chat.tools``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chat.tools import *  # noqa: F401,F403

warnings.warn("rollart.env.tools moved to rollart.chat.tools "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
