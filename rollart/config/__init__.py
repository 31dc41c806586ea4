"""What a run is made of: the graph, the hardware pools, affinities, overrides, preflight checks."""
