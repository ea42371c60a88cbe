"""lm-eval's data-parallel protocol for T6LM over torch.distributed.

Every rank holds a whole model (the DDP replica, or a copy gathered from FSDP shards) and
passes its rank and the world size to lm-eval, which gives rank r the documents r, r + W, ...
(padding the shorter shares so every rank runs as many requests), and gathers the per-document
metrics to rank 0 through the three collectives below. No rank waits idle on another's whole
evaluation, so an evaluation lasts 1/W of a single-process one and the process group's timeout
bounds only the skew between ranks, not the evaluation itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from t6.evaluation.adapter import T6LM


class DataParallelT6LM(T6LM):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DataParallelT6LM needs an initialized torch.distributed process group")
        self.process_rank, self.processes = dist.get_rank(), dist.get_world_size()

    @property
    def rank(self) -> int:  # lm-eval's LM reads the process's place through these properties
        return self.process_rank

    @property
    def world_size(self) -> int:
        return self.processes

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.processes)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        out = [None] * self.processes if self.process_rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        dist.barrier()
