"""CUDA kernels of the fused attention ops (``com.microsoft`` and ``ai.onnxplug``
``Attention`` / ``MultiHeadAttention``; the CPU provider's ``attention`` kernels define them).

The generic path, for every float type: the heads are laid out as (B, N, S, H) (one copy per
operand; Attention first projects ``input @ weights + bias`` in one cuBLASLt GEMM with a bias
epilogue; at batch 1 the prepared form reads the heads in place from the projection and writes
the context in place into the output instead, through strided GEMMs: no copies),
``scale * Q @ K^T`` is one strided-batched cuBLASLt GEMM over the B*N heads into a (B, N, S, T)
scores buffer, one row kernel adds the attention bias and the masks (bias read through
broadcast strides, ``mask_filter_value`` at masked positions), takes the softmax in float32
(float64 for float64) and zeroes NaN probabilities when ``zero_nan_probabilities`` is set,
then ``P @ V`` is a second strided-batched GEMM, transposed into the (B, S, N*Hv) output.
Under the host simulation the GEMM engine's numpy path and the row kernel's numpy twin run.

float32 Attention (prepared, no past, heads of at most 64) runs one fused kernel after the
projection instead: it reads Q/K/V in place from the projection, keeps the scores on chip
(online softmax over key tiles) and writes the context in place, where the generic path copies
the heads four times; the mask's additive term is made as for the generic path. With heads of
64 and TF32 allowed (``use_tf32``, the default) on an sm_80 or later GPU, at any batch, the
kernel runs on tensor cores (``FUSED_ATTENTION_MMA``: TF32 products, float32 softmax and
accumulation, as the TF32 GEMMs of the generic path); otherwise, beyond batch 1, in float32
FMA (``FUSED_ATTENTION``, no TF32).

float16 Attention (no past; a mask or an attention bias; ``sdpa_kernel`` 0 or with the
FLASH_ATTENTION or CUDNN_FLASH_ATTENTION bit) runs cuDNN's fused attention instead, prepared
and in a signature's first run alike (``dnn.SdpaSpec``: flash attention through the
frontend's SDPA graph), reading Q/K/V in place from the projection and writing the context in
place; with the projection and the mask's additive term it is captured as one CUDA graph of
the node. Other cases, and float64, take the generic path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from onnxplug.ep import KernelContext, KernelInfo, KernelRegistry, attention, dtypes

from .. import blas, dnn
from ..compiler import ship
from ..launch import bound_calls, function_launch
from ..runtime import probe_devices
from . import _fused as F
from ._base import BF16, CudaKernel, node_graph

MS = "com.microsoft"
PLUG = "ai.onnxplug"
ATTENTION_TYPES = dtypes("float16", "float32", "float64") + BF16

_SOFTMAX_SRC = r"""
// One block per score row (b, n, s) of T keys: v = x + bias[b, n, s, t] (+ filter where masked
// by causality), rounded to the storage type and written back, then the softmax of the row in
// the compute type; NaN probabilities become 0 when zero_nan is set.
template <class Tr>
__device__ void oxa_softmax(typename Tr::S* x, const typename Tr::W* __restrict__ bias,
                            long long b0, long long b1, long long b2, long long b3,
                            long long heads, long long S, long long T, int causal,
                            double filter, int zero_nan) {
  typedef typename Tr::W W;
  __shared__ W sh[32];
  const long long row = blockIdx.x;
  const long long s = row % S, n = (row / S) % heads, b = row / (S * heads);
  typename Tr::S* xr = x + row * T;
  const long long last = s + (T - S);  // the last key a causal query sees
  W m = ox_neg_inf(W(0));
  for (long long t = threadIdx.x; t < T; t += blockDim.x) {
    W v = Tr::ld(xr[t]);
    if (bias) v += bias[b * b0 + n * b1 + s * b2 + t * b3];
    if (causal && t > last) v += W(filter);
    xr[t] = Tr::st(v);
    v = Tr::ld(xr[t]);
    m = v > m ? v : m;
  }
  m = ox_block_max(m, sh);
  W sum = W(0);
  for (long long t = threadIdx.x; t < T; t += blockDim.x) sum += exp(Tr::ld(xr[t]) - m);
  sum = ox_block_sum(sum, sh);
  for (long long t = threadIdx.x; t < T; t += blockDim.x) {
    W p = exp(Tr::ld(xr[t]) - m) / sum;
    if (zero_nan && isnan(p)) p = W(0);
    xr[t] = Tr::st(p);
  }
}

