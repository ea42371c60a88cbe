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
#include <type_traits>
#include <vector>

namespace {

constexpr int BLOCK = 32;     // tokens per block (scores, softmax update, value accumulation)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same<T, float>::value)
    std::memcpy(dst, src, n * sizeof(float));
  else
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// rows [N, n] (contiguous) -> dst [N, n_pad] as float; the padding columns are left as they are (zero).
template <typename T>
inline void rows_to_float(const T* src, int N, int n, float* dst, int n_pad) {
  for (int r = 0; r < N; ++r) to_float(src + (int64_t)r * n, dst + (int64_t)r * n_pad, n);
}

// e^(x - n ln 2) for x - n ln 2 in about [-ln2/2, ln2/2] (a Cephes-style polynomial, relative
// error ~2e-7), on a vector of floats: the body of exp_nonpositive below.
template <typename T>
inline T exp_reduced(T x, T n) {
  T r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}

// Combine the partial (m, l, acc) of `parts` splits of one row into out [h_out, d_out] (as float),
// scaled by 1/(l * div): m, l [parts, h], acc [parts, h, W].
void combine(const float* m, const float* l, const float* acc, int parts, int h, int W, float div, float* out,
             int h_out, int d_out) {
  std::vector<float> scale(parts);
  for (int i = 0; i < h_out; ++i) {
    float mx = NEG_INF;
    for (int k = 0; k < parts; ++k) mx = std::max(mx, m[k * h + i]);
    float denom = 0.f;
    for (int k = 0; k < parts; ++k) {
      scale[k] = m[k * h + i] == NEG_INF ? 0.f : std::exp(m[k * h + i] - mx);
      denom += scale[k] * l[k * h + i];
    }
    for (int j = 0; j < d_out; ++j) {
      float s = 0.f;
      for (int k = 0; k < parts; ++k) s += scale[k] * acc[((int64_t)k * h + i) * W + j];
      out[(int64_t)i * d_out + j] = s / (denom * div);
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

// ---- The block loops on float vectors of the machine's width (GCC/Clang vector extensions:
// 16 floats in a zmm register with AVX-512, 8 in a ymm with AVX, 4 with SSE or NEON). Head counts
// and widths are padded with zeros to whole vectors (padded() below).

#if defined(__AVX512F__)
constexpr int VLEN = 16;
constexpr int TILE_H = 4;  // heads per value tile
constexpr int NV = 4;      // vectors of columns per value tile: 4 heads x 4 = 16 of the 32 zmm registers
#elif defined(__AVX__)
constexpr int VLEN = 8;
constexpr int TILE_H = 6;  // 6 heads x 2 = 12 of the 16 ymm registers (+2 value rows, 1 weight)
constexpr int NV = 2;
#else
constexpr int VLEN = 4;
constexpr int TILE_H = 4;
constexpr int NV = 4;  // 4 heads x 4 = 16 of the 32 NEON registers (SSE: 16, some spill)
#endif
// Head counts and widths are padded to a multiple of the vector width, so loops over them have no
// scalar tail (MLA's 23 heads at medium: 24 with AVX2, 32 with AVX-512).
inline int padded(int h) { return (h + VLEN - 1) / VLEN * VLEN; }
typedef float vf __attribute__((vector_size(VLEN * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VLEN * sizeof(int32_t))));
typedef float vfu __attribute__((vector_size(VLEN * sizeof(float)), aligned(4)));  // loads/stores at any float offset

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
inline vf splat(float x) {
#if defined(__clang__) || __GNUC__ >= 12
  const vf v = {x};  // a broadcast; the "0 + x" form below also costs an add on the FMA port
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#elif defined(__AVX__)
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
#else
  return __builtin_shufflevector(v, v, 0, 0, 0, 0);
#endif
#else
  return vf{} + x;
#endif
}
#if defined(__clang__) || __GNUC__ >= 12
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
inline float hsum(vf x) {  // a tree of halves down to 4 lanes, then 4 -> 1, in registers
#if defined(__AVX512F__)
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  const v8 y = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 s4 = __builtin_shufflevector(y, y, 0, 1, 2, 3) + __builtin_shufflevector(y, y, 4, 5, 6, 7);
#elif defined(__AVX__)
  const v4 s4 = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
#else
  const v4 s4 = x;
#endif
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#else
inline float hsum(vf x) {  // older compilers: through memory
  float s[VLEN];
  std::memcpy(s, &x, sizeof(s));
  float t = 0.f;
  for (int i = 0; i < VLEN; ++i) t += s[i];
  return t;
}
#endif

inline float hmax(vf x) {  // through memory: once per block and head
  float s[VLEN];
  std::memcpy(s, &x, sizeof(s));
  float t = s[0];
  for (int i = 1; i < VLEN; ++i) t = std::max(t, s[i]);
  return t;
}

// Keeps a vector in a register: where a loaded vector feeds several FMAs, the compiler otherwise folds the load
// into each of them, and a zmm load per FMA halves their rate on a Zen 4 (its zmm loads take both load ports):
// the TPA and GQA operators 6-13% faster, TPA-KVonly and MLA 10-20%, by the thread's CPU time at 16k-32k.
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(x) asm("" : "+v"(x))
#else
#define IN_REGISTER(x) asm("" : "+w"(x))
#endif

// exp(x) for x <= 0, branch-free (exactly 0 below -87 and for -inf): n = round(x / ln 2) by
// truncation of y - 1/2 (y <= 0), then the polynomial, times 2^n.
inline vf exp_nonpositive(vf x) {
  const vf xc = x < -87.f ? splat(-87.f) : x;
  const vi ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi);
  const vf p = exp_reduced(xc, __builtin_convertvector(ni, vf));
  const vf scale = (vf)((ni + 127) << 23);  // 2^n
  return x < -87.f ? splat(0.f) : p * scale;
}

// acc[i, :] += sum_n w[n, i] v[n, :] for heads i0..i0+TH-1, columns j0.. (C vectors): a register
// tile of TH heads x C vectors of columns.
template <int TH, int C>
inline void accumulate_tile(float* acc, int dp, int i0, int j0, const float* w, int hp, const float* v, int64_t ldv, int N) {
  vf a[TH][C];
  for (int ii = 0; ii < TH; ++ii)
    for (int k = 0; k < C; ++k) a[ii][k] = load(acc + (int64_t)(i0 + ii) * dp + j0 + VLEN * k);
  for (int n = 0; n < N; ++n) {
    vf vn[C];
    for (int k = 0; k < C; ++k) {
      vn[k] = load(v + n * ldv + j0 + VLEN * k);
      IN_REGISTER(vn[k]);  // one load per row, not one per head
    }
    const float* wn = w + (int64_t)n * hp + i0;
    for (int ii = 0; ii < TH; ++ii) {
      const vf c = splat(wn[ii]);
      for (int k = 0; k < C; ++k) a[ii][k] += c * vn[k];
    }
  }
  for (int ii = 0; ii < TH; ++ii)
    for (int k = 0; k < C; ++k) store(acc + (int64_t)(i0 + ii) * dp + j0 + VLEN * k, a[ii][k]);
}

// y[m, :] = sum_k x[m, k] z[k, :] for rows m < M (x row stride ldx; z [K, hp], y [M, hp], hp a
// multiple of VLEN): register tiles of R rows x C vectors of columns (a tile's rows past M read
// row M - 1 and are not stored).
template <int R, int C>
inline void rows_gemm_tile(const float* x, int ldx, int K, const float* z, int hp, int M, int j0, float* y) {
  for (int m0 = 0; m0 < M; m0 += R) {
    const float* xr[R];
    for (int mm = 0; mm < R; ++mm) xr[mm] = x + (int64_t)std::min(m0 + mm, M - 1) * ldx;
    vf a[R][C] = {};
    for (int k = 0; k < K; ++k) {
      vf zk[C];
      for (int c = 0; c < C; ++c) {
        zk[c] = load(z + (int64_t)k * hp + j0 + VLEN * c);
        IN_REGISTER(zk[c]);  // one load per k, not one per row
      }
      for (int mm = 0; mm < R; ++mm) {
        const vf xm = splat(xr[mm][k]);
        for (int c = 0; c < C; ++c) a[mm][c] += xm * zk[c];
      }
    }
    for (int mm = 0; mm < R && m0 + mm < M; ++mm)
      for (int c = 0; c < C; ++c) store(y + (int64_t)(m0 + mm) * hp + j0 + VLEN * c, a[mm][c]);
  }
}

// With AVX2 (measured on a Zen 3 EPYC) a broadcast costs a slot of the vector units, so the tiles
// are as wide as the columns allow: 2 rows x 6 vectors, 3 x 4, then 4 x 3 (broadcasts per FMA 1/6,
// 1/4, 1/3: TPA's 47 medium heads padded to 48 take 2 x 6, TPA-KVonly's 29 -> 32 take 3 x 4, MLA's
// 23 -> 24 take 4 x 3). Elsewhere tiles of 4 rows x 3, 2 or 1 vectors (measured on a Xeon).
constexpr bool WIDE_ROW_TILES = VLEN == 8;

void rows_gemm(const float* x, int ldx, int K, const float* z, int hp, int M, float* y) {
  int j0 = 0;
  if constexpr (WIDE_ROW_TILES) {
    for (; j0 + 6 * VLEN <= hp; j0 += 6 * VLEN) rows_gemm_tile<2, 6>(x, ldx, K, z, hp, M, j0, y);
    for (; j0 + 4 * VLEN <= hp; j0 += 4 * VLEN) rows_gemm_tile<3, 4>(x, ldx, K, z, hp, M, j0, y);
  }
  for (; j0 + 3 * VLEN <= hp; j0 += 3 * VLEN) rows_gemm_tile<4, 3>(x, ldx, K, z, hp, M, j0, y);
  for (; j0 + 2 * VLEN <= hp; j0 += 2 * VLEN) rows_gemm_tile<4, 2>(x, ldx, K, z, hp, M, j0, y);
  for (; j0 < hp; j0 += VLEN) rows_gemm_tile<4, 1>(x, ldx, K, z, hp, M, j0, y);
}

// y[c * ys] = x . z[c] for c < C (x [dp], z [C, dp] with row stride ldz, dp a multiple of VLEN): four
// rows of z at a time, so that four chains of FMAs run side by side (one chain waits on each FMA's latency).
inline void dots(const float* x, const float* z, int64_t ldz, int C, int dp, float* y, int ys = 1) {
  int c0 = 0;
  for (; c0 + 4 <= C; c0 += 4) {
    const float* z0 = z + (int64_t)c0 * ldz;
    vf s0{}, s1{}, s2{}, s3{};
    for (int j = 0; j < dp; j += VLEN) {
      const vf xj = load(x + j);
      s0 += xj * load(z0 + j);
      s1 += xj * load(z0 + ldz + j);
      s2 += xj * load(z0 + 2 * ldz + j);
      s3 += xj * load(z0 + 3 * ldz + j);
    }
    y[c0 * ys] = hsum(s0), y[(c0 + 1) * ys] = hsum(s1), y[(c0 + 2) * ys] = hsum(s2), y[(c0 + 3) * ys] = hsum(s3);
  }
  for (; c0 < C; ++c0) {
    vf s{};
    for (int j = 0; j < dp; j += VLEN) s += load(x + j) * load(z + (int64_t)c0 * ldz + j);
    y[c0 * ys] = hsum(s);
  }
}

// Software prefetch of the next block's cache rows (four streams: B_K, A_K, A_V, B_V), a few
// 64-byte lines at a time between the steps of this block, so that memory keeps streaming while
// the block computes (the hardware prefetchers follow one stream at a time, phase by phase:
// 8-15% of the TPA operator at 16k-32k with the cache out of cache).
// The lines go to L2 (prefetcht1) by default: 9-13% faster TPA, TPA-KVonly and GQA operators than into L1
// (prefetcht0) on a Zen 4 EPYC at 16k-32k, MLA's 4%, measured by the calling thread's CPU time, one thread;
// MHA's (a dot per token and head, its two rows streamed once) was 3-5% faster into L1 (`l1`).
struct Prefetch {
  const char* p[4] = {};
  int64_t bytes[4] = {}, total = 0, at = 0;  // at: the next line's offset in stream k
  int streams = 0, k = 0;
  bool l1 = false;
  void add(const void* ptr, int64_t n) {
    if (streams < 4 && n > 0) p[streams] = static_cast<const char*>(ptr), bytes[streams++] = n, total += n;
  }
  void lines(int count) {  // the next `count` cache lines, stream after stream (a pointer and two compares each)
    for (; count > 0 && k < streams; --count) {
      if (l1)
        __builtin_prefetch(p[k] + at, 0, 3);
      else
        __builtin_prefetch(p[k] + at, 0, 2);
      at += 64;
      if (at >= bytes[k]) at = 0, ++k;
    }
  }
};

// One column of tiles: columns j0.. (C vectors) of every head i < h rounded up to 2 (hp, a whole
// number of vectors, is even; the padding heads beyond are skipped), in tiles of TILE_H heads, then
// of 2. The value rows' slice stays in L1 while every head passes over it (MLA's 32-token block of
// 256-wide latents fills a 32 KB L1 by itself; on a Zen 3 EPYC this order made the TPA, TPA-KVonly
// and MLA operators 6-10% faster at 16k than every column of one head tile after another).
template <int C>
void accumulate_cols(float* acc, int h, int hp, int dp, int j0, const float* w, const float* v, int64_t ldv, int N,
                     Prefetch& pf, int per_tile) {
  const int h2 = (h + 1) / 2 * 2;
  int i0 = 0;
  for (; i0 + TILE_H <= h2; i0 += TILE_H) {
    pf.lines(per_tile);
    accumulate_tile<TILE_H, C>(acc, dp, i0, j0, w, hp, v, ldv, N);
  }
  for (; i0 < h2; i0 += 2) {
    pf.lines(per_tile);
    accumulate_tile<2, C>(acc, dp, i0, j0, w, hp, v, ldv, N);
  }
}

// acc [hp, dp] += w^T v for the heads i < h: w [N, hp], v rows N x dp with stride ldv; columns in
// slices of NV vectors, then of one.
void accumulate_v(float* acc, int h, int hp, int dp, const float* w, const float* v, int64_t ldv, int N,
                  Prefetch& pf) {
  const int slices = dp / (NV * VLEN) + dp % (NV * VLEN) / VLEN;
  const int per_tile = 1 + (int)(pf.total / 64) / (slices * ((h + TILE_H - 1) / TILE_H));
  int j0 = 0;
  for (; j0 + NV * VLEN <= dp; j0 += NV * VLEN) accumulate_cols<NV>(acc, h, hp, dp, j0, w, v, ldv, N, pf, per_tile);
  for (; j0 < dp; j0 += VLEN) accumulate_cols<1>(acc, h, hp, dp, j0, w, v, ldv, N, pf, per_tile);
}

// The online-softmax update for one block, a vector of heads at a time: sc [n, hp] -> p in place;
// m, l [hp] and acc [hp, dp] rescaled where a head's running max grew.
void softmax_update_v(float* sc, int n, int hp, float* m, float* l, float* acc, int dp) {
  for (int i0 = 0; i0 < hp; i0 += VLEN) {
    const vf m_old = load(m + i0);
    vf mx = m_old;
    for (int t = 0; t < n; ++t) {
      const vf s = load(sc + t * hp + i0);
      mx = s > mx ? s : mx;
    }
    const vf m_new = mx == NEG_INF ? splat(0.f) : mx;  // 0 while nothing is visible (weights stay 0)
    const vf corr = m_old == NEG_INF ? splat(0.f) : exp_nonpositive(m_old - m_new);
    vf l_ = load(l + i0) * corr;
    for (int i = 0; i < VLEN; ++i)
      if (mx[i] > m_old[i] && m_old[i] != NEG_INF) {
        float* ai = acc + (int64_t)(i0 + i) * dp;
        const vf c = splat(corr[i]);
        for (int j = 0; j < dp; j += VLEN) store(ai + j, load(ai + j) * c);
      }
    for (int t = 0; t < n; ++t) {
      const vf p = exp_nonpositive(load(sc + t * hp + i0) - m_new);
      store(sc + t * hp + i0, p);
      l_ += p;
    }
    store(l + i0, l_);
    store(m + i0, mx);
  }
}

template <typename scalar_t>
void tpa_kernel(const torch::Tensor& q_a, const torch::Tensor& q_b, const torch::Tensor& a_k, const torch::Tensor& b_k,
                const torch::Tensor& a_v, const torch::Tensor& b_v, const torch::Tensor& mask, torch::Tensor& out) {
  const int64_t B = a_k.size(0), S = a_k.size(1);
  const int RK = a_k.size(2), h = a_k.size(3), d = b_k.size(3), RV = a_v.size(2);
  const bool factored = q_a.defined();
  const int RQ = factored ? q_a.size(1) : 0;
  const int hp = padded(h), dp = padded(d);  // zero padding: zero scores' factors, zero value columns
  const bool direct = std::is_same<scalar_t, float>::value && d == dp;  // B_K, B_V rows used in place
  const int parts = splits_for(B, S);
  const int64_t per = (S + parts - 1) / parts;
  std::vector<float> m(B * parts * hp, NEG_INF), l(B * parts * hp, 0.f), acc(B * parts * hp * dp, 0.f);
  auto qa32 = torch::zeros({B, std::max(RQ, 1), hp}, torch::kFloat);  // A_Q [B, R_Q, hp]
  if (factored) qa32.narrow(2, 0, h).copy_(q_a);
  torch::Tensor qb32;  // B_Q [B, R_Q, dp], or the full query transposed [B, d_h, hp]
  if (factored) {
    qb32 = torch::zeros({B, RQ, dp}, torch::kFloat);
    qb32.narrow(2, 0, d).copy_(q_b);
  } else {
    qb32 = torch::zeros({B, d, hp}, torch::kFloat);
    qb32.narrow(2, 0, h).copy_(q_b.transpose(1, 2));
  }
  const bool* mk = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mk_b = mask.defined() ? mask.stride(0) : 0;
  at::parallel_for(0, B * parts, 1, [&](int64_t lo, int64_t hi) {
    // A_K, A_V rows of a block as float, [n R, h] unpadded: the vector of heads i0..i0+VLEN-1 read at
    // row h + i0 runs into the next row's first heads (or the zero slack after the last row); they
    // land in the padding heads h..hp, whose query (A_Q, q^T) is zero, so no real head sees them.
    std::vector<float> ak(BLOCK * RK * h + VLEN, 0.f), av(BLOCK * RV * h + VLEN, 0.f);
    std::vector<float> bk(BLOCK * RK * dp, 0.f), bv(BLOCK * RV * dp, 0.f), sc(BLOCK * hp), w(BLOCK * RV * hp);
    std::vector<float> g(BLOCK * RK * std::max(RQ, 1)), qb(BLOCK * RK * hp);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / parts, part = task % parts;
      const int64_t s_lo = part * per, s_hi = std::min(S, s_lo + per);
      float* m_ = m.data() + task * hp;
      float* l_ = l.data() + task * hp;
      float* acc_ = acc.data() + task * hp * dp;
      const float* qa = qa32.data_ptr<float>() + b * qa32.stride(0);
      const float* qq = qb32.data_ptr<float>() + b * qb32.stride(0);
      for (int64_t s0 = s_lo; s0 < s_hi; s0 += BLOCK) {
        const int n = (int)std::min<int64_t>(BLOCK, s_hi - s0);
        // fp32 A rows are read in place, except in the last block, whose last row's read would run
        // past the cache (the copy's zero slack stands in for it there)
        const bool a_direct = std::is_same<scalar_t, float>::value && s0 + n < S;
        const scalar_t* akp = a_k.data_ptr<scalar_t>() + b * a_k.stride(0) + s0 * a_k.stride(1);
        const scalar_t* avp = a_v.data_ptr<scalar_t>() + b * a_v.stride(0) + s0 * a_v.stride(1);
        if (!a_direct) {
          to_float(akp, ak.data(), (int64_t)n * RK * h);
          to_float(avp, av.data(), (int64_t)n * RV * h);
        }
        const float* akb = a_direct ? reinterpret_cast<const float*>(akp) : ak.data();
        const float* avb = a_direct ? reinterpret_cast<const float*>(avp) : av.data();
        const float* bkb = direct ? reinterpret_cast<const float*>(b_k.data_ptr<scalar_t>() + b * b_k.stride(0) + s0 * b_k.stride(1)) : bk.data();
        const float* bvb = direct ? reinterpret_cast<const float*>(b_v.data_ptr<scalar_t>() + b * b_v.stride(0) + s0 * b_v.stride(1)) : bv.data();
        if (!direct) {
          rows_to_float(b_k.data_ptr<scalar_t>() + b * b_k.stride(0) + s0 * b_k.stride(1), n * RK, d, bk.data(), dp);
          rows_to_float(b_v.data_ptr<scalar_t>() + b * b_v.stride(0) + s0 * b_v.stride(1), n * RV, d, bv.data(), dp);
        }
        Prefetch pf;
        if (s0 + n < s_hi) {
          const int64_t n2 = std::min<int64_t>(BLOCK, s_hi - s0 - n), e = sizeof(scalar_t);
          pf.add(b_k.data_ptr<scalar_t>() + b * b_k.stride(0) + (s0 + n) * b_k.stride(1), n2 * RK * d * e);
          pf.add(akp + n * a_k.stride(1), n2 * RK * h * e);
          pf.add(avp + n * a_v.stride(1), n2 * RV * h * e);
          pf.add(b_v.data_ptr<scalar_t>() + b * b_v.stride(0) + (s0 + n) * b_v.stride(1), n2 * RV * d * e);
        }
        // factorized query: g[row, r'] = B_K[row] . B_Q[r']: [n R_K, R_Q], row = t R_K + r
        if (factored)
          for (int row = 0; row < n * RK; ++row) {
            pf.lines(4);
            dots(bkb + (int64_t)row * dp, qq, dp, RQ, dp, g.data() + (int64_t)row * RQ);
          }
        // qb[t R_K + r, :] = sum_r' g[row, r'] A_Q[r', :]   (factorized query): g [n R_K, R_Q] x A_Q [R_Q, hp]
        //                 = sum_j B_K[row, j] q^T[j, :]    (full query):       B_K [n R_K, d] x q^T [d, hp]
        if (factored) rows_gemm(g.data(), RQ, RQ, qa, hp, n * RK, qb.data());
        else rows_gemm(bkb, dp, d, qq, hp, n * RK, qb.data());
        // sc[t, i] = sum_r A_K[t, r, i] qb[t R_K + r, i]: [n, hp]
        for (int t = 0; t < n; ++t) {
          pf.lines(4);
          const bool visible = !mk || mk[b * mk_b + s0 + t];
          for (int i0 = 0; i0 < hp; i0 += VLEN) {
            vf s{};
            for (int r = 0; r < RK; ++r) {
              const int row = t * RK + r;
              s += load(akb + (int64_t)row * h + i0) * load(qb.data() + (int64_t)row * hp + i0);
            }
            store(sc.data() + t * hp + i0, visible ? s : splat(NEG_INF));
          }
        }
        softmax_update_v(sc.data(), n, hp, m_, l_, acc_, dp);
        // w[t R_V + r, i] = P[t, i] A_V[t, r, i]: [n R_V, hp]
        for (int t = 0; t < n; ++t)
          for (int r = 0; r < RV; ++r)
            for (int i0 = 0; i0 < hp; i0 += VLEN) {
              const int row = t * RV + r;
              store(w.data() + row * hp + i0, load(sc.data() + t * hp + i0) * load(avb + (int64_t)row * h + i0));
            }
        accumulate_v(acc_, h, hp, dp, w.data(), bvb, dp, n * RV, pf);
      }
    }
  });
  auto out32 = torch::empty({B, h, d}, torch::kFloat);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b)
      combine(m.data() + b * parts * hp, l.data() + b * parts * hp, acc.data() + b * parts * hp * dp, parts, hp, dp,
              (float)RV, out32.data_ptr<float>() + b * h * d, h, d);
  });
  out.copy_(out32);
}

