"""What a run shows: metrics, trackers, figures, plots, samples, the dashboard.

Consumes the fleet's stats samples and the trainer's step reports (``figures``,
``monitor``, ``silent``), a run directory's ``metrics.jsonl`` and Parquet samples
(``report``, ``plots``, ``samples``) and a model folder (``evaluate``: held-out
evaluation, no Dask); produces a step's metrics row, tracker logs (TensorBoard, MLflow,
W&B), ``reward.png``, decoded trajectories, the progress lines and widget, the
``/rollart`` dashboard page and the ``rollart_*`` Prometheus figures. Called by the
control loop and the CLI.
"""
