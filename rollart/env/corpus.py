"""Deprecated: ``rollart.env.corpus`` is now ``rollart.corpus``.

A plain re-export kept for one release so old imports still work. Objects are defined,
and pickle, at the new path only.
"""

import warnings

from rollart.corpus import *  # noqa: F401,F403

warnings.warn("rollart.env.corpus moved to rollart.corpus "
              "(this path goes in the next release)", DeprecationWarning, stacklevel=2)
