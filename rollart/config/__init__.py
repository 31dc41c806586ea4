"""What a run is made of: the graph, ``--set`` overrides, the checks before a run starts."""