// One query head's online-softmax update for a block of tokens, vectorized over the tokens (where a K/V head has
// one query head or a few: a vector of heads would be mostly padding): s [BLOCK] its scores, -inf where hidden or
// past n, become the probabilities relative to the new max; m, l and acc [dp] are the head's running max,
// denominator and numerator, rescaled where the max grew; then acc += sum_t p[t] v[t, :], in slices of tokens
// with the next block's prefetch between them (MHA's cache is streamed, the lines spread, not issued at once).
void head_update(float* s, float* m, float* l, float* acc, int dp, const float* v, int64_t ldv, int n, Prefetch& pf) {
  vf mx = splat(*m);
  for (int t = 0; t < BLOCK; t += VLEN) {
    const vf x = load(s + t);
    mx = x > mx ? x : mx;
  }
  const float m_raw = hmax(mx), m_new = m_raw == NEG_INF ? 0.f : m_raw;
  const float corr = *m == NEG_INF ? 0.f : std::exp(*m - m_new);
  vf sum{};
  for (int t = 0; t < BLOCK; t += VLEN) {
    const vf p = exp_nonpositive(load(s + t) - m_new);
    store(s + t, p);
    sum += p;
  }
  *l = *l * corr + hsum(sum);
  if (m_raw > *m && *m != NEG_INF)
    for (int j = 0; j < dp; j += VLEN) store(acc + j, load(acc + j) * splat(corr));
  *m = m_raw;
  constexpr int SLICE = 8;  // tokens per slice
  const int per_slice = 1 + (int)(pf.total / 64) / (BLOCK / SLICE);
  for (int t0 = 0; t0 < n; t0 += SLICE) {
    pf.lines(per_slice);
    const int nn = std::min(SLICE, n - t0);
    int j0 = 0;
    for (; j0 + NV * VLEN <= dp; j0 += NV * VLEN) accumulate_tile<1, NV>(acc, dp, 0, j0, s + t0, 1, v + t0 * ldv, ldv, nn);
    for (; j0 < dp; j0 += VLEN) accumulate_tile<1, 1>(acc, dp, 0, j0, s + t0, 1, v + t0 * ldv, ldv, nn);
  }
}

