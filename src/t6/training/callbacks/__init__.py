"""The training callbacks, one concern per module; conf/callbacks/default.yaml lists them (the run adds
`SameMicroBatch` with the memory plan of a data-parallel run)."""

from t6.training.callbacks.checkpoint import RunCheckpoint
from t6.training.callbacks.compile_time import CompileTime
from t6.training.callbacks.final_validation import FinalValidation
from t6.training.callbacks.micro_batch import SameMicroBatch
from t6.training.callbacks.preemption import PreemptionCheckpoint
from t6.training.callbacks.rng import RNGState
from t6.training.callbacks.throughput import ThroughputMonitor

__all__ = [
    "CompileTime",
    "FinalValidation",
    "PreemptionCheckpoint",
    "RNGState",
    "RunCheckpoint",
    "SameMicroBatch",
    "ThroughputMonitor",
]