// One warp per row of up to 32 * PER keys, held in registers: one read and one write of the
// row (the block kernel above reads it three times); the same arithmetic per element.
template <class Tr, int PER>
__device__ void oxa_softmax_warp(typename Tr::S* x, const typename Tr::W* __restrict__ bias,
                                 long long b0, long long b1, long long b2, long long b3,
                                 long long heads, long long S, long long T, long long rows,
                                 int causal, double filter, int zero_nan) {
  typedef typename Tr::W W;
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const long long s = row % S, n = (row / S) % heads, b = row / (S * heads);
  typename Tr::S* xr = x + row * T;
  const long long last = s + (T - S);  // the last key a causal query sees
  const W* br = bias ? bias + b * b0 + n * b1 + s * b2 : nullptr;
  W v[PER];
  W m = ox_neg_inf(W(0));
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long t = lane + 32LL * k;
    v[k] = W(0);
    if (t < T) {
      W u = Tr::ld(xr[t]);
      if (br) u += br[t * b3];
      if (causal && t > last) u += W(filter);
      u = Tr::ld(Tr::st(u));  // rounded to the storage type, as the block kernel stores it
      v[k] = u;
      m = u > m ? u : m;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const W w = __shfl_xor_sync(0xffffffffu, m, o);
    m = w > m ? w : m;
  }
  W sum = W(0);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    if (lane + 32LL * k < T) {
      v[k] = exp(v[k] - m);
      sum += v[k];
    }
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const long long t = lane + 32LL * k;
    if (t < T) {
      W p = v[k] / sum;
      if (zero_nan && isnan(p)) p = W(0);
      xr[t] = Tr::st(p);
    }
  }
}
"""
_SOFTMAX_ENTRY = r"""
extern "C" __global__ void oxa_softmax_{k}({S}* x, const {W}* bias, long long b0, long long b1,
    long long b2, long long b3, long long heads, long long S, long long T, int causal,
    double filter, int zero_nan) {{
  oxa_softmax<{Tr}>(x, bias, b0, b1, b2, b3, heads, S, T, causal, filter, zero_nan);
}}
extern "C" __global__ void oxa_softmax_w4_{k}({S}* x, const {W}* bias, long long b0,
    long long b1, long long b2, long long b3, long long heads, long long S, long long T,
    long long rows, int causal, double filter, int zero_nan) {{
  oxa_softmax_warp<{Tr}, 4>(x, bias, b0, b1, b2, b3, heads, S, T, rows, causal, filter, zero_nan);
}}
extern "C" __global__ void oxa_softmax_w32_{k}({S}* x, const {W}* bias, long long b0,
    long long b1, long long b2, long long b3, long long heads, long long S, long long T,
    long long rows, int causal, double filter, int zero_nan) {{
  oxa_softmax_warp<{Tr}, 32>(x, bias, b0, b1, b2, b3, heads, S, T, rows, causal, filter, zero_nan);
}}
"""
_ONLINE_SOFTMAX_SRC = r"""
// The online-softmax arithmetic both fused float32 attention kernels share (oxa_fused_f32 on
// FMA, oxa_mma_f32 on tensor cores), one definition so that their results agree.
// One key's score: q.k scaled, plus the additive term, plus the causal filter past the
// diagonal; a NaN marks the row undefined.
__device__ __forceinline__ float oxa_score(float qk, float scale, float term, bool filtered,
                                           float filter, bool& bad) {
  float u = qk * scale + term;
  if (filtered) u += filter;
  if (isnan(u)) bad = true;
  return u;
}
// A tile's step of a row: the new running max from the tile's max, whether it is finite (an
// all -inf row so far gives weights 0), and the factor rescaling what was accumulated before
// (0 where there was nothing).
struct OxaStep {
  float mn;
  bool finite;
  float factor;
};
__device__ __forceinline__ OxaStep oxa_step(float m, float tile_max) {
  OxaStep st;
  st.mn = tile_max > m ? tile_max : m;
  st.finite = isfinite(st.mn);
  st.factor = (m == __uint_as_float(0xff800000u) || !st.finite) ? 0.f : expf(m - st.mn);
  return st;
}
// The row's running max and sum after the tile (its weights summing to sum); a +inf max
// (inf - inf in the row) marks the row undefined.
__device__ __forceinline__ void oxa_update(float& m, float& l, bool& bad, OxaStep st, float sum) {
  if (st.mn == __uint_as_float(0x7f800000u)) bad = true;
  l = l * st.factor + sum;
  m = st.mn;
}
"""

_FUSED_SRC = r"""
// Fused float32 attention: one block per (batch x head, tile of QT queries); the keys and
// values pass through shared memory in tiles of 32, with an online softmax (running row max
// and sum), so the (S, T) scores never reach global memory. Q, K, V and the output are read
// and written in place through (batch, sequence, head) element strides, the head dim being
// contiguous, H and Hv <= 64. The score of query s and key t is
//   x = scale * q.k + add[b*a0 + n*a1 + s*a2 + t*a3] (+ filter when causal and t > s + T - S),
// the masked softmax's (oxa_softmax) arithmetic in float32. A row whose softmax is undefined
// (a NaN or infinite score: NaN probabilities in the unfused kernel) is 0 when zero_nan is
// set, NaN otherwise. Thread (r, c) of the block (QT/2 x 8 threads) owns query rows 2r, 2r+1,
// the keys c, c+8, c+16, c+24 of a tile and the value columns 4c..4c+3 and 32+4c..32+4c+3;
// shared memory is read in float4s, without bank conflicts (rows padded to 68 floats).
#define OXA_KT 32
#define OXA_HD 64
#define OXA_PAD 68
template <int QT>
__device__ void oxa_fused_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ o, long long qb, long long qs, long long qn, long long kb, long long ks,
    long long kn, long long vb, long long vs, long long vn, long long ob, long long os,
    long long on, const float* __restrict__ add, long long a0, long long a1, long long a2,
    long long a3, int heads, int S, int T, int H, int HV, float scale, int causal, float filter,
    int zero_nan) {
  __shared__ __align__(16) float sq[QT][OXA_PAD];
  __shared__ __align__(16) float sk[OXA_KT][OXA_PAD];
  __shared__ __align__(16) float sv[OXA_KT][OXA_HD];
  __shared__ __align__(16) float sp[QT][OXA_KT + 4];
  constexpr int NT = QT * 4;
  const int tid = threadIdx.x, r0 = (tid >> 3) * 2, c = tid & 7;
  const int b = blockIdx.y / heads, n = blockIdx.y % heads, s0 = blockIdx.x * QT;
  q += b * qb + n * qn;
  k += b * kb + n * kn;
  v += b * vb + n * vn;
  o += b * ob + n * on;
  const float NEG_INF = __uint_as_float(0xff800000u);
  const int H4 = (H + 3) & ~3;  // the dot products run over whole float4s (zeros past H)
  // Loads run unrolled, so that they are all in flight at once (NT is a multiple of 64:
  // thread tid always loads head element tid % 64), and the next tile's keys and values are
  // fetched into registers while the current tile is computed.
  constexpr int ROWS_PER_PASS = NT / OXA_HD, LD = OXA_KT / ROWS_PER_PASS;
  const int hl = tid % OXA_HD, jl = tid / OXA_HD;
#pragma unroll
  for (int it = 0; it < QT / ROWS_PER_PASS; ++it) {
    const int r = jl + it * ROWS_PER_PASS;
    sq[r][hl] = (s0 + r < S && hl < H) ? q[(long long)(s0 + r) * qs + hl] : 0.f;
  }
  float rk[LD], rv[LD];
#define OXA_FETCH(T0)                                                         \
  _Pragma("unroll") for (int it = 0; it < LD; ++it) {                         \
    const int j = jl + it * ROWS_PER_PASS;                                    \
    const bool in = (T0) + j < T;                                             \
    rk[it] = (in && hl < H) ? k[(long long)((T0) + j) * ks + hl] : 0.f;       \
    rv[it] = (in && hl < HV) ? v[(long long)((T0) + j) * vs + hl] : 0.f;      \
  }
  OXA_FETCH(0)
  // the additive term of a tile, loaded a tile ahead, all at once (as in oxa_mma_f32)
  long long arow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) arow[i] = b * a0 + n * a1 + (long long)(s0 + r0 + i) * a2;
  float ad[2][4];
#define OXA_TERM(T0)                                                                  \
  _Pragma("unroll") for (int i = 0; i < 2; ++i)                                       \
  _Pragma("unroll") for (int j = 0; j < 4; ++j) {                                     \
    const int t = (T0) + c + 8 * j;                                                   \
    ad[i][j] = (add && t < T && s0 + r0 + i < S) ? add[arow[i] + t * a3] : 0.f;       \
  }
  OXA_TERM(0)
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, acc[2][8];
  bool bad[2] = {false, false};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
  for (int t0 = 0; t0 < T; t0 += OXA_KT) {
    __syncthreads();  // the previous tile's readers are done with sk, sv, sp
#pragma unroll
    for (int it = 0; it < LD; ++it) {
      sk[jl + it * ROWS_PER_PASS][hl] = rk[it];
      sv[jl + it * ROWS_PER_PASS][hl] = rv[it];
    }
    __syncthreads();
    if (t0 + OXA_KT < T) {
      OXA_FETCH(t0 + OXA_KT)
    }
    float x[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) x[i][j] = 0.f;
    for (int h = 0; h < H4; h += 4) {
      const float4 qa = *reinterpret_cast<const float4*>(&sq[r0][h]);
      const float4 qc = *reinterpret_cast<const float4*>(&sq[r0 + 1][h]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 kv = *reinterpret_cast<const float4*>(&sk[c + 8 * j][h]);
        x[0][j] = fmaf(qa.x, kv.x, x[0][j]);
        x[0][j] = fmaf(qa.y, kv.y, x[0][j]);
        x[0][j] = fmaf(qa.z, kv.z, x[0][j]);
        x[0][j] = fmaf(qa.w, kv.w, x[0][j]);
        x[1][j] = fmaf(qc.x, kv.x, x[1][j]);
        x[1][j] = fmaf(qc.y, kv.y, x[1][j]);
        x[1][j] = fmaf(qc.z, kv.z, x[1][j]);
        x[1][j] = fmaf(qc.w, kv.w, x[1][j]);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int s = s0 + r0 + i;
      float tile_max = NEG_INF;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int t = t0 + c + 8 * j;
        float u = NEG_INF;  // past the keys: no weight
        if (t < T && s < S) {
          u = oxa_score(x[i][j], scale, ad[i][j], causal && t > s + (T - S), filter, bad[i]);
          tile_max = u > tile_max ? u : tile_max;
        }
        x[i][j] = u;
      }
#pragma unroll
      for (int d = 4; d > 0; d >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, tile_max, d);
        tile_max = w > tile_max ? w : tile_max;
      }
      const OxaStep st = oxa_step(m[i], tile_max);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = st.finite ? expf(x[i][j] - st.mn) : 0.f;
        sp[r0 + i][c + 8 * j] = p;
        sum += p;
      }
