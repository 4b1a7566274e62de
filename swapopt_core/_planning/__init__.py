"""Activation planning without torch: the trace and schedule IR, the planner interface, the
time-aware planner, the simulator, lower bounds and synthetic traces."""
