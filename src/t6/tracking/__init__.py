"""Tracking in MLflow: the store and logger, sweeps as parent and child runs, system metrics."""
