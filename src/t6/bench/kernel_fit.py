"""Whether the Triton decode kernels fit a GPU, checked without one: every launch the registered mechanisms make
at every size, in fp32 and bf16, compiled ahead of time for sm_90 (H100, H200) by Triton's own compiler and
ptxas, with the shared memory, registers and register spills of the code it generates.

    python -m t6.bench.kernel_fit --json kernel_fit.json

For each mechanism whose single-token cached step runs the fused operators (MHA, GQA, MQA, GTA; TPA and its
variants; MLA, GLA) and each size, one decode step's operator calls are recorded on the CPU
(t6.bench.decode_kernels.decode_calls), and the launch each would make on CUDA is planned
(t6.model.attention.triton_decode: its kernel, compile-time constants and tuning from the table by shape class and
dtype); each distinct launch and its combine kernel are compiled with `triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`. A launch fits when its shared memory is within the 232,448 B a block may use
on sm_90 and ptxas spills no register (`ptxas -v` of its PTX).
Each launch is compiled as a padded batch's fixed-shape step makes it, the one that reads the most (a key mask
and the rows' lengths).
Nothing runs: this needs no GPU, and says nothing of speed (`t6.bench.decode_kernels` measures that on one).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from t6.bench import harness
from t6.bench.common import model_configs

CAPABILITY = 90  # sm_90: H100, H200
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "u8",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "u8",
}
SIZES = ("tiny", "small", "medium", "large", "xl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def signature(kernel, args: tuple, constants: dict) -> dict[str, str]:
    """Triton's signature of a launch: each parameter's type (a pointer's element type, an integer's width) or
    `constexpr`."""
    import inspect

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32" if -(2**31) <= int(value) < 2**31 else "i64"
    return {**sig, **{name: "constexpr" for name in constants}}


def ptxas_usage(ptx: str, arch: str) -> dict:
    """Registers and spilled bytes of a kernel's PTX, from `ptxas -v` (Triton's bundled ptxas, with the register
    allocation option Triton compiles with)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [knobs.nvidia.ptxas.path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o", f"{src}.o"],
            capture_output=True,
            text=True,
            check=True,
        )
    log = done.stderr + done.stdout
    registers = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return {
        "registers": int(registers[1]) if registers else None,
        "spill_bytes": (int(stores[1]) if stores else 0) + (int(loads[1]) if loads else 0),
    }


def compile_for_sm90(kernel, args: tuple, constants: dict, num_warps: int, num_stages: int) -> dict:
    """Compile one launch for sm_90 -> its shared memory, registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature(kernel, args, constants), constexprs=constants)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", CAPABILITY, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    return {"shared_bytes": compiled.metadata.shared, **ptxas_usage(compiled.asm["ptx"], f"sm_{CAPABILITY}a")}


def planned_launches(names: list[str], sizes: list[str], dtypes: list[str]) -> list[dict]:
    """The distinct launches the mechanisms' decode steps make, with where they come from: one per kernel,
    compile-time constants and tuning (several mechanisms and sizes may share one)."""
    from t6.bench.decode_kernels import decode_calls
    from t6.model.attention import triton_decode

    planners = {
        "tpa_decode": triton_decode.tpa_launch,
        "latent_decode": triton_decode.latent_launch,
        "gqa_decode": triton_decode.gqa_launch,
    }
    found: dict[tuple, dict] = {}
    for size in sizes:
        for name, cfg in model_configs(names, size).items():
            for dtype in dtypes:
                for call in decode_calls(cfg, 2, 1, "cpu", DTYPES[dtype]):
                    # the launch that reads the most: a padded batch's fixed-shape step (key mask and lengths)
                    args = dict(call.args)
                    S = call.cached_tokens()
                    args["key_mask"] = torch.ones(1, S, dtype=torch.bool)
                    args["lengths"] = torch.ones(1, dtype=torch.int64)
                    launch = planners[call.kernel](**args)
                    t = launch.tuning
                    key = (call.kernel, tuple(sorted(launch.constants.items())), dtype, t)
                    entry = found.setdefault(
                        key,
                        {
                            "kernel": call.kernel,
                            "dtype": dtype,
                            "heads_padded": launch.HP,
                            "width_padded": launch.WP,
                            "tuning": f"{t.block_s}/{t.num_warps}/{t.num_stages}",
                            "used_by": [],
                            "launch": launch,
                        },
                    )
                    if f"{name}/{size}" not in entry["used_by"]:
                        entry["used_by"].append(f"{name}/{size}")
    return list(found.values())


def measure(names: list[str], sizes: list[str], dtypes: list[str], verbose: bool = True) -> list[dict]:
    """One record per distinct launch: its shape, tuning, shared memory, registers, spills (the decode kernel's
    and its combine kernel's), and whether it fits sm_90."""
    from t6.model.attention.triton_decode import SHARED_MEMORY_SM90, _combine_kernel

    records, combines = [], {}
    for entry in planned_launches(names, sizes, dtypes):
        launch = entry.pop("launch")
        t = launch.tuning
        main = compile_for_sm90(launch.kernel, launch.args, launch.constants, t.num_warps, t.num_stages)
        key = (launch.HP, launch.WP, launch.out.dtype)
        if key not in combines:
            combines[key] = compile_for_sm90(_combine_kernel, launch.combine_args(), launch.combine_constants(), 4, 3)
        combine = combines[key]
        record = {
            **entry,
            "used_by": ", ".join(entry["used_by"]),
            **main,
            "combine_shared_bytes": combine["shared_bytes"],
            "combine_spill_bytes": combine["spill_bytes"],
            "shared_limit": SHARED_MEMORY_SM90,
        }
        record["fits"] = (
            max(record["shared_bytes"], record["combine_shared_bytes"]) <= SHARED_MEMORY_SM90
            and record["spill_bytes"] == 0
            and record["combine_spill_bytes"] == 0
        )
        records.append(record)
        if verbose:
            r = record
            print(
                f"{r['kernel']} {r['dtype']} {r['heads_padded']}x{r['width_padded']} {r['tuning']}: shared "
                f"{r['shared_bytes']:,} B, {r['registers']} registers, {r['spill_bytes']} B spilled, fits "
                f"{r['fits']} ({r['used_by']})",
                flush=True,
            )
    return records


COLUMNS = [
    ("kernel", "kernel", ""),
    ("dtype", "dtype", ""),
    ("heads_padded", "heads", "d"),
    ("width_padded", "width", "d"),
    ("tuning", "block/warps/stages", ""),
    ("shared_bytes", "shared B", ","),
    ("registers", "registers", "d"),
    ("spill_bytes", "spilled B", "d"),
    ("combine_shared_bytes", "combine shared B", ","),
    ("fits", "fits sm_90", ""),
    ("used_by", "mechanism/size", ""),
]


def run(args: argparse.Namespace) -> dict:
    records = measure(args.attentions, args.sizes.split(","), args.dtypes.split(","), verbose=not args.quiet)
    return harness.result("kernel_fit", "cpu", records, target=f"sm_{CAPABILITY}")


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    harness.attention_args(parser, default="all")
    parser.add_argument("--sizes", default=",".join(SIZES), help="model sizes, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="cache dtypes, comma-separated")
    parser.add_argument("--quiet", action="store_true", help="print the table once, at the end")
    parser.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    return harness.run_main(parser, argv, run, COLUMNS)


if __name__ == "__main__":
    main()