// The block's rows [n, d] of a cache (row stride ld, in its dtype) as float: the rows themselves where they are
// fp32 and a whole number of vectors wide (`direct`), else converted into buf, zero-padded to dp columns.
template <typename scalar_t>
inline const float* float_rows(const scalar_t* src, int64_t ld, int n, int d, int dp, bool direct, float* buf,
                               int64_t& ld_out) {
  if (direct) {
    ld_out = ld;
    return reinterpret_cast<const float*>(src);
  }
  for (int t = 0; t < n; ++t) to_float(src + t * ld, buf + (int64_t)t * dp, d);
  ld_out = dp;
  return buf;
}

// Grouped decoding: h query heads in n groups of g = h / n; group j reads K/V head j of the cache.
//   scores[t, i] = q[i] . k[j, t] (+ q_rope[i] . k_rope[t]);  out[i, :] = sum_t P[t, i] v[j, t, :]
// k [B, n, S, d_k] and v [B, n, S, d_v] (strided: each token's row contiguous), v possibly k itself (the
// latent form: MLA's one latent, read once for scores and values); k_rope [B, S, d_rope] shared by every
// head, or undefined. One task per (row, group, split of the cached tokens); each a block of tokens at a time.
template <typename scalar_t>
void grouped_kernel(const torch::Tensor& q, const torch::Tensor& q_rope, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& k_rope, const torch::Tensor& mask, torch::Tensor& out) {
  const int64_t B = k.size(0), S = k.size(2);
  const int n = k.size(1), dk = k.size(3), dv = v.size(3), h = q.size(1), g = h / n;
  const bool rope = k_rope.defined();
  const int dr = rope ? k_rope.size(2) : 0;
  const int gp = padded(g), kp = padded(dk), vp = padded(dv), rp = padded(std::max(dr, 1));
  const bool is_float = std::is_same<scalar_t, float>::value;
  const bool shared = v.is_same(k);  // the values are the keys' rows: read and converted once
  const bool k_direct = is_float && dk == kp, v_direct = is_float && dv == vp, r_direct = is_float && dr == rp;
  // scores by one dot per (token, head) where the group is small (MHA: one head per group; a dot costs its
  // FMAs and ~8 more to sum its vector), else as a [tokens, d_k] x [d_k, gp] product (each row of k read
  // once for every head of the group)
  const bool by_dots = g * (kp / VLEN + 8) < dk * (gp / VLEN);
  const bool per_head = by_dots && !rope;  // and the softmax vectorized over tokens, not over padded heads
  const int parts = splits_for(B * n, S);
  const int64_t per = (S + parts - 1) / parts;
  const int64_t programs = B * n * parts;
  std::vector<float> m(programs * gp, NEG_INF), l(programs * gp, 0.f), acc(programs * gp * vp, 0.f);
  // each group's queries as float: rows [h, kp] (dots) and transposed [n, d_k, gp] (products); zero padding
  auto qrows = torch::zeros({B, h, kp}, torch::kFloat);
  qrows.narrow(2, 0, dk).copy_(q);
  auto zq = torch::zeros({B, n, dk, gp}, torch::kFloat);
  zq.narrow(3, 0, g).copy_(q.reshape({B, n, g, dk}).transpose(2, 3));
  auto zr = torch::zeros({B, n, std::max(dr, 1), gp}, torch::kFloat);
  if (rope) zr.narrow(3, 0, g).copy_(q_rope.reshape({B, n, g, dr}).transpose(2, 3));
  const bool* mk = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const int64_t mk_b = mask.defined() ? mask.stride(0) : 0;
  const scalar_t* kd = k.data_ptr<scalar_t>();
  const scalar_t* vd = v.data_ptr<scalar_t>();
  const scalar_t* rd = rope ? k_rope.data_ptr<scalar_t>() : nullptr;
  at::parallel_for(0, programs, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> kb(BLOCK * kp, 0.f), vb(BLOCK * vp, 0.f), rb(BLOCK * rp, 0.f), sc(BLOCK * gp, 0.f);
    std::vector<float> s2(BLOCK * gp), sh(BLOCK);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / (n * parts), j = task / parts % n, part = task % parts;
      const int64_t s_lo = part * per, s_hi = std::min(S, s_lo + per);
      float* m_ = m.data() + task * gp;
      float* l_ = l.data() + task * gp;
      float* acc_ = acc.data() + task * gp * vp;
      const float* qr = qrows.data_ptr<float>() + (b * h + j * g) * kp;
      const float* zqb = zq.data_ptr<float>() + (b * n + j) * dk * gp;
      const float* zrb = zr.data_ptr<float>() + (b * n + j) * std::max(dr, 1) * gp;
      for (int64_t s0 = s_lo; s0 < s_hi; s0 += BLOCK) {
        const int nt = (int)std::min<int64_t>(BLOCK, s_hi - s0);
        const scalar_t* kpt = kd + b * k.stride(0) + j * k.stride(1) + s0 * k.stride(2);
        const scalar_t* vpt = vd + b * v.stride(0) + j * v.stride(1) + s0 * v.stride(2);
        const scalar_t* rpt = rope ? rd + b * k_rope.stride(0) + s0 * k_rope.stride(1) : nullptr;
        int64_t ldk, ldv, ldr = rp;
        const float* kf = float_rows(kpt, k.stride(2), nt, dk, kp, k_direct, kb.data(), ldk);
        const float* vf_ = shared ? kf : float_rows(vpt, v.stride(2), nt, dv, vp, v_direct, vb.data(), ldv);
        if (shared) ldv = ldk;
        const float* rf = rope ? float_rows(rpt, k_rope.stride(1), nt, dr, rp, r_direct, rb.data(), ldr) : nullptr;
        Prefetch pf;  // the next block, where its rows are contiguous
        pf.l1 = by_dots;
        if (s0 + nt < s_hi) {
          const int64_t n2 = std::min<int64_t>(BLOCK, s_hi - s0 - nt), e = sizeof(scalar_t);
          if (k.stride(2) == dk) pf.add(kpt + nt * k.stride(2), n2 * dk * e);
          if (!shared && v.stride(2) == dv) pf.add(vpt + nt * v.stride(2), n2 * dv * e);
          if (rope && k_rope.stride(1) == dr) pf.add(rpt + nt * k_rope.stride(1), n2 * dr * e);
        }
        if (per_head) {  // each query head on its own, its softmax over the block's tokens
          for (int i = 0; i < g; ++i) {
            float* si = sh.data();  // [BLOCK]: head i's scores
            dots(qr + (int64_t)i * kp, kf, ldk, nt, kp, si, 1);
            for (int t = 0; t < BLOCK; ++t)
              if (t >= nt || (mk && !mk[b * mk_b + s0 + t])) si[t] = NEG_INF;
            head_update(si, m_ + i, l_ + i, acc_ + (int64_t)i * vp, vp, vf_, ldv, nt, pf);
          }
          continue;
        }
        // scores [nt, gp]: k [nt, d_k] x q^T [d_k, gp] (+ k_rope [nt, d_rope] x q_rope^T [d_rope, gp])
        if (by_dots)
          for (int i = 0; i < g; ++i) {
            pf.lines(2);
            dots(qr + (int64_t)i * kp, kf, ldk, nt, kp, sc.data() + i, gp);
          }
        else
          rows_gemm(kf, ldk, dk, zqb, gp, nt, sc.data());
        if (rope) {
          rows_gemm(rf, ldr, dr, zrb, gp, nt, s2.data());
          for (int t = 0; t < nt; ++t)
            for (int i0 = 0; i0 < gp; i0 += VLEN)
              store(sc.data() + t * gp + i0, load(sc.data() + t * gp + i0) + load(s2.data() + t * gp + i0));
        }
        if (mk)
          for (int t = 0; t < nt; ++t)
            if (!mk[b * mk_b + s0 + t])
              for (int i0 = 0; i0 < gp; i0 += VLEN) store(sc.data() + t * gp + i0, splat(NEG_INF));
        softmax_update_v(sc.data(), nt, gp, m_, l_, acc_, vp);
        // acc[i, :] += sum_t P[t, i] v[t, :]
        accumulate_v(acc_, g, gp, vp, sc.data(), vf_, ldv, nt, pf);
      }
    }
  });
  auto out32 = torch::empty({B, h, dv}, torch::kFloat);
  at::parallel_for(0, B * n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bj = lo; bj < hi; ++bj)
      combine(m.data() + bj * parts * gp, l.data() + bj * parts * gp, acc.data() + bj * parts * gp * vp, parts, gp,
              vp, 1.f, out32.data_ptr<float>() + bj * g * dv, g, dv);
  });
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
  const auto latent = c_kv.unsqueeze(1);  // one K/V head, its rows both the keys and the values
  const auto rope = k_rope.size(2) > 0 ? k_rope : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c_kv.scalar_type(), "latent_decode",
                                  [&] { grouped_kernel<scalar_t>(q_lat, q_rope, latent, latent, rope, mask, out); });
  return out;
}

torch::Tensor gqa_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const c10::optional<torch::Tensor>& q_rope, const c10::optional<torch::Tensor>& k_rope,
                         const c10::optional<torch::Tensor>& key_mask) {
  TORCH_CHECK(k.stride(-1) == 1 && v.stride(-1) == 1, "k and v must be contiguous per token");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "the query heads must be a multiple of the K/V heads");
  auto out = torch::empty({q.size(0), q.size(1), v.size(3)}, q.options());
  auto mask = mask_or_empty(key_mask);
  const auto qr = q_rope.has_value() ? *q_rope : torch::Tensor();
  const auto kr = k_rope.has_value() ? *k_rope : torch::Tensor();
  TORCH_CHECK(!kr.defined() || kr.stride(-1) == 1, "k_rope must be contiguous per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "gqa_decode",
                                  [&] { grouped_kernel<scalar_t>(q, qr, k, v, kr, mask, out); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tpa_decode", &tpa_decode);
  m.def("latent_decode", &latent_decode);
  m.def("gqa_decode", &gqa_decode);
}
