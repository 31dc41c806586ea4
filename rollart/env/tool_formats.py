"""Deprecated: ``rollart.env.tool_formats`` is now ``rollart.chat.tool_formats``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chat.tool_formats import *  # noqa: F401,F403

warnings.warn("rollart.env.tool_formats moved to rollart.chat.tool_formats "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
