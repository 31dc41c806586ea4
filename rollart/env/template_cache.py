"""Deprecated: ``rollart.env.template_cache`` is now ``rollart.chat.template_cache``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.chat.template_cache import *  # noqa: F401,F403

warnings.warn("rollart.env.template_cache moved to rollart.chat.template_cache "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
