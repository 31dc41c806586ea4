"""Decisions without I/O, shared by the runtime and the simulator (rollart.sim)."""
