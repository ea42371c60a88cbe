// Fused single-token decoding on the CPU: one pass over the cache, blocks of BLOCK tokens,
// online softmax, values accumulated in registers; the cached sequence is split across
// threads and the partial softmaxes are combined at the end (split-K).
//
// tpa_decode:    scores[s, i] = sum_r A_K[s, r, i] qb[s, r, i] with
//                qb[s, r, i] = sum_r' (B_K[s, r] . B_Q[r']) A_Q[r', i]     (factorized query)
//                           or  B_K[s, r] . q[i]                             (full query)
//                out[i, :]   = sum_{s, r} P[i, s] A_V[s, r, i] B_V[s, r, :] / R_V
// latent_decode: scores[s, i] = q_lat[i] . c[s] + q_rope[i] . k_rope[s];  out[i, :] = sum_s P[i, s] c[s, :]
//
// Inputs are float32, bfloat16 or float16 (the cache dtype); arithmetic is float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int BLOCK = 32;     // tokens per block (scores, softmax update, value accumulation)
constexpr int TILE_H = 4;     // heads per register tile of the value accumulation
#if defined(__AVX512F__)
constexpr int TILE_W = 64;    // columns per register tile: 4 x 64 floats = 16 of the 32 zmm registers
#else
constexpr int TILE_W = 32;    // 4 x 32 floats = 16 ymm registers (AVX2) or 32 q registers (NEON)
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// rows [N, n] (contiguous) -> dst [N, n_pad] as float; the padding columns are left as they are (zero).
template <typename T>
inline void rows_to_float(const T* src, int N, int n, float* dst, int n_pad) {
  for (int r = 0; r < N; ++r) to_float(src + (int64_t)r * n, dst + (int64_t)r * n_pad, n);
}

constexpr int LANES = 16;  // head counts are padded to a multiple of this, so loops over heads have no scalar tail
inline int padded(int h) { return (h + LANES - 1) / LANES * LANES; }

// exp(x) for x <= 0, branch-free so that loops over it vectorize (a Cephes-style polynomial,
// relative error ~2e-7); exactly 0 below -87 (and for -inf).
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// xt [W, N] = x [N, W] transposed (N rows of a block, so later loops run along the rows).
void transpose(const float* x, int N, int W, float* xt) {
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < W; ++j) xt[(int64_t)j * N + n] = x[(int64_t)n * W + j];
}

// g [C, N] = q [C, W] x xt [W, N]: each of C query rows against N cached rows, vectorized
// along the cached rows (no horizontal sums).
void rows_times(const float* q, int C, int W, const float* xt, int N, float* g) {
  for (int c = 0; c < C; ++c) {
    float* gc = g + (int64_t)c * N;
    for (int n = 0; n < N; ++n) gc[n] = 0.f;
    const float* qc = q + (int64_t)c * W;
    for (int j = 0; j < W; ++j) {
      const float a = qc[j];
      const float* xj = xt + (int64_t)j * N;
#pragma omp simd
      for (int n = 0; n < N; ++n) gc[n] += a * xj[n];
    }
  }
}

