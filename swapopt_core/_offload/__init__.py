"""Activation offload: warmup tracer, residency planner, simulator and replay executor."""
