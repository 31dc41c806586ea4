"""Entry points: the CLI, the notebook API, finished runs read back.

Consumes what a user types or calls: ``rollart train|eval|export|samples|report|status``
(``cli``), ``start_run(...)`` on a notebook's ``Client`` (``api``: a ``Run`` to watch and
stop), a run directory (``runs``: its graph, model folders and evaluation read back).
Produces runs (through ``rollart.control``), reports and exports. Called by users and
``python -m rollart``; inside rollart only the simulator's calibration (``quiet``).
"""
