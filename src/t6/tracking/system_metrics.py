"""The run's system metrics (CPU, memory, disk, network, GPU when present) from every node, by MLflow's monitors."""

from __future__ import annotations

import threading
from pathlib import Path

import lightning as L
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from t6.tracking.outbox import Outbox, OutboxClient

PREFIX = "system/"  # MLflow's own prefix for system metrics


class NodeMonitor(SystemMetricsMonitor):
    """MLflow's SystemMetricsMonitor (its CPU, memory, disk, network and GPU monitors: `monitors`, sampled by its
    `collect_metrics` and `aggregate_metrics`) on a thread of its own logging through an outbox:
    `system/cpu_utilization_percentage`, ... (`system/<node>/...` with several nodes), at the training step when
    sampled. MLflow's own loop stops for good at the first failed read of the run; this one goes on while the
    store is away (the samples wait in the outbox)."""

    def __init__(self, client: OutboxClient, run_id: str, interval_s: float, node_id: str | None, step):
        super().__init__(
            run_id,
            sampling_interval=interval_s,
            samples_before_logging=1,
            node_id=node_id,
            tracking_uri=client.outbox.uri,  # its own (unused) logger would otherwise open ./mlflow.db
        )
        self.client, self.run, self.step = client, run_id, step
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.monitor, daemon=True, name="t6-system-metrics")
        self.thread.start()

    def monitor(self) -> None:
        while not self.stopping.is_set():
            self.collect_metrics()
            if self.stopping.wait(self.sampling_interval):
                return
            self.publish_metrics(self.aggregate_metrics())

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        prefix = PREFIX + (self.node_id + "/" if self.node_id else "")
        now, step = get_current_time_millis(), self.step()
        self.client.log_batch(self.run, metrics=[Metric(prefix + k, v, now, step) for k, v in metrics.items()])
        for monitor in self.monitors:
            monitor.clear_metrics()

    def finish(self) -> None:
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None


class SystemMetrics(L.Callback):
    """One `NodeMonitor` per node (its local rank 0), every `interval_s` seconds while fitting. The MLflow run is
    created by rank 0 (a new run's id exists there alone), so the ranks receive its id at setup; a node other than
    rank 0's logs through an outbox of its own (`<outbox_dir>/system-node<k>.jsonl`)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.monitor: NodeMonitor | None = None
        self.outbox: Outbox | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from t6.tracking.logger import OutboxMLFlowLogger

        logger = next((lg for lg in trainer.loggers if isinstance(lg, OutboxMLFlowLogger)), None)
        if logger is None or stage != "fit":
            return
        run_id = trainer.strategy.broadcast(logger.run_id if trainer.is_global_zero else None)  # every rank calls it
        if trainer.local_rank != 0:
            return
        if trainer.is_global_zero:
            client = logger.experiment
        else:
            spool = Path(logger.outbox_dir) / f"system-node{trainer.node_rank}.jsonl"
            self.outbox = Outbox(logger.tracking_uri, spool)
            client = OutboxClient(self.outbox)
        node = f"node{trainer.node_rank}" if trainer.num_nodes > 1 else None
        self.monitor = NodeMonitor(client, run_id, self.interval_s, node, lambda: trainer.global_step)
        self.monitor.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop(timeout_s=10.0)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.stop(timeout_s=5.0)

    def stop(self, timeout_s: float) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        if self.outbox is not None:
            self.outbox.close(timeout_s)
            self.outbox = None
