"""What the library's own matmuls reach at MLA's absorbed-decode shapes (medium: 23 heads, d_c 256,
d_rope 32), next to the square-matmul peak that t6.bench.decode's roofline uses.

    python experiments/inference/gemm_ceiling.py [--threads 1]

Per cached token MLA's decode is two thin GEMMs: scores = cache [S, d_c + d_rope] x query^T
[d_c + d_rope, h] and values = P [h, S] x latents [S, d_c], 2 h (d_c + d_rope) + 2 h d_c FLOPs in
all. With h = 23 columns they run far below a square matmul's FLOP/s; the time printed here, the
two GEMMs alone (no softmax, no projections), is a practical floor for an unfused decode step.
"""

import argparse

import torch

from t6.bench.common import model_config_of, time_call


def best(fn, calls: int = 5, rounds: int = 5) -> float:
    """Seconds per call, the best of `rounds` rounds of `calls` calls after one warm-up call."""
    fn()
    return min(time_call(fn, calls, "cpu") for _ in range(rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peak = 2 * 1024**3 / best(lambda: a @ b) / 1e9
    print(f"threads {args.threads}: square 1024 matmul {peak:.1f} GFLOP/s")
    mla = model_config_of("mla", "medium")  # the heads and widths from the configs
    h, d_c, d_rope = mla.n_head, mla.attention_options["kv_lora_rank"], mla.attention_options["rope_dim"]
    for S in (16384, 32768):
        cache = torch.randn(S, d_c + d_rope)  # [S, d_c + d_rope]: latents and RoPE keys
        q = torch.randn(h, d_c + d_rope)  # [h, d_c + d_rope]: the absorbed query
        p = torch.randn(h, S)  # [h, S]: softmax weights
        # the fastest of the layouts a caller could pick for the scores
        t_scores = min(best(lambda: q @ cache.t()), best(lambda: cache @ q.t().contiguous()))
        t_values = best(lambda: p @ cache[:, :d_c])  # [h, S] x [S, d_c] -> [h, d_c]
        f_scores, f_values = 2 * S * (d_c + d_rope) * h, 2 * S * d_c * h
        both = (f_scores + f_values) / (t_scores + t_values) / 1e9
        print(
            f"S={S}: scores {f_scores / t_scores / 1e9:.1f} GFLOP/s ({f_scores / t_scores / 1e9 / peak:.2f} of peak), "
            f"values {f_values / t_values / 1e9:.1f} ({f_values / t_values / 1e9 / peak:.2f}), "
            f"both {both:.1f} ({both / peak:.2f}): {1e3 * (t_scores + t_values):.2f} ms"
        )


if __name__ == "__main__":
    main()
