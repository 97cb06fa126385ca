"""Trace-driven replay of a decode instance (trace reading now; the simulator later)."""
