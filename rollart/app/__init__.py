"""Entry points: the CLI, the notebook API, run directories, evaluation."""
