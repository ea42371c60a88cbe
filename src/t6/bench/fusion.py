"""What inductor makes of one attention layer's training step, per mechanism: kernels, library calls and bytes.

    python -m t6.bench.fusion --size medium --seq-len 1024 --dtype bfloat16 --json fusion.json

Each mechanism's layer (its parameter-matched heads at --size, no cache: the training path) is compiled forward
and backward by inductor as training compiles it (AOTAutograd's partition, inductor's decompositions, joint-graph
passes and fusion), scheduled for Triton (inductor's GPU code generator, its fusion rules; code generation
itself needs a GPU, so it stops after fusion and the layer runs eagerly). Nothing is timed: per graph, the
kernels inductor would generate, the library calls it leaves (matmuls, batched matmuls, attention) and the bytes
each reads and writes (inductor's own count, `get_read_write_buffers_sizes`), per token of the batch. The bytes
of the generated kernels are the part a fused kernel could cut; the library calls' are fixed by their inputs.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from t6.bench import harness
from t6.bench.common import model_configs
from t6.bench.harness import DTYPES, common_args
from t6.model.attention import get_attention_class
from t6.model.config import ModelConfig


class FusionRecorder:
    """A torch.compile backend: inductor's compile_fx with an inner compile that schedules each graph (forward,
    then backward at the first backward) for Triton, records the fused nodes and returns the graph to run
    eagerly."""

    STOP = "t6.bench.fusion: fusion recorded"

    def __init__(self):
        self.graphs: list[list[tuple[str, str, int]]] = []  # per graph: (kind, library call, bytes) per node

    def record(self, nodes):
        from torch._inductor.ir import MultiOutput
        from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

        rows = []
        for n in nodes:
            if isinstance(n, NopKernelSchedulerNode):
                continue  # views and reinterpretations: no kernel, no bytes
            if isinstance(n, ExternKernelSchedulerNode):
                if isinstance(n.node, MultiOutput):
                    continue  # one output of a call already counted (attention's outputs): no kernel, no bytes
                op = getattr(n.node, "op_overload", None)  # a fallback to an ATen operator (attention)
                name = op.overloadpacket.__name__ if op is not None else str(n.node.python_kernel_name)
                rows.append(("library", name.rsplit(".", 1)[-1], n.get_read_write_buffers_sizes()))
            else:
                rows.append(("kernel", "", n.get_read_write_buffers_sizes()))
        self.graphs.append(rows)
        raise RuntimeError(self.STOP)  # before code generation, which needs the GPU

    def inner(self, gm, example_inputs, **kwargs):
        from functorch.compile import make_boxed_func
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner

        with config.patch(cpu_backend="triton", _post_fusion_custom_pass=self.record, fx_graph_cache=False):
            try:
                compile_fx_inner(gm, example_inputs, **kwargs)
            except Exception as err:
                if self.STOP not in str(err):
                    raise
        return make_boxed_func(gm.forward)

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=self.inner)


def layer_fusion(mcfg: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """One layer of mcfg's attention, forward and backward through FusionRecorder -> its record."""
    torch.manual_seed(0)
    layer = get_attention_class(mcfg.attention)(mcfg).to(dtype)
    x = torch.randn(batch, seq_len, mcfg.d_model, dtype=dtype, requires_grad=True)  # [B, T, d]
    pos = torch.arange(seq_len)  # [T]
    recorder = FusionRecorder()
    torch._dynamo.reset()
    out = torch.compile(layer, backend=recorder, fullgraph=True, dynamic=False)(x, pos)  # [B, T, d]
    out.backward(torch.ones_like(out))
    tokens = batch * seq_len
    record = {"attention": mcfg.attention, "n_head": mcfg.n_head, "head_dim": mcfg.head_dim}
    for phase, rows in zip(("forward", "backward"), recorder.graphs):
        calls = Counter(name for kind, name, _ in rows if kind == "library")
        record[f"{phase}_kernels"] = sum(kind == "kernel" for kind, _, _ in rows)
        record[f"{phase}_library_calls"] = ", ".join(f"{n} {name}" for name, n in sorted(calls.items()))
        record[f"{phase}_kernel_bytes_per_token"] = sum(b for kind, _, b in rows if kind == "kernel") / tokens
        record[f"{phase}_library_bytes_per_token"] = sum(b for kind, _, b in rows if kind == "library") / tokens
    return record


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, mcfg in model_configs(args.attentions, args.size).items():
        rows.append(layer_fusion(mcfg, args.batch_size, args.seq_len, DTYPES[args.dtype]))
        print(f"  {name}: {rows[-1]['forward_kernels']} + {rows[-1]['backward_kernels']} kernels", flush=True)
    return rows


COLUMNS = [
    ("attention", "attention", ""),
    ("n_head", "heads", "d"),
    ("forward_kernels", "fw kernels", "d"),
    ("forward_library_calls", "fw library calls", ""),
    ("forward_kernel_bytes_per_token", "fw kernel B/token", ",.0f"),
    ("forward_library_bytes_per_token", "fw library B/token", ",.0f"),
    ("backward_kernels", "bw kernels", "d"),
    ("backward_library_calls", "bw library calls", ""),
    ("backward_kernel_bytes_per_token", "bw kernel B/token", ",.0f"),
    ("backward_library_bytes_per_token", "bw library B/token", ",.0f"),
]


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    common_args(parser, size="medium", device="cpu", dtype="bfloat16")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = harness.parse(parser, argv)
    rows = run(args)
    result = harness.result(
        "fusion", "cpu", rows, size=args.size, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len
    )
    harness.finish(result, COLUMNS, args.json)
    return result


if __name__ == "__main__":
    main()