#pragma unroll
      for (int d = 4; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      oxa_update(m[i], l[i], bad[i], st, sum);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] *= st.factor;
    }
    OXA_TERM(t0 + OXA_KT)  // the next tile's (none past the keys)
    __syncthreads();
    // keys past T have p = 0 and zero values: whole float4s of keys
    const int kt4 = (min(OXA_KT, T - t0) + 3) & ~3;
    for (int j = 0; j < kt4; j += 4) {
      const float4 p0 = *reinterpret_cast<const float4*>(&sp[r0][j]);
      const float4 p1 = *reinterpret_cast<const float4*>(&sp[r0 + 1][j]);
      const float pa[4] = {p0.x, p0.y, p0.z, p0.w}, pb[4] = {p1.x, p1.y, p1.z, p1.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float4 va = *reinterpret_cast<const float4*>(&sv[j + jj][4 * c]);
        const float4 vc = *reinterpret_cast<const float4*>(&sv[j + jj][32 + 4 * c]);
        const float w[8] = {va.x, va.y, va.z, va.w, vc.x, vc.y, vc.z, vc.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[0][e] = fmaf(pa[jj], w[e], acc[0][e]);
          acc[1][e] = fmaf(pb[jj], w[e], acc[1][e]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = s0 + r0 + i;
    if (s >= S) continue;
    // every key masked to -inf (no finite maximum) is a NaN row in the unfused kernel;
    // no keys: a zero row, as the unfused P @ V over none
    const bool undefined = T > 0 && (bad[i] || m[i] == NEG_INF);
    const float inv = T > 0 ? 1.f / l[i] : 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int col = (e < 4 ? 4 * c : 32 + 4 * c) + (e & 3);
      if (col < HV)
        o[(long long)s * os + col] =
            undefined ? (zero_nan ? 0.f : __uint_as_float(0x7fc00000u)) : acc[i][e] * inv;
    }
  }
}
"""
_FUSED_ENTRY = r"""
extern "C" __global__ void __launch_bounds__({nt}) oxa_fused_f32_q{qt}(
    const float* q, const float* k, const float* v, float* o, long long qb, long long qs,
    long long qn, long long kb, long long ks, long long kn, long long vb, long long vs,
    long long vn, long long ob, long long os, long long on, const float* add, long long a0,
    long long a1, long long a2, long long a3, int heads, int S, int T, int H, int HV,
    float scale, int causal, float filter, int zero_nan) {{
  oxa_fused_f32<{qt}>(q, k, v, o, qb, qs, qn, kb, ks, kn, vb, vs, vn, ob, os, on, add, a0, a1,
                      a2, a3, heads, S, T, H, HV, scale, causal, filter, zero_nan);
}}
"""
_MMA_SRC = r"""
// Fused float32 attention on tensor cores (TF32 mma.sync m16n8k8, sm_80 and later), for heads
// of 64 (Q/K and V): the scores and arithmetic of oxa_fused_f32, with the products in TF32
// (inputs rounded to nearest) and float32 accumulation, as cuBLASLt's TF32 GEMMs of the
// unfused path.
//
// One block of QG x KS warps per (batch x head, 16 QG queries): warp (qg, ks) takes the 16
// queries of group qg and, of each tile of 32 keys (fetched with cp.async one tile ahead, two
// buffers), the 32 / KS keys of part ks. Each warp keeps its own running max, sum and context;
// the KS warps of a query group are merged through shared memory at the end. Splitting the
// keys puts more warps on the SMs where the batch is small (one warp walking all keys of its
// 16 queries left the SMs one or two warps each, every instruction waiting on the one before:
// 13 us per node at GPT-2 b1); more query groups per block share each tile's loads where the
// grid is large.
//
// Thread (g, q) = (lane / 4, lane % 4) of a warp holds rows g and g + 8. Its score fragment
// holds keys 2q and 2q + 1 of each group of 8, so P feeds P @ V as its A operand with the keys
// taken in the order (0, 2, 4, 6, 1, 3, 5, 7), and the value rows are read in that order:
// nothing moves between lanes. Rows are padded to 68 floats: key reads (row g, column q) and
// value reads (row 2q, column g) hit 32 distinct banks. The additive term of a tile is loaded
// into registers a tile ahead.
#define OXM_KT 32
#define OXM_PAD 68
__device__ __forceinline__ unsigned oxm_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void oxm_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16 bytes from global to shared memory without passing through registers; zeros when !in
__device__ __forceinline__ void oxm_cp16(float* dst, const float* src, bool in) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
               "r"(in ? 16 : 0));
}
template <int QG, int KS>
__device__ void oxa_mma_f32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ o, long long qb, long long qs, long long qn, long long kb, long long ks,
    long long kn, long long vb, long long vs, long long vn, long long ob, long long os,
    long long on, const float* __restrict__ add, long long a0, long long a1, long long a2,
    long long a3, int heads, int S, int T, float scale, int causal, float filter,
    int zero_nan) {
  constexpr int NT = 32 * QG * KS, NW = OXM_KT / 8 / KS;  // threads; key groups of 8 per warp
  static_assert(QG * KS * 16 <= 2 * 2 * OXM_KT, "the merge reuses the key and value buffers");
  // keys and values of two tiles; at the end, the warps' contexts (16 rows each)
  __shared__ __align__(16) float smem[2 * 2 * OXM_KT * OXM_PAD];
  __shared__ float wm[QG * KS][16], wl[QG * KS][16];
  __shared__ int wbad[QG * KS][16];
  float(*sk)[OXM_KT][OXM_PAD] = reinterpret_cast<float(*)[OXM_KT][OXM_PAD]>(smem);
  float(*sv)[OXM_KT][OXM_PAD] = sk + 2;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int qg = w / KS, part = w % KS;
  const int b = blockIdx.y / heads, n = blockIdx.y % heads;
  q += b * qb + n * qn;
  k += b * kb + n * kn;
  v += b * vb + n * vn;
  o += b * ob + n * on;
  const int row0 = blockIdx.x * 16 * QG + qg * 16;  // the warp's first query
  const int r0 = row0 + g;  // this thread's rows: r0 and r0 + 8
  const float NEG_INF = __uint_as_float(0xff800000u);
#define OXM_FETCH(T0, BUF)                                                  \
  _Pragma("unroll") for (int it = 0; it < OXM_KT * 16 / NT; ++it) {         \
    const int idx = tid + it * NT, row = idx >> 4, c4 = (idx & 15) << 2;    \
    const bool in = (T0) + row < T;                                         \
    const long long at = in ? (long long)((T0) + row) : 0;                  \
    oxm_cp16(&sk[BUF][row][c4], k + at * ks + c4, in);                      \
    oxm_cp16(&sv[BUF][row][c4], v + at * vs + c4, in);                      \
  }                                                                         \
  asm volatile("cp.async.commit_group;");
  const int tiles = (T + OXM_KT - 1) / OXM_KT;
  if (tiles > 0) {
    OXM_FETCH(0, 0)
  }
  unsigned qa[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int c = kk * 8 + tq;
    qa[kk][0] = oxm_tf32(r0 < S ? q[(long long)r0 * qs + c] : 0.f);
    qa[kk][1] = oxm_tf32(r0 + 8 < S ? q[(long long)(r0 + 8) * qs + c] : 0.f);
    qa[kk][2] = oxm_tf32(r0 < S ? q[(long long)r0 * qs + c + 4] : 0.f);
    qa[kk][3] = oxm_tf32(r0 + 8 < S ? q[(long long)(r0 + 8) * qs + c + 4] : 0.f);
  }
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, acc[8][4];
  bool bad[2] = {false, false};
#pragma unroll
  for (int nn = 0; nn < 8; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nn][e] = 0.f;
  long long arow[2];
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) arow[i2] = b * a0 + n * a1 + (long long)(r0 + 8 * i2) * a2;
  const int kw = 8 * NW * part + 2 * tq;  // this thread's first key within a tile
  float ad[2][NW][2];
#define OXM_TERM(T0)                                                           \
  _Pragma("unroll") for (int i2 = 0; i2 < 2; ++i2)                             \
  _Pragma("unroll") for (int j = 0; j < NW; ++j)                               \
  _Pragma("unroll") for (int e = 0; e < 2; ++e) {                              \
    const int t = (T0) + kw + 8 * j + e;                                       \
    ad[i2][j][e] = (add && t < T && r0 + 8 * i2 < S) ? add[arow[i2] + t * a3] : 0.f; \
  }
  OXM_TERM(0)
  for (int i = 0; i < tiles; ++i) {
    const int buf = i & 1, t0 = i * OXM_KT;
    if (i + 1 < tiles) {
      OXM_FETCH(t0 + OXM_KT, buf ^ 1)
      asm volatile("cp.async.wait_group 1;");
    } else {
      asm volatile("cp.async.wait_group 0;");
    }
    __syncthreads();
    // scores of the warp's keys: even and odd head-dim steps apart, so the mmas chain 4 deep
    float x[NW][4], xb[NW][4];
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] = xb[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; kk += 2)
#pragma unroll
      for (int j = 0; j < NW; ++j) {
        const float* krow = &sk[buf][8 * NW * part + 8 * j + g][tq + kk * 8];
        oxm_mma(x[j], qa[kk], oxm_tf32(krow[0]), oxm_tf32(krow[4]));
        oxm_mma(xb[j], qa[kk + 1], oxm_tf32(krow[8]), oxm_tf32(krow[12]));
      }
#pragma unroll
    for (int j = 0; j < NW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[j][e] += xb[j][e];
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int s = r0 + 8 * i2;
      float tile_max = NEG_INF;
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int t = t0 + kw + 8 * j + e;
          float u = NEG_INF;  // past the keys: no weight
          if (t < T && s < S) {
            const bool filtered = causal && t > s + (T - S);
            u = oxa_score(x[j][2 * i2 + e], scale, ad[i2][j][e], filtered, filter, bad[i2]);
            tile_max = u > tile_max ? u : tile_max;
          }
          x[j][2 * i2 + e] = u;
        }