// acc[i, :W] += sum_n w[n, i] * v[n, :W] for i < h: a [h, N]^T x [N, W] product kept in registers
// as tiles of TILE_H heads x TILE_W columns.
void accumulate(float* acc, int h, int W, const float* w, const float* v, int N) {
  for (int i0 = 0; i0 < h; i0 += TILE_H) {
    const int ih = std::min(TILE_H, h - i0);
    for (int j0 = 0; j0 < W; j0 += TILE_W) {
      const int jw = std::min(TILE_W, W - j0);
      if (ih == TILE_H && jw == TILE_W) {
        float a[TILE_H][TILE_W];
        for (int ii = 0; ii < TILE_H; ++ii)
          for (int j = 0; j < TILE_W; ++j) a[ii][j] = acc[(i0 + ii) * W + j0 + j];
        for (int n = 0; n < N; ++n) {
          const float* vn = v + (int64_t)n * W + j0;
          const float* wn = w + (int64_t)n * h + i0;
          for (int ii = 0; ii < TILE_H; ++ii) {
            const float c = wn[ii];
#pragma omp simd
            for (int j = 0; j < TILE_W; ++j) a[ii][j] += c * vn[j];
          }
        }
        for (int ii = 0; ii < TILE_H; ++ii)
          for (int j = 0; j < TILE_W; ++j) acc[(i0 + ii) * W + j0 + j] = a[ii][j];
      } else {
        for (int n = 0; n < N; ++n) {
          const float* vn = v + (int64_t)n * W + j0;
          const float* wn = w + (int64_t)n * h + i0;
          for (int ii = 0; ii < ih; ++ii) {
            const float c = wn[ii];
            float* ai = acc + (int64_t)(i0 + ii) * W + j0;
#pragma omp simd
            for (int j = 0; j < jw; ++j) ai[j] += c * vn[j];
          }
        }
      }
    }
  }
}

// The online-softmax update for one block: sc [n, h] scores (-inf where masked) -> p [n, h]
// in place; m, l [h] and acc [h, W] rescaled to the new running max. Loops run over the heads
// (contiguous), so they vectorize.
void softmax_update(float* sc, int n, int h, float* m, float* l, float* acc, int W, float* mb, float* corr) {
  for (int i = 0; i < h; ++i) mb[i] = m[i];
  for (int t = 0; t < n; ++t) {
    const float* st = sc + t * h;
#pragma omp simd
    for (int i = 0; i < h; ++i) mb[i] = std::max(mb[i], st[i]);
  }
  for (int i = 0; i < h; ++i) {  // mb: the new running max, or 0 while nothing is visible (weights stay 0)
    const float m_new = mb[i] == NEG_INF ? 0.f : mb[i];
    corr[i] = m[i] == NEG_INF ? 0.f : exp_nonpositive(m[i] - m_new);
    if (mb[i] > m[i] && m[i] != NEG_INF) {
      float* ai = acc + (int64_t)i * W;
      const float c = corr[i];
#pragma omp simd
      for (int j = 0; j < W; ++j) ai[j] *= c;
    }
    l[i] *= corr[i];
    m[i] = mb[i];
    mb[i] = m_new;
  }
  for (int t = 0; t < n; ++t) {
    float* st = sc + t * h;
#pragma omp simd
    for (int i = 0; i < h; ++i) {
      const float p = exp_nonpositive(st[i] - mb[i]);
      st[i] = p;
      l[i] += p;
    }
  }
}

// Combine the partial (m, l, acc) of `parts` splits of one row into out [h, W] (as float), scaled by 1/(l * div).
void combine(const std::vector<float>& m, const std::vector<float>& l, const std::vector<float>& acc, int parts,
             int h, int W, float div, float* out, int h_out) {
  for (int i = 0; i < h_out; ++i) {
    float mx = NEG_INF;
    for (int k = 0; k < parts; ++k) mx = std::max(mx, m[k * h + i]);
    float denom = 0.f;
    std::vector<float> scale(parts, 0.f);
    for (int k = 0; k < parts; ++k) {
      scale[k] = m[k * h + i] == NEG_INF ? 0.f : std::exp(m[k * h + i] - mx);
      denom += scale[k] * l[k * h + i];
    }
    for (int j = 0; j < W; ++j) {
      float s = 0.f;
      for (int k = 0; k < parts; ++k) s += scale[k] * acc[((int64_t)k * h + i) * W + j];
      out[(int64_t)i * W + j] = s / (denom * div);
    }
  }
}

int splits_for(int64_t B, int64_t S) {
  const int64_t threads = at::get_num_threads();
  const int64_t per_row = std::max<int64_t>(1, threads / std::max<int64_t>(B, 1));
  return (int)std::max<int64_t>(1, std::min<int64_t>(per_row, S / (4 * BLOCK)));
}

