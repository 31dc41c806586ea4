"""Deprecated: ``rollart.env.template_support`` is now ``rollart.chat.template_support``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chat.template_support import *  # noqa: F401,F403
from rollart.chat.template_support import _NOTED  # noqa: F401 (old tests' names)
from rollart.config.templates import check_templates  # noqa: F401 (a start check)

warnings.warn("rollart.env.template_support moved to rollart.chat.template_support "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