#pragma unroll
      for (int d = 1; d < 4; d <<= 1) {
        const float o2 = __shfl_xor_sync(0xffffffffu, tile_max, d);
        tile_max = o2 > tile_max ? o2 : tile_max;
      }
      const OxaStep st = oxa_step(m[i2], tile_max);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = st.finite ? expf(x[j][2 * i2 + e] - st.mn) : 0.f;
          x[j][2 * i2 + e] = p;
          sum += p;
        }
#pragma unroll
      for (int d = 1; d < 4; d <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
      oxa_update(m[i2], l[i2], bad[i2], st, sum);
#pragma unroll
      for (int nn = 0; nn < 8; ++nn) {
        acc[nn][2 * i2] *= st.factor;
        acc[nn][2 * i2 + 1] *= st.factor;
      }
    }
    OXM_TERM(t0 + OXM_KT)  // the next tile's (none past the keys)
    // keys past T have p = 0 and zero-filled values
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const unsigned pa[4] = {oxm_tf32(x[j][0]), oxm_tf32(x[j][2]), oxm_tf32(x[j][1]),
                              oxm_tf32(x[j][3])};
      const float* v0 = &sv[buf][kw + 8 * j][g];
#pragma unroll
      for (int nn = 0; nn < 8; ++nn)
        oxm_mma(acc[nn], pa, oxm_tf32(v0[nn * 8]), oxm_tf32(v0[OXM_PAD + nn * 8]));
    }
    __syncthreads();  // the next iteration's fetch overwrites this buffer
  }
  // merge the parts of each query group: row max M = max m, each scaled by exp(m - M) / sum
  if (tq == 0) {
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      wm[w][g + 8 * i2] = m[i2];
      wl[w][g + 8 * i2] = l[i2];
    }
  }
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {  // any lane of the row may have seen a NaN
    const unsigned any = __ballot_sync(0xffffffffu, bad[i2]);
    if (tq == 0) wbad[w][g + 8 * i2] = ((any >> (4 * g)) & 15u) != 0;
  }
  __syncthreads();
  float(*ctx)[16][OXM_PAD] = reinterpret_cast<float(*)[16][OXM_PAD]>(smem);
  const int w0 = qg * KS;  // the group's first warp
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const int row = g + 8 * i2;
    float mx = NEG_INF;
#pragma unroll
    for (int u = w0; u < w0 + KS; ++u) mx = wm[u][row] > mx ? wm[u][row] : mx;
    float total = 0.f;
#pragma unroll
    for (int u = w0; u < w0 + KS; ++u)
      total += wm[u][row] == NEG_INF ? 0.f : wl[u][row] * expf(wm[u][row] - mx);
    const float f = (m[i2] == NEG_INF || total == 0.f) ? 0.f : expf(m[i2] - mx) / total;
