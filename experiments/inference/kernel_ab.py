"""Two versions of the fused CPU decode operators (csrc/fused_decode.cpp) timed side by side on the
medium width's MHA, GQA, TPA, TPA-KVonly and MLA shapes (both versions must have each operator): the way
to tell whether a kernel change helps on a noisy machine.

    git show HEAD~1:src/t6/model/attention/csrc/fused_decode.cpp > /tmp/old.cpp
    python experiments/inference/kernel_ab.py /tmp/old.cpp [NEW.cpp] [--contexts 16k,32k] [--threads 1]

NEW defaults to the project's own source. Each version is compiled with the project's flags into a
folder of its own; the calls alternate between the versions, one call each per round, so that both
see the same machine; per operator and context it prints the median and the best call of each and
their ratios (new / old), after checking that both give the same result.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from t6.bench.common import median, model_config_of, time_call
from t6.bench.harness import ints
from t6.model.attention import fused_decode


def build(source: Path, tag: str):
    folder = Path(tempfile.mkdtemp(prefix=f"t6_kernel_ab_{tag}_"))
    return cpp_extension.load(
        name=f"t6_fused_decode_{tag}",
        sources=[str(source)],
        extra_cflags=fused_decode.CFLAGS,
        extra_ldflags=fused_decode.LDFLAGS,
        build_directory=str(folder),
    )


def calls(S: int, size: str) -> dict:
    """operator name -> (extension -> its output) on random inputs of the size's shapes, context S."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    tpa, kvonly, mla, mha, gqa = (model_config_of(n, size) for n in ("tpa", "tpa_kvonly", "mla", "mha", "gqa"))
    h, d, o = tpa.n_head, tpa.head_dim, tpa.attention_options
    q_a, q_b = r(1, o["q_rank"], h), r(1, o["q_rank"], d)  # A_Q [1, R_Q, h], B_Q [1, R_Q, d_h]
    a_k, b_k = r(1, S, o["k_rank"], h), r(1, S, o["k_rank"], d)  # [1, S, R_K, h], [1, S, R_K, d_h]
    a_v, b_v = r(1, S, o["v_rank"], h), r(1, S, o["v_rank"], d)
    hk, ok = kvonly.n_head, kvonly.attention_options
    q = r(1, hk, d)  # the full query [1, h, d_h]
    kv = [r(1, S, ok["k_rank"], hk), r(1, S, ok["k_rank"], d), r(1, S, ok["v_rank"], hk), r(1, S, ok["v_rank"], d)]
    hm, om = mla.n_head, mla.attention_options
    q_lat, q_rope = r(1, hm, om["kv_lora_rank"]), r(1, hm, om["rope_dim"])  # absorbed query [1, h, d_c], [1, h, d_r]
    c, k_rope = r(1, S, om["kv_lora_rank"]), r(1, S, om["rope_dim"])  # latents [1, S, d_c], RoPE keys [1, S, d_r]
    grouped = {}
    for name, cfg in (("mha", mha), ("gqa", gqa)):
        h_kv = cfg.attention_options.get("n_kv_head") or cfg.n_head
        k, v = r(1, h_kv, S, cfg.head_dim), r(1, h_kv, S, cfg.head_dim)  # head-major K, V [1, h_kv, S, d_h]
        grouped[name] = (r(1, cfg.n_head, cfg.head_dim), k, v)  # the query [1, h, d_h]
    return {
        **{n: (lambda ext, a=a: ext.gqa_decode(*a, None, None, None)) for n, a in grouped.items()},
        "tpa": lambda ext: ext.tpa_decode(q_a, q_b, a_k, b_k, a_v, b_v, None),
        "tpa_kvonly": lambda ext: ext.tpa_decode(None, q, *kv, None),
        "mla": lambda ext: ext.latent_decode(q_lat, q_rope, c, k_rope, None),
    }


def cpu_time(fn) -> float:
    """Seconds of the calling thread's CPU time one call of fn takes."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path, nargs="?", default=fused_decode.CSRC)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--contexts", type=ints, default=ints("16k,32k"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time each call by the calling thread's CPU time (one thread only): on a machine other jobs load, "
        "the time the thread ran, not the time it waited for a core",
    )
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures the calling thread: give --threads 1")
    torch.set_num_threads(args.threads)
    exts = [build(args.old, "old"), build(args.new, "new")]
    what = "CPU ms of the calling thread" if args.cpu_time else "ms"
    print(f"{args.size}, {args.threads} thread(s), {args.rounds} rounds; {what} per call: old / new (new/old)")
    for S in args.contexts:
        for name, fn in calls(S, args.size).items():
            try:
                out_old = fn(exts[0])
            except AttributeError:  # an operator the old version does not have
                print(f"{name:>10} {S:>6}: only in the new version")
                continue
            out_new = fn(exts[1])
            torch.testing.assert_close(out_new, out_old, rtol=1e-4, atol=1e-5, msg=f"{name} at {S}: results differ")
            times = [[], []]
            for _ in range(args.rounds):
                for i, ext in enumerate(exts):
                    times[i].append(
                        1e3
                        * (
                            cpu_time(lambda ext=ext: fn(ext))
                            if args.cpu_time
                            else time_call(lambda ext=ext: fn(ext), 1, "cpu")
                        )
                    )
            (m0, m1), (b0, b1) = (median(t) for t in times), (min(t) for t in times)
            medians = f"median {m0:6.2f} / {m1:6.2f} ({m1 / m0:.2f})"
            print(f"{name:>10} {S:>6}: {medians}, best {b0:6.2f} / {b1:6.2f} ({b1 / b0:.2f})")


if __name__ == "__main__":
    main()
