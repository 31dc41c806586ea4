"""The driver's control plane: placing roles, the supervisor, the modes, the loop, checkpoints."""