void check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.stride(-1) == 1 && t.stride(-2) == t.size(-1) && t.stride(1) == t.size(-1) * t.size(-2),
              name, " must be a cache view whose per-token [R, n] block is contiguous");
}

template <typename scalar_t>
void tpa_kernel(const torch::Tensor& q_a, const torch::Tensor& q_b, const torch::Tensor& a_k, const torch::Tensor& b_k,
                const torch::Tensor& a_v, const torch::Tensor& b_v, const torch::Tensor& mask, torch::Tensor& out) {
  const int64_t B = a_k.size(0), S = a_k.size(1);
  const int RK = a_k.size(2), h = a_k.size(3), d = b_k.size(3), RV = a_v.size(2);
  const bool factored = q_a.defined();
  const int RQ = factored ? q_a.size(1) : 0;
  const int hp = padded(h);  // heads padded with zero factors (zero scores and zero value weights)
  const int parts = splits_for(B, S);
  const int64_t per = (S + parts - 1) / parts;
  std::vector<float> m(B * parts * hp, NEG_INF), l(B * parts * hp, 0.f), acc(B * parts * hp * d, 0.f);
  torch::Tensor qa32;
  if (factored) {
    qa32 = torch::zeros({B, RQ, hp}, torch::kFloat);
    qa32.narrow(2, 0, h).copy_(q_a);
  }
  auto qb32 = q_b.to(torch::kFloat).contiguous();
  const bool* mk = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mk_b = mask.defined() ? mask.stride(0) : 0;
  at::parallel_for(0, B * parts, 1, [&](int64_t lo, int64_t hi) {
    const int C = factored ? RQ : h;  // query rows scored against each key factor row
    std::vector<float> bk(BLOCK * RK * d), bkt(BLOCK * RK * d), ak(BLOCK * RK * hp, 0.f), av(BLOCK * RV * hp, 0.f);
    std::vector<float> bv(BLOCK * RV * d), sc(BLOCK * hp, 0.f), w(BLOCK * RV * hp), g(C * BLOCK * RK), qb(hp), mb(hp), corr(hp);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / parts, part = task % parts;
      const int64_t s_lo = part * per, s_hi = std::min(S, s_lo + per);
      float* m_ = m.data() + task * hp;
      float* l_ = l.data() + task * hp;
      float* acc_ = acc.data() + task * hp * d;
      const float* qa = factored ? qa32.data_ptr<float>() + b * RQ * hp : nullptr;
      const float* qq = qb32.data_ptr<float>() + b * qb32.stride(0);
      for (int64_t s0 = s_lo; s0 < s_hi; s0 += BLOCK) {
        const int n = (int)std::min<int64_t>(BLOCK, s_hi - s0);
        const int NR = n * RK;  // key factor rows in this block, row = t R_K + r
        rows_to_float(a_k.data_ptr<scalar_t>() + b * a_k.stride(0) + s0 * a_k.stride(1), n * RK, h, ak.data(), hp);
        to_float(b_k.data_ptr<scalar_t>() + b * b_k.stride(0) + s0 * b_k.stride(1), bk.data(), (int64_t)n * RK * d);
        rows_to_float(a_v.data_ptr<scalar_t>() + b * a_v.stride(0) + s0 * a_v.stride(1), n * RV, h, av.data(), hp);
        to_float(b_v.data_ptr<scalar_t>() + b * b_v.stride(0) + s0 * b_v.stride(1), bv.data(), (int64_t)n * RV * d);
        transpose(bk.data(), NR, d, bkt.data());  // [d_h, NR]
        rows_times(qq, C, d, bkt.data(), NR, g.data());  // B_Q . B_K: [R_Q, NR], or q_i . B_K: [h, NR]
        for (int t = 0; t < n; ++t) {
          float* st = sc.data() + t * hp;
          for (int i = 0; i < hp; ++i) st[i] = 0.f;
          for (int r = 0; r < RK; ++r) {
            const int row = t * RK + r;
            const float* akr = ak.data() + row * hp;
            if (factored) {  // qb[i] = sum_r' g[r', row] A_Q[r', i]
              float* q_r = qb.data();
              for (int i = 0; i < hp; ++i) q_r[i] = 0.f;
              for (int rq = 0; rq < RQ; ++rq) {
                const float c = g[rq * NR + row];
                const float* qar = qa + rq * hp;
#pragma omp simd
                for (int i = 0; i < hp; ++i) q_r[i] += c * qar[i];
              }
#pragma omp simd
              for (int i = 0; i < hp; ++i) st[i] += akr[i] * q_r[i];
            } else {
              for (int i = 0; i < h; ++i) st[i] += akr[i] * g[i * NR + row];
            }
          }
          if (mk && !mk[b * mk_b + s0 + t])
            for (int i = 0; i < hp; ++i) st[i] = NEG_INF;
        }
        softmax_update(sc.data(), n, hp, m_, l_, acc_, d, mb.data(), corr.data());
        for (int t = 0; t < n; ++t)
          for (int r = 0; r < RV; ++r) {
            const float* p = sc.data() + t * hp;
            const float* avr = av.data() + (t * RV + r) * hp;
            float* wr = w.data() + (t * RV + r) * hp;
#pragma omp simd
            for (int i = 0; i < hp; ++i) wr[i] = p[i] * avr[i];
          }
        accumulate(acc_, hp, d, w.data(), bv.data(), n * RV);
      }
    }
  });
  auto out32 = torch::empty({B, h, d}, torch::kFloat);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      std::vector<float> mb(m.begin() + b * parts * hp, m.begin() + (b + 1) * parts * hp);
      std::vector<float> lb(l.begin() + b * parts * hp, l.begin() + (b + 1) * parts * hp);
      std::vector<float> ab(acc.begin() + b * parts * hp * d, acc.begin() + (b + 1) * parts * hp * d);
      combine(mb, lb, ab, parts, hp, d, (float)RV, out32.data_ptr<float>() + b * h * d, h);
    }
  });
  out.copy_(out32);
}