#pragma unroll
    for (int nn = 0; nn < 8; ++nn) {
      ctx[w][row][nn * 8 + 2 * tq] = acc[nn][2 * i2] * f;
      ctx[w][row][nn * 8 + 2 * tq + 1] = acc[nn][2 * i2 + 1] * f;
    }
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < QG * 16 * 64 / NT; ++it) {
    const int idx = tid + it * NT, grp = idx >> 10, row = (idx >> 6) & 15, col = idx & 63;
    const int s = blockIdx.x * 16 * QG + grp * 16 + row;
    if (s >= S) continue;
    bool undefined = false, any_key = false;
    float y = 0.f;
#pragma unroll
    for (int u = grp * KS; u < grp * KS + KS; ++u) {
      undefined |= wbad[u][row] != 0;
      any_key |= wm[u][row] != NEG_INF;
      y += ctx[u][row][col];
    }
    // as oxa_fused_f32: no finite maximum is a NaN row of the unfused kernel; no keys, zeros
    undefined = T > 0 && (undefined || !any_key);
    o[(long long)s * os + col] =
        undefined ? (zero_nan ? 0.f : __uint_as_float(0x7fc00000u)) : y;
  }
}
"""
_MMA_ENTRY = r"""
extern "C" __global__ void __launch_bounds__({nt}) oxa_mma_f32_{qg}x{ks}(
    const float* q, const float* k, const float* v, float* o, long long qb, long long qs,
    long long qn, long long kb, long long ks, long long kn, long long vb, long long vs,
    long long vn, long long ob, long long os, long long on, const float* add, long long a0,
    long long a1, long long a2, long long a3, int heads, int S, int T, float scale, int causal,
    float filter, int zero_nan) {{
  oxa_mma_f32<{qg}, {ks}>(q, k, v, o, qb, qs, qn, kb, ks, kn, vb, vs, vn, ob, os, on, add, a0,
                          a1, a2, a3, heads, S, T, scale, causal, filter, zero_nan);
}}
"""
MMA_HEAD = 64  # the head size (Q/K and V) of the tensor-core kernel
MMA_MIN_BATCH = 1  # the smallest batch it runs at (below, the in-place GEMMs)
# (query groups, key parts) per block: the kernel's shapes
MMA_SHAPES = ((1, 4), (2, 2))
# (a module of its own: mma.sync on TF32 and cp.async need sm_80, the SIMT kernel does not)
FUSED_ATTENTION_MMA = F._RowModule(
    _ONLINE_SOFTMAX_SRC
    + _MMA_SRC
    + "".join(_MMA_ENTRY.format(qg=a, ks=c, nt=32 * a * c) for a, c in MMA_SHAPES)
)


def mma_shape(s: int, heads: int, sms: int) -> tuple[int, int]:
    """The block shape of the tensor-core kernel for ``heads`` (batch x heads) of ``s``
    queries: 2 query groups sharing each tile, with the keys split 2 ways, where that gives
    every SM a block; else 1 group with the keys split 4 ways, for more warps per SM. Measured
    on an H100 (GPT-2, 128 tokens, µs per node): b1 8.4 (1x4), 11.8 (2x2), 13.5 (4x2);
    b8 23.9 (1x4), 16.4 (2x2), 18.5 (4x2)."""
    return (2, 2) if -(-s // 32) * heads >= sms else (1, 4)


FUSED_HEAD_MAX = 64  # head sizes (Q/K and V) the fused kernel takes
# launches of a fused float32 attention kernel set up (of which on tensor cores)
stats = {"fused_f32": 0, "fused_f32_mma": 0}
FUSED_ATTENTION = F._RowModule(
    F.ROWS_SRC
    + _ONLINE_SOFTMAX_SRC
    + _FUSED_SRC
    + "".join(_FUSED_ENTRY.format(qt=qt, nt=4 * qt) for qt in (16, 32))
)


_WARP_ROWS = 4  # rows (warps) per block of the warp-per-row softmax


def softmax_launch(scores: Any, add: Any, causal: bool, filt: float, zero_nan: bool) -> tuple:
    """(function name suffix, grid, block, arguments) of the masked softmax over dense
    (B, N, S, T) ``scores`` in place: a warp per row up to 1024 keys, a block per row beyond."""
    b, n, s, t = scores.shape
    strides = _term_strides(add)
    head = (scores, _NULL if add is None else add, *(np.int64(v) for v in strides))
    tail = (np.int32(causal), np.float64(filt), np.int32(zero_nan))
    rows = b * n * s
    if t <= 32 * 32:
        name = "w4_" if t <= 32 * 4 else "w32_"
        grid = ((rows + _WARP_ROWS - 1) // _WARP_ROWS,)
        args = (*head, np.int64(n), np.int64(s), np.int64(t), np.int64(rows), *tail)
        return name, grid, (32 * _WARP_ROWS,), args
    return "", (rows,), (F.block_size(t),), (*head, np.int64(n), np.int64(s), np.int64(t), *tail)


SOFTMAX_ROWS = F.row_module(_SOFTMAX_SRC, _SOFTMAX_ENTRY)
for _module in (FUSED_ATTENTION_MMA, FUSED_ATTENTION, SOFTMAX_ROWS):
    ship(_module.kernels)


def _term_strides(add: Any) -> list[int]:
    """The additive term's element strides over (B, N, S, T), 0 where it broadcasts (all 0
    without a term): how the softmax and fused kernels index it."""
    if add is None:
        return [0, 0, 0, 0]
    a4 = add.reshape((1,) * (4 - add.ndim) + add.shape)
    return [0 if d == 1 else st // a4.itemsize for d, st in zip(a4.shape, a4.strides)]


def masked_softmax_np(
    x: np.ndarray, bias: np.ndarray | None, causal: bool, filter_value: float, zero_nan: bool
) -> None:
    """The row kernel's twin: ``x`` (B, N, S, T) in place; ``bias`` in the compute type,
    broadcastable to x."""
    w = F.widen(x)
    s, t = x.shape[2], x.shape[3]
    with np.errstate(all="ignore"):
        if bias is not None:
            w = w + bias
        if causal:
            w = w + np.where(np.arange(t)[None, :] > np.arange(s)[:, None] + (t - s),
                             w.dtype.type(filter_value), w.dtype.type(0))  # fmt: skip
        np.copyto(x, w, casting="unsafe")  # the biased scores, rounded like the kernel's
        w = F.widen(x)
        e = np.exp(w - w.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
    if zero_nan:
        p[np.isnan(p)] = 0
    np.copyto(x, p, casting="unsafe")


_error = attention.node_error


class _AttentionBase(CudaKernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        a = attention.AttentionAttrs.of(info)
        self.heads, self.scale, self.causal = a.heads, a.scale, a.causal
        self.mask_filter, self.zero_nan = a.mask_filter, a.zero_nan
        self._causal_keep: dict[tuple[int, int], Any] = {}  # (S, T) -> constant operand
        self.gemm = blas.engine_for(self.ep)
        self.dtype = info.input_dtype(0)

    def warm_up(self) -> None:
        self.gemm.warm_up(self.dtype)  # the projections and the GEMM path's products

    def heads_of(self, x3: Any) -> Any:
        """(B, S, N*H) -> dense (B, N, S, H)."""
        b, s, d = x3.shape
        n = self.heads
        return self.xp.ascontiguousarray(x3.reshape(b, s, n, d // n).transpose(0, 2, 1, 3))

    def additive(self, ctx: KernelContext, bias: Any, mask: Any, shape: tuple) -> Any:
        """The attention bias plus ``mask_filter_value`` at masked positions, in the compute
        type, broadcastable to the scores' ``shape`` (None: neither). With a bias or a mask,
        the causal mask is part of it: a position masked both ways gets the filter value
        once, as on the CPU provider (the softmax kernel then adds no causal filter)."""
        xp = self.xp
        causal = None
        if self.causal and (bias is not None or mask is not None):
            causal = xp.asarray(attention.causal_mask(shape[2], shape[3])[None, None])
        dt = np.dtype(self.dtype if self.dtype is not None else ctx.input(0).dtype)
        wide = np.float64 if dt == np.float64 else np.float32
        out = None
        if bias is not None:
            if len(bias.shape) > 4 or _broadcast(bias.shape, shape) != shape:
                raise _error(self.info, f"attention_bias of shape {list(bias.shape)} does not "
                                        f"broadcast to the scores' shape {list(shape)}")  # fmt: skip
            out = blas.widen(xp, bias, dt).astype(wide, copy=False)
        if mask is not None:
            b, _, s, t = shape
            if mask.ndim == 1 and mask.shape[0] == b:
                masked = xp.arange(t)[None, :] >= mask.astype(xp.int64)[:, None]
                masked = masked[:, None, None, :]
            elif mask.shape == (b, t):
                masked = (mask == 0)[:, None, None, :]
            elif mask.shape == (b, s, t):
                masked = (mask == 0)[:, None, :, :]
            else:
                raise _error(self.info, f"mask of shape {list(mask.shape)} is not supported "
                                        f"(expected ({b}), ({b}, {t}) or ({b}, {s}, {t}))")  # fmt: skip
            causal = masked if causal is None else masked | causal
        if causal is not None:
            add = xp.where(causal, wide(self.mask_filter), wide(0))
            out = add if out is None else out + add
        return out

    def attend(self, ctx: KernelContext, q4: Any, k4: Any, v4: Any, bias: Any, mask: Any) -> Any:
        """Attention of dense (B, N, S, H) heads: the (B, S, N*Hv) result (a new array)."""
        xp = self.xp
        dt = np.dtype(self.dtype if self.dtype is not None else ctx.input(0).dtype)
        b, n, s, h = q4.shape
        t, hv = k4.shape[2], v4.shape[3]
        if k4.shape[:2] != (b, n) or v4.shape[:3] != (b, n, t) or k4.shape[3] != h:
            raise _error(self.info, f"query heads {list(q4.shape)}, key heads "
                                    f"{list(k4.shape)} and value heads {list(v4.shape)} "
                                    "disagree")  # fmt: skip
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
        shape = (b, n, s, t)
        add = self.additive(ctx, bias, mask, shape)
        scores = xp.empty(shape, dtype=q4.dtype)
        self.gemm(ctx, q4, k4, scores, trans_b=True, alpha=scale, dtype=dt)
        if scores.size:
            self.softmax(scores, add, dt)
        ctx4 = xp.empty((b, n, s, hv), dtype=q4.dtype)
        self.gemm(ctx, scores, v4, ctx4, dtype=dt)
        return ctx4.transpose(0, 2, 1, 3).reshape(b, s, n * hv)

    def softmax(self, scores: Any, add: Any, dt: np.dtype) -> None:
        xp = self.xp
        causal = self.causal and add is None  # else the term holds the causal mask
        if xp is np:
            masked_softmax_np(scores, add, causal, self.mask_filter, self.zero_nan)
            return
        if add is not None:
            add = xp.ascontiguousarray(add)
        name, grid, block, args = softmax_launch(
            scores, add, causal, self.mask_filter, self.zero_nan
        )
        fn = SOFTMAX_ROWS.function(xp, "oxa_softmax_" + name + F.storage_key(dt))
        fn(grid, block, args)


_NULL = np.uint64(0)


def _broadcast(a: tuple, b: tuple) -> tuple:
    out = []
    for x, y in zip((1,) * (len(b) - len(a)) + tuple(a), b):
        out.append(y if x == 1 else (x if y == 1 or x == y else -1))
    return tuple(out)


class MultiHeadAttention(_AttentionBase):
    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        q, k, v = self.arg(ctx, 0), self.arg(ctx, 1), self.arg(ctx, 2)
        bias, kpm, attn_bias = self.arg(ctx, 3), self.arg(ctx, 4), self.arg(ctx, 5)
        past_k, past_v = self.arg(ctx, 6), self.arg(ctx, 7)
        if k is None or v is None or q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise _error(self.info, "query, key and value must be 3-D (B, S, D); packed "
                                    "QKV/KV and BNSH key/value inputs are not supported")  # fmt: skip
        d, dv, n = q.shape[2], v.shape[2], self.heads
        if d % n or k.shape[2] != d or dv % n or k.shape[:2] != v.shape[:2]:
            raise _error(self.info, f"query {list(q.shape)}, key {list(k.shape)} and value "
                                    f"{list(v.shape)} do not split into {n} heads")  # fmt: skip
        dt = np.dtype(self.dtype if self.dtype is not None else ctx.input(0).dtype)
        if bias is not None:
            if bias.shape != (2 * d + dv,):
                raise _error(self.info, f"bias must have shape ({2 * d + dv},)")
            q, k, v = (_add(xp, x, bias[a:z], dt) for x, a, z in
                       ((q, 0, d), (k, d, 2 * d), (v, 2 * d, 2 * d + dv)))  # fmt: skip
        q4, k4, v4 = self.heads_of(q), self.heads_of(k), self.heads_of(v)
        if past_k is not None and past_v is not None:
            k4 = xp.concatenate([past_k, k4], axis=2)
            v4 = xp.concatenate([past_v, v4], axis=2)
        out = self.attend(ctx, q4, k4, v4, attn_bias, kpm)
        self.alloc(ctx, 0, out.shape, dt)[...] = out
        if ctx.has_output(1):
            self.alloc(ctx, 1, k4.shape, dt)[...] = k4
        if ctx.has_output(2):
            self.alloc(ctx, 2, v4.shape, dt)[...] = v4


def _add(xp: Any, x: Any, b: Any, dt: np.dtype) -> Any:
    """``x + b`` in the storage type (16-bit floats added in float32 and rounded once)."""
    out = xp.empty(x.shape, dtype=x.dtype)
    blas.store(xp, blas.widen(xp, x, dt) + blas.widen(xp, b, dt), out, dt)
    return out


class Attention(_AttentionBase):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        sizes = info.attr("qkv_hidden_sizes")
        self.sizes = [int(x) for x in sizes] if sizes else None
        if info.attr("do_rotary", 0):
            raise _error(info, "do_rotary=1 is not supported")

    def compute(self, ctx: KernelContext) -> None:
        xp = self.xp
        x, w, bias, mask, past = (self.arg(ctx, i) for i in range(5))
        attn_bias = self.arg(ctx, 5)
        if x.ndim != 3 or w.ndim != 2 or w.shape[0] != x.shape[2]:
            raise _error(self.info, f"input {list(x.shape)} and weights {list(w.shape)} do not "
                                    "align")  # fmt: skip
        b, s, din = x.shape
        n, total = self.heads, w.shape[1]
        dq, dk, dv = self.sizes or [total // 3] * 3
        if dq + dk + dv != total or dq != dk or dq % n or dv % n:
            raise _error(self.info, f"weights' {total} columns do not split into Q/K/V sizes "
                                    f"{[dq, dk, dv]} of {n} heads")  # fmt: skip
        if bias is not None and bias.shape != (total,):
            raise _error(self.info, f"bias must have shape ({total},)")
        dt = np.dtype(self.dtype if self.dtype is not None else ctx.input(0).dtype)
        qkv = xp.empty((b * s, total), dtype=x.dtype)
        self.gemm(ctx, x.reshape(b * s, din), w, qkv, bias=bias, dtype=dt)
        h, hv = dq // n, dv // n
        if (
            past is None
            and not ctx.has_output(1)
            and self._fused_f32_applies(qkv, (b, n, s, h, hv))
        ):
            # the kernels the prepared form runs: a first run gives what later runs give, and
            # compiles what they launch
            add = self._first_run_term(ctx, attn_bias, mask, (b, n, s, s))
            y = self.alloc(ctx, 0, (b, s, n * hv), dt)
            scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
            dims = (b, n, s, h, hv, dq, dk)
            self._fused_f32(qkv, y, add, dims, scale, self.stream_handle(ctx))()
            return
        y = None
        if past is None and not ctx.has_output(1) and qkv.dtype == np.float16:
            # cuDNN's fused attention, as the prepared form runs it: a first run gives what
            # later runs give, and loads nothing they do not use (CuPy's cuBLAS, the generic
            # path's kernels: about 0.1 s of BERT-base float16's first run)
            y = self.alloc(ctx, 0, (b, s, n * hv), dt)
            scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
            held: list[Any] = []  # temporaries, freed once the calls are enqueued

            def buf(shape_: tuple[int, ...], dtype_: Any) -> Any:
                held.append(xp.empty(shape_, dtype_))
                return held[-1]

            def scratch(nbytes: int) -> int:
                held.append(ctx.scratch(nbytes))
                return int(held[-1].ptr)

            dims = (b, n, s, h, hv, dq, dk)
            calls = self._fused_sdpa(ctx, qkv, y, mask, attn_bias, dims, scale, buf, scratch)
            if calls is not None:
                for call in calls:
                    call()
                return
        qkv = qkv.reshape(b, s, total)
        q4 = self.heads_of(qkv[..., :dq])
        k4 = self.heads_of(qkv[..., dq : dq + dk])
        v4 = self.heads_of(qkv[..., dq + dk :])
        if past is not None:
            if past.ndim != 5 or past.shape[:3] != (2, b, n):
                raise _error(self.info, f"past must be (2, {b}, {n}, P, H)")
            k4 = xp.concatenate([past[0], k4], axis=2)
            v4 = xp.concatenate([past[1], v4], axis=2)
        out = self.attend(ctx, q4, k4, v4, attn_bias, mask)
        if y is None or y.shape != out.shape:
            y = self.alloc(ctx, 0, out.shape, dt)
        y[...] = out
        if ctx.has_output(1):
            present = self.alloc(ctx, 1, (2, *k4.shape), dt)
            present[0] = k4
            present[1] = v4

    def prepare(self, ctx: KernelContext) -> Any:
        """The common case as bound calls: the packed projection GEMM, the three head copies
        (none at batch 1),
        the mask's additive term (one elementwise kernel from the mask input, each run), the
        two strided-batch GEMMs around the masked softmax, and the copy into the output. The
        temporaries are slices of the frame's workspace (``ctx.workspace``)."""
        x, w, bias, mask, past = (self.arg(ctx, i) for i in range(5))
        attn_bias = self.arg(ctx, 5)
        if past is not None or ctx.has_output(1) or x.ndim != 3 or w.ndim != 2:
            return None
        b, s, din = x.shape
        n, total = self.heads, w.shape[1]
        dq, dk, dv = self.sizes or [total // 3] * 3
        if w.shape[0] != din or dq + dk + dv != total or dq != dk or dq % n or dv % n:
            return None  # compute raises the error
        if bias is not None and bias.shape != (total,):
            return None
        dt = np.dtype(self.dtype if self.dtype is not None else ctx.input(0).dtype)
        wide = np.dtype(np.float64 if dt == np.float64 else np.float32)
        h, hv, t = dq // n, dv // n, s
        shape = (b, n, s, t)
        add_src = self._additive_source(attn_bias, mask, shape, wide)
        if add_src is _UNSUPPORTED:
            return None
        sh = self.stream_handle(ctx)
        be, st = self.be, x.dtype  # storage dtype (bfloat16: uint16)

        def buf(shape_: tuple[int, ...], dtype_: Any) -> Any:
            nbytes = int(np.prod(shape_)) * np.dtype(dtype_).itemsize
            return be.array_at(ctx.workspace(nbytes), shape_, dtype_, ctx)

        qkv = buf((b * s, total), st)
        y = self.alloc(ctx, 0, (b, s, n * hv), dt)
        proj = self.gemm.prepare(ctx, x.reshape(b * s, din), w, qkv, bias=bias, dtype=dt)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(h)
        if proj is not None:
            dims = (b, n, s, h, hv, dq, dk)
            fused = self._fused_sdpa(ctx, qkv, y, mask, attn_bias, dims, scale, buf)
            if fused is not None:
                work = bound_calls([proj, *fused])
                return node_graph(self, ctx, work) or work
        add = make = None
        if add_src is not None:
            add, make = add_src(buf, sh)
        mask = [make] if make is not None else []  # None: the additive term needs no kernel
        if self._fused_f32_applies(qkv, (b, n, s, h, hv)):
            fused = self._fused_f32(qkv, y, add, (b, n, s, h, hv, dq, dk), scale, sh)
            calls = [proj, *mask, fused]
            return None if proj is None else bound_calls(calls)
        scores = buf(shape, st)
        softmax = self._softmax_call(scores, add, dt, sh)
        heads = None
        if b == 1:
            heads = self._heads_in_place(ctx, qkv, scores, y, (n, s, h, hv, dq, dk), scale, dt)
        if heads is None:
            heads = self._heads_copied(ctx, qkv, scores, y, buf, (b, n, s, h, hv), scale, dt)
        gemm_qk, gemm_pv, copies_in, copies_out = heads
        calls = [proj, *copies_in, *mask, gemm_qk, softmax, gemm_pv, *copies_out]
        if any(c is None for c in calls):
            return None
        return bound_calls(calls)

    def _fused_f32_applies(self, qkv: Any, dims: tuple) -> bool:
        """float32 on the GPU with heads of at most 64: a fused kernel instead of four head
        copies and two GEMMs around the masked softmax; on tensor cores (``_mma_applies``) at
        any batch, in FMA beyond batch 1 only. At batch 1 the GEMMs read the heads in place,
        and measured faster than the FMA kernel (GPT-2 b1 fp32 on an H100: 862 µs of GPU time
        per run with it at 24 µs per node, 0.79 ms for a whole IOBinding + graph run with the
        GEMMs)."""
        b, n, s, h, hv = dims[:5]
        return (
            (b > 1 or (b >= MMA_MIN_BATCH and self._mma_applies(qkv, dims)))
            and self.xp is not np
            and qkv.dtype == np.float32
            and 0 < h <= FUSED_HEAD_MAX
            and hv <= FUSED_HEAD_MAX
            and s > 0
            and b * n <= 65535  # the grid's y dim
        )

    def _mma_applies(self, qkv: Any, dims: tuple) -> bool:
        """The tensor-core kernel (``FUSED_ATTENTION_MMA``): TF32 allowed (``use_tf32``), an
        sm_80 or later device, heads of 64, and keys and values in 16-byte rows (cp.async)."""
        b, n, s, h, hv = dims[:5]
        return (
            qkv.dtype == np.float32
            and self._mma_fits(qkv.shape[1], h * n, h, hv)  # (not the simulation's arrays)
            and int(qkv.data.ptr) % 16 == 0
        )

    def _mma_fits(self, total: int, dq: int, h: int, hv: int) -> bool:
        """What ``_mma_applies`` asks of the node and device (float32 operands aside)."""
        return (
            bool(self.ep.options.use_tf32)
            and self.xp is not np
            and h == hv == MMA_HEAD
            and total % 4 == 0
            and dq % 4 == 0
            and _compute_capability(self.ep.ordinal) >= 8
        )

    def warm_up(self) -> None:
        """float32 with the weights constant: the tensor-core kernel, compiled in the
        background. Its compile is the longest of BERT-base's and GPT-2's first runs (0.7-1.0 s
        on an H100 host). Where the graph fixes the input's batch and length, the one block
        shape they take; else both (the first one batch 1 with 128 tokens takes): a second
        compile beside it slowed it (1.0 s against 0.73 alone)."""
        super().warm_up()
        w = self.info.constant_input(1)
        if self.dtype != np.float32 or w is None or w.ndim != 2:
            return
        n, total = self.heads, int(w.shape[1])
        dq, dk, dv = self.sizes or [total // 3] * 3
        if n <= 0 or dq % n or dv % n or not self._mma_fits(total, dq, dq // n, dv // n):
            return
        sms = _multiprocessors(self.ep.ordinal)
        x = self.info.input_shape(0)
        if x is not None and len(x) == 3 and all(type(d) is int for d in x[:2]):
            blocks = [mma_shape(int(x[1]), int(x[0]) * n, sms)]
        else:
            first = mma_shape(128, n, sms)
            blocks = sorted(MMA_SHAPES, key=lambda shape: shape != first)
        for qg, ks in blocks:
            FUSED_ATTENTION_MMA.precompile(self, f"oxa_mma_f32_{qg}x{ks}")

    def _fused_f32(self, qkv: Any, y: Any, add: Any, dims: tuple, scale: float, sh: int) -> Any:
        """The fused float32 attention over the packed projection ``qkv`` (B*S, Q|K|V), read
        in place, into the (B, S, N*Hv) output ``y``; ``add``: the additive term (attention
        bias and mask), broadcastable to (B, N, S, S), or None."""
        b, n, s, h, hv, dq, dk = dims
        stats["fused_f32"] += 1
        total, isz = qkv.shape[1], qkv.dtype.itemsize
        base = int(qkv.data.ptr)
        strides = _term_strides(add)
        sms = _multiprocessors(self.ep.ordinal)
        i64 = np.int64
        head = (
            np.uint64(base),
            np.uint64(base + dq * isz),
            np.uint64(base + (dq + dk) * isz),
            y,
            *(i64(v) for v in (s * total, total, h, s * total, total, h, s * total, total, hv)),
            *(i64(v) for v in (s * n * hv, n * hv, hv)),
            _NULL if add is None else add,
            *(i64(v) for v in strides),
            np.int32(n),
            np.int32(s),
            np.int32(s),
        )
        tail = (
            np.float32(scale),
            np.int32(self.causal and add is None),  # else the term holds the causal mask
            np.float32(self.mask_filter),
            np.int32(self.zero_nan),
        )
        if self._mma_applies(qkv, dims[:5]):
            stats["fused_f32_mma"] += 1
            qg, ks = mma_shape(s, b * n, sms)
            fn = FUSED_ATTENTION_MMA.function(self.xp, f"oxa_mma_f32_{qg}x{ks}")
            grid = (-(-s // (16 * qg)), b * n)
            return function_launch(fn, grid, (32 * qg * ks,), head + tail, sh)
        # a grid of at least two blocks per SM where the batch allows: smaller query tiles
        qt = 16 if -(-s // 32) * b * n < 2 * sms else 32
        fn = FUSED_ATTENTION.function(self.xp, f"oxa_fused_f32_q{qt}")
        args = (*head, np.int32(h), np.int32(hv), *tail)
        return function_launch(fn, (-(-s // qt), b * n), (4 * qt,), args, sh)

    def _fused_sdpa(
        self,
        ctx: Any,
        qkv: Any,
        y: Any,
        mask: Any,
        attn_bias: Any,
        dims: tuple,
        scale: float,
        buf: Any,
        workspace: Any = None,
    ) -> list | None:
        """float16: cuDNN's fused attention (flash attention) reading the heads in place from
        the packed projection and writing the context in place into the output; a padding
        mask, or the attention bias, becomes a dense (B or 1, 1 or N, S, S) float16 bias made
        each run by one kernel. The calls after the projection, or None where it does not
        apply (another dtype, both a mask and a bias, a layout or filter value it cannot
        express, no cuDNN, no engine for the shapes).

        ``zero_nan_probabilities``: masking never makes a NaN row here (a fully masked row
        gives 0, as the GPU test checks against the CPU provider); NaN scores from NaN in the
        query or key give NaN rows instead of 0 (see docs/onnxruntime-differences.md)."""
        if qkv.dtype != np.float16 or (mask is not None and attn_bias is not None):
            return None
        backends = int(self.ep.options.sdpa_kernel)
        if backends and not backends & (_FLASH_ATTENTION | _CUDNN_FLASH_ATTENTION):
            return None  # the user's sdpa_kernel leaves flash attention out
        eng = dnn.engine_for(self.ep)
        if eng is None:
            return None
        b, n, s, h, hv, dq, dk = dims
        total, isz = qkv.shape[1], qkv.dtype.itemsize
        calls: list[Any] = []
        ptrs = {
            dnn.UID_Q: int(qkv.data.ptr),
            dnn.UID_K: int(qkv.data.ptr) + dq * isz,
            dnn.UID_V: int(qkv.data.ptr) + (dq + dk) * isz,
            dnn.UID_O: int(y.data.ptr),
        }
        sh = self.stream_handle(ctx)
        bias_dims = None
        if mask is not None:
            f = np.float16(self.mask_filter)
            if not np.isfinite(f) or mask.shape not in ((b, s), (b, s, s)):
                return None
            mask4 = mask.reshape(b, 1, 1, s) if mask.ndim == 2 else mask.reshape(b, 1, s, s)
            bias_dims = (b, 1, s, s)
            term = buf(bias_dims, np.float16)
            make = MASK_TERM.bind(self.xp, mask4, f, term, stream=sh)
        elif attn_bias is not None:
            if attn_bias.ndim > 4:
                return None
            bias4 = attn_bias.reshape((1,) * (4 - attn_bias.ndim) + attn_bias.shape)
            bias_dims = (bias4.shape[0], bias4.shape[1], s, s)
            if _broadcast(bias4.shape, bias_dims) != bias_dims or bias_dims[:2] not in (
                (1, 1), (b, 1), (1, n), (b, n),
            ):  # fmt: skip
                return None
            term = buf(bias_dims, np.float16)
            kernel = F.COPY if bias4.dtype == np.float16 else F.CAST
            make = kernel.bind(self.xp, bias4, term, stream=sh)
        if bias_dims is not None:
            if make is None:
                return None
            calls.append(make)
            ptrs[dnn.UID_BIAS] = int(term.data.ptr)
        spec = dnn.SdpaSpec.packed((b, n, s, h, hv), total, bias_dims, self.causal, scale)
        call = eng.attention(ctx, spec, ptrs, workspace)
        return None if call is None else [*calls, call]

    def _heads_in_place(
        self, ctx: Any, qkv: Any, scores: Any, y: Any, dims: tuple, scale: float, dt: Any
    ) -> tuple | None:
        """Batch 1: the heads read in place from the packed projection (row stride = its width)
        and the context written in place into the (S, N * Hv) output, by strided-batched GEMMs
        over the N heads: no copies (four per node otherwise). None where the GEMM engine has
        no prepared form for such views."""
        n, s, h, hv, dq, dk = dims
        total, isz = qkv.shape[1], qkv.dtype.itemsize
        strided = self.xp.lib.stride_tricks.as_strided

        def heads(lo: int, width: int) -> Any:  # (N, S, width) views of columns lo..
            return strided(
                qkv[:, lo:], shape=(n, s, width), strides=(width * isz, total * isz, isz)
            )

        q, k, v = heads(0, h), heads(dq, h), heads(dq + dk, hv)
        scores3 = scores.reshape(n, s, s)
        out = strided(y, shape=(n, s, hv), strides=(hv * isz, n * hv * isz, isz))
        qk = self.gemm.prepare(ctx, q, k, scores3, trans_b=True, alpha=scale, dtype=dt)
        pv = self.gemm.prepare(ctx, scores3, v, out, dtype=dt)
        if qk is None or pv is None:
            return None
        return qk, pv, [], []

    def _heads_copied(
        self, ctx: Any, qkv: Any, scores: Any, y: Any, buf: Any, dims: tuple, scale: float, dt: Any
    ) -> tuple:
        """The heads copied into (B, N, S, H) buffers, two strided-batched GEMMs, and the
        context copied into the output."""
        xp, sh, st = self.xp, self.stream_handle(ctx), qkv.dtype
        b, n, s, h, hv = dims
        dq, dk = n * h, n * h
        q4, k4, v4 = buf((b, n, s, h), st), buf((b, n, s, h), st), buf((b, n, s, hv), st)
        ctx4 = buf((b, n, s, hv), st)
        q3 = qkv.reshape(b, s, qkv.shape[1])
        total = qkv.shape[1]
        copies_in = [
            F.COPY.bind(
                xp, q3[..., lo:hi].reshape(b, s, n, hd).transpose(0, 2, 1, 3), dst, stream=sh
            )
            for dst, lo, hi, hd in ((q4, 0, dq, h), (k4, dq, dq + dk, h), (v4, dq + dk, total, hv))
        ]
        qk = self.gemm.prepare(ctx, q4, k4, scores, trans_b=True, alpha=scale, dtype=dt)
        pv = self.gemm.prepare(ctx, scores, v4, ctx4, dtype=dt)
        out4 = y.reshape(b, s, n, hv)
        copies_out = [F.COPY.bind(xp, ctx4.transpose(0, 2, 1, 3), out4, stream=sh)]
        return qk, pv, copies_in, copies_out

    def _first_run_term(self, ctx: KernelContext, attn_bias: Any, mask: Any, shape: tuple) -> Any:
        """The float32 additive term for ``compute``: made by the prepared form's kernel, on
        temporaries, where it has one."""
        xp = self.xp
        make = self._additive_source(attn_bias, mask, shape, np.dtype(np.float32))
        if make is None:
            return None
        if make is not _UNSUPPORTED:
            try:
                add, call = make(xp.empty, self.stream_handle(ctx))
            except RuntimeError:
                pass  # CuPy's operations, below
            else:
                if call is not None:
                    call()
                return add
        add = self.additive(ctx, attn_bias, mask, shape)
        return None if add is None else xp.ascontiguousarray(add)

    def _additive_source(self, attn_bias: Any, mask: Any, shape: tuple, wide: np.dtype) -> Any:
        """How the additive term (attention bias plus the mask's filter value) is made each
        run: None (no term), or a function (buf, stream) -> (array, bound call or None)."""
        b, _, s, t = shape
        xp = self.xp
        if attn_bias is not None and (
            len(attn_bias.shape) > 4 or _broadcast(attn_bias.shape, shape) != shape
        ):
            return _UNSUPPORTED
        bias4 = None
        if attn_bias is not None:
            bias4 = attn_bias.reshape((1,) * (4 - attn_bias.ndim) + attn_bias.shape)
        mask4 = None
        if mask is not None:
            if mask.shape == (b, t):
                mask4 = mask.reshape(b, 1, 1, t)
            elif mask.shape == (b, s, t):
                mask4 = mask.reshape(b, 1, s, t)
            else:
                return _UNSUPPORTED  # key lengths (1-D): the unprepared path
        if bias4 is None and mask4 is None:
            return None
        f = wide.type(self.mask_filter)
        # with a term, the causal mask is part of it (a position masked both ways gets the
        # filter once, as on the CPU provider): a constant (1, 1, S, T) operand, made once
        keep = None  # 1 where the causal mask lets a query see a key
        if self.causal:
            keep = self._causal_keep.get((s, t))
            if keep is None:
                visible = ~attention.causal_mask(s, t)[None, None]
                keep = self._causal_keep[(s, t)] = xp.asarray(visible.astype(np.uint8))

        def make(buf: Any, sh: int) -> tuple[Any, Any]:
            out, call = _make(buf, sh)
            if call is None and out is not bias4:
                raise RuntimeError("the attention term's kernel does not take these operands")
            return out, call

        def _make(buf: Any, sh: int) -> tuple[Any, Any]:
            if mask4 is None and keep is None:
                assert bias4 is not None
                if bias4.dtype == wide:
                    return bias4, None  # read in place, through its strides
                out = buf(bias4.shape, wide)
                return out, F.CAST.bind(xp, bias4, out, stream=sh)
            shapes = [a.shape for a in (bias4, mask4, keep) if a is not None]
            out_shape = shapes[0]
            for other in shapes[1:]:
                out_shape = _broadcast(out_shape, other)
            out = buf(out_shape, wide)
            if mask4 is None:  # the bias and the causal mask
                return out, BIAS_MASK_TERM.bind(xp, bias4, keep, f, out, stream=sh)
            if keep is not None:
                if bias4 is None:
                    return out, MASK2_TERM.bind(xp, mask4, keep, f, out, stream=sh)
                return out, BIAS_MASK2_TERM.bind(xp, bias4, mask4, keep, f, out, stream=sh)
            if bias4 is None:
                return out, MASK_TERM.bind(xp, mask4, f, out, stream=sh)
            return out, BIAS_MASK_TERM.bind(xp, bias4, mask4, f, out, stream=sh)

        return make

    def _softmax_call(self, scores: Any, add: Any, dt: np.dtype, sh: int) -> Any:
        xp = self.xp
        causal = self.causal and add is None  # else the term holds the causal mask
        if xp is np:
            filt, zero_nan = self.mask_filter, self.zero_nan
            return lambda: masked_softmax_np(scores, add, causal, filt, zero_nan)
        name, grid, block, args = softmax_launch(
            scores, add, causal, self.mask_filter, self.zero_nan
        )
        fn = SOFTMAX_ROWS.function(xp, "oxa_softmax_" + name + F.storage_key(dt))
        return function_launch(fn, grid, block, args, sh)


def _multiprocessors(ordinal: int) -> int:
    """The SMs of CUDA device ``ordinal`` (132 on an H100)."""
    devices, _ = probe_devices()
    return next((d.multiprocessors for d in devices if d.ordinal == ordinal), 132)


def _compute_capability(ordinal: int) -> int:
    """The major compute capability of CUDA device ``ordinal`` (0 when unknown)."""
    devices, _ = probe_devices()
    return next((d.major for d in devices if d.ordinal == ordinal), 0)


_UNSUPPORTED = object()
# onnxruntime's AttentionBackend bits (``sdpa_kernel``) that select the fused attention
_FLASH_ATTENTION, _CUDNN_FLASH_ATTENTION = 1, 8


def _mask_term_np(m: np.ndarray, f: Any, y: np.ndarray) -> None:
    np.copyto(y, np.where(m == 0, f, 0))


def _bias_mask_term_np(a: np.ndarray, m: np.ndarray, f: Any, y: np.ndarray) -> None:
    np.copyto(y, F.widen(a) + np.where(m == 0, f, 0), casting="unsafe")


def _mask2_term_np(m: np.ndarray, k: np.ndarray, f: Any, y: np.ndarray) -> None:
    np.copyto(y, np.where((m == 0) | (k == 0), f, 0))


def _bias_mask2_term_np(a: np.ndarray, m: np.ndarray, k: np.ndarray, f: Any, y: np.ndarray) -> None:
    np.copyto(y, F.widen(a) + np.where((m == 0) | (k == 0), f, 0), casting="unsafe")


# the mask's additive term: the filter value where the mask is 0 (plus the attention bias)
MASK_TERM = F.Elementwise(
    "M m, W f", "W y", "y = (m == M(0)) ? f : W(0)", "oxa_mask_term", _mask_term_np
)
BIAS_MASK_TERM = F.Elementwise(
    "B a, M m, W f",
    "W y",
    "typedef ox_wide_t<B>::type WB; y = W(WB(a)) + ((m == M(0)) ? f : W(0))",
    "oxa_bias_mask_term",
    _bias_mask_term_np,
    F.WIDE_PRE,
)


# ... where either of two masks is 0 (a padding mask and the causal mask): the filter once
MASK2_TERM = F.Elementwise(
    "M m, K k, W f",
    "W y",
    "y = (m == M(0) || k == K(0)) ? f : W(0)",
    "oxa_mask2_term",
    _mask2_term_np,
)
BIAS_MASK2_TERM = F.Elementwise(
    "B a, M m, K k, W f",
    "W y",
    "typedef ox_wide_t<B>::type WB; y = W(WB(a)) + ((m == M(0) || k == K(0)) ? f : W(0))",
    "oxa_bias_mask2_term",
    _bias_mask2_term_np,
    F.WIDE_PRE,
)


def register(reg: KernelRegistry, enable_cudnn: bool) -> None:
    for domain in (MS, PLUG):
        reg.kernel("MultiHeadAttention", domain=domain, since=1, types={0: ATTENTION_TYPES})(
            MultiHeadAttention
        )
        reg.kernel("Attention", domain=domain, since=1, types={0: ATTENTION_TYPES})(Attention)
