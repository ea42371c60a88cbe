"""The training callbacks, one concern per module; conf/callbacks/default.yaml lists them (the run's plan adds the
ones it decides on: t6.training.stop.StopProtocol always, `SameMicroBatch` with the memory plan of a data-parallel
run, the downstream evaluation and the system metrics)."""

from t6.training.callbacks.checkpoint import RunCheckpoint
from t6.training.callbacks.compile_time import CompileTime
from t6.training.callbacks.final_validation import FinalValidation
from t6.training.callbacks.micro_batch import SameMicroBatch
from t6.training.callbacks.rng import RNGState
from t6.training.callbacks.throughput import ThroughputMonitor

__all__ = [
    "CompileTime",
    "FinalValidation",
    "RNGState",
    "RunCheckpoint",
    "SameMicroBatch",
    "ThroughputMonitor",
]
