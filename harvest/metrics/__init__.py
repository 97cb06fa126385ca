"""Prometheus metrics (prometheus-client, imported lazily) and GPU telemetry (nvidia-ml-py)."""
