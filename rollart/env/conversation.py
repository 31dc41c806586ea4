"""Deprecated: ``rollart.env.conversation`` is now ``rollart.chat.conversation`` (and
its ``parse_action`` helpers ``rollart.chat.actions``).

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chat.actions import *  # noqa: F401,F403 (the parse_action helpers were here)
from rollart.chat.conversation import *  # noqa: F401,F403
from rollart.chat.conversation import _WARNED  # noqa: F401 (old tests' names)

warnings.warn("rollart.env.conversation moved to rollart.chat.conversation "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