template <typename scalar_t>
void latent_kernel(const torch::Tensor& q_lat, const torch::Tensor& q_rope, const torch::Tensor& c_kv,
                   const torch::Tensor& k_rope, const torch::Tensor& mask, torch::Tensor& out) {
  const int64_t B = c_kv.size(0), S = c_kv.size(1);
  const int h = q_lat.size(1), dc = c_kv.size(2), dr = k_rope.size(2);
  const int parts = splits_for(B, S);
  const int64_t per = (S + parts - 1) / parts;
  std::vector<float> m(B * parts * h, NEG_INF), l(B * parts * h, 0.f), acc(B * parts * h * dc, 0.f);
  auto ql = q_lat.to(torch::kFloat).contiguous();
  auto qr = q_rope.to(torch::kFloat).contiguous();
  const bool* mk = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mk_b = mask.defined() ? mask.stride(0) : 0;
  at::parallel_for(0, B * parts, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c(BLOCK * dc), ct(BLOCK * dc), kr(BLOCK * dr), krt(BLOCK * dr), g(h * BLOCK), g2(h * BLOCK);
    std::vector<float> sc(BLOCK * h), mb(h), corr(h);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / parts, part = task % parts;
      const int64_t s_lo = part * per, s_hi = std::min(S, s_lo + per);
      float* m_ = m.data() + task * h;
      float* l_ = l.data() + task * h;
      float* acc_ = acc.data() + task * h * dc;
      const float* qlb = ql.data_ptr<float>() + b * h * dc;
      const float* qrb = qr.data_ptr<float>() + b * h * dr;
      for (int64_t s0 = s_lo; s0 < s_hi; s0 += BLOCK) {
        const int n = (int)std::min<int64_t>(BLOCK, s_hi - s0);
        for (int t = 0; t < n; ++t) {
          to_float(c_kv.data_ptr<scalar_t>() + b * c_kv.stride(0) + (s0 + t) * c_kv.stride(1), c.data() + t * dc, dc);
          to_float(k_rope.data_ptr<scalar_t>() + b * k_rope.stride(0) + (s0 + t) * k_rope.stride(1), kr.data() + t * dr, dr);
        }
        transpose(c.data(), n, dc, ct.data());  // [d_c, n]
        transpose(kr.data(), n, dr, krt.data());  // [d_rope, n]
        rows_times(qlb, h, dc, ct.data(), n, g.data());  // q_lat . c_kv: [h, n]
        rows_times(qrb, h, dr, krt.data(), n, g2.data());  // q_rope . k_rope: [h, n]
        for (int t = 0; t < n; ++t) {
          const bool visible = !mk || mk[b * mk_b + s0 + t];
          for (int i = 0; i < h; ++i) sc[t * h + i] = visible ? g[i * n + t] + g2[i * n + t] : NEG_INF;
        }
        softmax_update(sc.data(), n, h, m_, l_, acc_, dc, mb.data(), corr.data());
        accumulate(acc_, h, dc, sc.data(), c.data(), n);
      }
    }
  });
  auto out32 = torch::empty({B, h, dc}, torch::kFloat);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> mb(m.begin() + b * parts * h, m.begin() + (b + 1) * parts * h);
    std::vector<float> lb(l.begin() + b * parts * h, l.begin() + (b + 1) * parts * h);
    std::vector<float> ab(acc.begin() + b * parts * h * dc, acc.begin() + (b + 1) * parts * h * dc);
    combine(mb, lb, ab, parts, h, dc, 1.f, out32.data_ptr<float>() + b * h * dc, h);
  }
  out.copy_(out32);
}

