"""``python -m rollart`` is the ``rollart`` command."""

import sys

from rollart.app.cli import main

sys.exit(main())
