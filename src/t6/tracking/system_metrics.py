"""The run's system metrics (CPU, memory, disk, network, GPU when present) through MLflow's own monitor."""

from __future__ import annotations


class SystemMetrics:
    """MLflow's SystemMetricsMonitor on a run: `system/cpu_utilization_percentage`,
    `system/system_memory_usage_megabytes`, disk and network, and `system/gpu_*` where
    nvidia-ml-py finds a GPU, sampled every `interval_s` seconds while the run is RUNNING."""

    def __init__(
        self, run_id: str, tracking_uri: str, interval_s: float = 10.0, resume: bool = False, node_id: str | None = None
    ):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(
            run_id,
            sampling_interval=interval_s,
            resume_logging=resume,
            node_id=node_id,
            tracking_uri=tracking_uri,
        )

    def __enter__(self) -> SystemMetrics:
        self.monitor.start()
        return self

    def __exit__(self, *exc) -> None:
        self.monitor.finish()