torch::Tensor mask_or_empty(const c10::optional<torch::Tensor>& key_mask) {
  if (!key_mask.has_value()) return torch::Tensor();
  TORCH_CHECK(key_mask->scalar_type() == torch::kBool && key_mask->dim() == 2, "key_mask must be bool [B, S]");
  return key_mask->stride(1) == 1 ? *key_mask : key_mask->contiguous();
}

}  // namespace

torch::Tensor tpa_decode(const c10::optional<torch::Tensor>& q_a, const torch::Tensor& q_b, const torch::Tensor& a_k,
                         const torch::Tensor& b_k, const torch::Tensor& a_v, const torch::Tensor& b_v,
                         const c10::optional<torch::Tensor>& key_mask) {
  check_cache(a_k, "a_k");
  check_cache(b_k, "b_k");
  check_cache(a_v, "a_v");
  check_cache(b_v, "b_v");
  auto out = torch::empty({a_k.size(0), a_k.size(3), b_k.size(3)}, q_b.options());
  auto mask = mask_or_empty(key_mask);
  auto qa = q_a.has_value() ? *q_a : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a_k.scalar_type(), "tpa_decode",
                                  [&] { tpa_kernel<scalar_t>(qa, q_b, a_k, b_k, a_v, b_v, mask, out); });
  return out;
}

torch::Tensor latent_decode(const torch::Tensor& q_lat, const torch::Tensor& q_rope, const torch::Tensor& c_kv,
                            const torch::Tensor& k_rope, const c10::optional<torch::Tensor>& key_mask) {
  TORCH_CHECK(c_kv.stride(-1) == 1 && k_rope.stride(-1) == 1, "c_kv and k_rope must be contiguous per token");
  auto out = torch::empty(q_lat.sizes(), q_lat.options());
  auto mask = mask_or_empty(key_mask);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c_kv.scalar_type(), "latent_decode",
                                  [&] { latent_kernel<scalar_t>(q_lat, q_rope, c_kv, k_rope, mask, out); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tpa_decode", &tpa_decode);
  m.def("latent_decode", &latent_decode);
}
