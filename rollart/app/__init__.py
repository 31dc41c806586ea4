"""Entry points: the CLI, the notebook API, finished runs read back."""
