// The INT2 history of OSCAR's decode attention, one warp per (batch, KV head, history split): CUDA C++ with MMA
// fragments built straight from the stored bytes and the tiles staged through shared memory by cp.async, so that
// the next tile's bytes are in flight while the current one is computed. It writes the same partial outputs and
// log-sum-exps as the Triton kernel's history splits (kernels/attention.py), which the Triton merge then combines
// with the sink and window splits; `kernels/cuda_history.py` launches it and says which layouts it covers.
//
// Layout covered: head_dim 128, channel-wise keys (per-head blocks of >= 16 tokens, wide key channels), token-wise
// values with one (scale, minimum) per token, wide heads (4-bit codes kept as a high plane in the head's row and a low
// plane in a row after the layer's heads, under a scale stored as 4·s: `int2_history_attention_wide` stages both and
// reads each code as (h + l/4)·4^p, exact in fp16), at most 8 query rows per KV head, sm_80+ instructions
// (mma.sync m16n8k16, ldmatrix, movmatrix, cp.async). Built to PTX by
// `python -m oscar_hf.kernels.cuda_history --build`; tests/cuda_emulation.h runs this same file on the CPU, 32 threads
// per warp in lockstep at each warp-wide op.
//
// Fragments (PTX ISA, mma.m16n8k16 with f16 operands; lane = 4·g + j):
//   scores, transposed: Sᵀ[n][r] = Σ_k K[n][k]·Q'[r][k] over a 16-token subtile, with A = key codes (rows g, g + 8
//   are tokens) and B = the query times the key block's scales (column g is query row g). The k order is ours to
//   choose: in k-step (wi, p), k = 2j, 2j+1, 2j+8, 2j+9 is key slot 32p + 8j + 4wi + 0, 1, 2, 3, which are the
//   2-bit codes of plane p in bytes 8j + 4wi + 0..3 of the token's row, the 32-bit word lane j reads (two words:
//   wi = 0, 1). Lane 4g + j holds tokens g, g + 8 of query rows 2j, 2j + 1, and keeps those rows' softmax state.
//   values, transposed: Oᵀ[c][r] = Σ_n V[n][c]·P'[r][n] with P' = P times each token's value scale. `movmatrix`
//   turns each 8-token half of Sᵀ's layout into P'ᵀ's B fragment (lane 4g + j: row g at tokens 2j, 2j + 1 |
//   2j + 8, 2j + 9), and Vᵀ's A fragment comes from `ldmatrix.trans` over the 16-byte halves of the token rows: in
//   m-tile (odd, p), MMA row g is channel 32p + 2g + odd and row g + 8 channel 32p + 16 + 2g + odd. All 8 output
//   columns are query rows, so no accumulator holds padding (lane 4g + j: query rows 2j, 2j + 1).
//   A 2-bit code c of plane p becomes the fp16 number c·4^p exactly: masked in place into the mantissa of 1024
//   ((x & mask) | 0x6400, one `lop3` for two codes) minus 1024; 4^-p is folded into the query (keys) or applied to
//   the accumulator at the end (values, whose 2-bit codes skip the subtraction: 1024·ΣP' leaves once at the end).

#include <stdint.h>
#ifndef OSCAR_EMULATE
#include <cuda_fp16.h>
#endif

namespace oscar {

constexpr int D = 128;
constexpr int ROW_BYTES = D / 4;  // one packed token row
constexpr int TILE = 64;          // tokens per staged tile
// warps per block, each its own work item, and blocks an SM: 3 blocks of 4 warps for 2-bit heads (16.5 KB of shared
// memory and <= 168 registers a warp); a layer with wide heads stages their low planes too, 24.5 KB a warp, and keeps
// 2 blocks of 4 (3 blocks of 3 warps, squeezed to 168 registers, spilled in the tile loop and ran 1.25x slower at
// 100K x 1 on an H100: eval/results/gpu/cuda_history_h100.log)
template <bool WIDE> constexpr int WARPS = 4;
template <bool WIDE> constexpr int BLOCKS_PER_SM = WIDE ? 2 : 3;
constexpr int STAGES = 2;         // tiles in flight per warp
constexpr int MAX_ROWS = 8;       // query rows per KV head (the MMAs' 8 columns)
constexpr uint32_t MAGIC = 0x64006400u;  // 1024.0 in both fp16 halves

struct Params {  // mirrored by kernels/cuda_history.py (HistoryParams): keep the field order
  const uint16_t* q;  int64_t sq_b, sq_h, sq_m;        // [B, H, M, D] bf16 or fp16, unit channel stride
  float* o;           int64_t so_b, so_h, so_m, so_s;  // partial outputs [B, H, M, S, D] float32
  float* lse;         int64_t sl_b, sl_h, sl_m, sl_s;  // partial log-sum-exps [B, H, M, S]
  const uint8_t* codes_k; int64_t sck_b, sck_h, sck_t;  // [B, H, cap_k, D/4] packed rows
  const uint8_t* codes_v; int64_t scv_b, scv_h, scv_t;  // [B, H, cap_v, D/4]
  const uint32_t* meta_k; int64_t smk_b, smk_c, smk_r;  // [B, n_chunks, R, D] (scale, minimum) fp16 pairs as words
  const uint32_t* meta_v; int64_t smv_b, smv_h, smv_t;  // [B, H, cap_v] (scale, minimum) words
  const int32_t* key_table;      // [H, 2]: (block, first meta row in a chunk) per KV head
  const int32_t* channel_table;  // [H]: wide key channels per KV head, or null
  const int32_t* wide_table;     // [H]: a wide head's low-plane codes row, -1 for a 2-bit head; null: none wide
  const uint8_t* mask; int64_t smask_b, smask_n;  // [B, N] over positions, or null
  const int32_t* lengths;        // (n_sink, n_hist, n_recent, ring_lo, q_start) on the device, or null
  int32_t batch, heads, rows, tokens_per_row_group, q_start, n_sink, n_hist;
  int32_t splits, split_tokens, first_split, key_chunk, cap_k, cap_v, q_bf16;
  float scale;  // softmax scale times log2(e)
};

template <bool WIDE> struct Stage {
  uint8_t k[TILE * ROW_BYTES];
  uint8_t v[TILE * ROW_BYTES];  // 16-byte halves swizzled: half c of token n at c ^ ((n >> 2) & 1)
  uint32_t vmeta[TILE];
  uint32_t kmeta[TILE / 16][D];  // the key block's row, for each 16-token subtile that starts a block
  uint8_t k_low[WIDE ? TILE * ROW_BYTES : 16];  // a wide head's low planes, laid out as k and v
  uint8_t v_low[WIDE ? TILE * ROW_BYTES : 16];
};

template <bool WIDE> struct WarpSmem {
  Stage<WIDE> stage[STAGES];
  union {
    struct {
      uint16_t q[MAX_ROWS][D];  // fp16 query rows, times the softmax scale and log2(e)
      uint16_t g[MAX_ROWS][D];  // the same rows gathered by the key slots' pairing (wide key channels)
    } rows;
    // then, as each lane reads them (conflict-free 16-byte loads): query[p][lane] = its gathered slots of plane p
    // (words qg[wi][p][e] at 2·wi + e), query[4 + p][lane] the same slots as they are (qq)
    uint4 query[8][32];
  };
};

#ifndef OSCAR_EMULATE
__device__ __forceinline__ void mma16816_full(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&d)[4], const void* row) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(addr), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ uint32_t plane_f16x2(uint32_t x, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(MAGIC));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(r) : "r"(MAGIC));
  return r;
}
// A wide head's code pair: high plane h and low plane l of plane p, as (h + l/4)·4^p = (1024 + l·4^p)/4 + (1024 +
// h·4^p) - 1280, one rounding, exact.
__device__ __forceinline__ uint32_t wide_plane_f16x2(uint32_t high, uint32_t low, uint32_t mask) {
  uint32_t h, l, r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(high), "r"(mask), "r"(MAGIC));
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(l) : "r"(low), "r"(mask), "r"(MAGIC));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x65006500u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(l), "r"(0x34003400u), "r"(h));
  return r;
}
// (1024 + c·4^p) per half, without the subtraction: the value MMAs subtract 1024·ΣP' once per output instead
__device__ __forceinline__ uint32_t biased_plane_f16x2(uint32_t x, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(MAGIC));
  return r;
}
__device__ __forceinline__ uint32_t pair_bytes(uint32_t w) { return __byte_perm(w, 0, 0x3120); }
__device__ __forceinline__ uint32_t low_halves(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ uint32_t high_halves(uint32_t a, uint32_t b) { return __byte_perm(a, b, 0x7632); }
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {  // the warp's 8 × 8 b16 matrix, transposed
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ float shfl_idx(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
__device__ __forceinline__ void sync_warp() { __syncwarp(); }
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float f16_bits_to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ uint16_t float_to_f16_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
#define OSCAR_SHARED_BASE(name) extern __shared__ __align__(16) uint8_t name[]
#endif

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  union { uint32_t u; float f; } x;
  x.u = static_cast<uint32_t>(b) << 16;
  return x.f;
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// Where the key metadata of the next 16-token subtile to stage lies: chunk, subtile within the chunk and within its
// key block, metadata row. Blocks and chunks are whole subtiles (blocks of >= 16 tokens, powers of two or multiples
// of 128, that divide the chunk: format.kernel_layout_problem), so a subtile at a time it advances without the
// integer divisions that indexing by token would take in the tile loop.
struct KeyBlockCursor {
  int chunk, sub, in_block, row;
  int chunk_subtiles, block_subtiles, first_row;
  __device__ __forceinline__ void start(int t, int key_chunk, int kblock, int koffset) {
    chunk_subtiles = key_chunk / 16;
    block_subtiles = kblock / 16;
    first_row = koffset;
    chunk = t / key_chunk;
    sub = (t % key_chunk) / 16;
    in_block = sub % block_subtiles;
    row = koffset + sub / block_subtiles;
  }
  __device__ __forceinline__ void advance() {
    ++sub;
    ++in_block;
    if (in_block == block_subtiles) {
      in_block = 0;
      ++row;
    }
    if (sub == chunk_subtiles) {  // a chunk ends where one of its blocks does
      sub = 0;
      ++chunk;
      row = first_row;
    }
  }
};

template <bool WIDE>
__device__ __forceinline__ void issue_codes(uint8_t* k, uint8_t* v, const Params& p, int b, int row, int t0, int lane) {
  const uint8_t* ck = p.codes_k + b * p.sck_b + row * p.sck_h;
  const uint8_t* cv = p.codes_v + b * p.scv_b + row * p.scv_h;
#pragma unroll
  for (int i = 0; i < TILE * ROW_BYTES / 16 / 32; ++i) {  // 4 16-byte pieces per lane and stream
    int piece = lane + 32 * i, n = piece >> 1, half = piece & 1;
    cp_async16(k + n * ROW_BYTES + 16 * half, ck + imin(t0 + n, p.cap_k - 1) * p.sck_t + 16 * half);
    cp_async16(v + n * ROW_BYTES + 16 * (half ^ ((n >> 2) & 1)), cv + imin(t0 + n, p.cap_v - 1) * p.scv_t + 16 * half);
  }
}

// Stage one tile: key and value codes, the values' (scale, minimum) words, and the key block rows that start in it
// (and the split's first). Returns a bit per 16-token subtile whose block row it staged: the query fragments to
// rebuild when the tile is read.
template <bool WIDE>
__device__ __forceinline__ uint32_t issue_tile(Stage<WIDE>& st, const Params& p, int b, int h, int t0, int hi,
                                               int lane, int wide_row, KeyBlockCursor& cursor, bool first) {
  issue_codes<WIDE>(st.k, st.v, p, b, h, t0, lane);
  if (WIDE && wide_row >= 0) issue_codes<WIDE>(st.k_low, st.v_low, p, b, wide_row, t0, lane);
  const uint32_t* mv = p.meta_v + b * p.smv_b + h * p.smv_h;
#pragma unroll
  for (int i = 0; i < TILE / 32; ++i) {
    int n = lane + 32 * i;
    cp_async4(st.vmeta + n, mv + imin(t0 + n, p.cap_v - 1) * p.smv_t);
  }
  const uint32_t* mk = p.meta_k + b * p.smk_b;
  uint32_t staged = 0;
#pragma unroll
  for (int i = 0; i < TILE / 16; ++i) {
    if (t0 + 16 * i < hi && ((first && i == 0) || cursor.in_block == 0)) {
      cp_async16(&st.kmeta[i][4 * lane], mk + cursor.chunk * p.smk_c + cursor.row * p.smk_r + 4 * lane);
      staged |= 1u << i;
    }
    cursor.advance();
  }
  return staged;
}

// The query's B fragments for one key block: slot s of k-step (wi, p) is the gathered query times the slot's scale
// and 4^-p, as fp16 products (each rounded once, as the float product would be: both factors are fp16 and 4^-p is
// exact), and the block's bias Σ_c q_c·minimum_c of query rows 2j and 2j + 1, by MMAs of the minima (every row of A
// alike) against the query. `query`: the lanes' query slots (row g), gathered by the wide channels' pairing and as
// they are (WarpSmem::query).
__device__ __forceinline__ void key_block_fragments(uint32_t (&a)[2][4][2], float (&bias)[2], const uint32_t* kmeta,
                                                    const uint4 (&query)[8][32], int lane, int j) {
  constexpr uint32_t PLANE[4] = {0x3C003C00u, 0x34003400u, 0x2C002C00u, 0x24002400u};  // 4^-p in both fp16 halves
  float sums[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int p = 0; p < 4; ++p)
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      const uint4 w = *reinterpret_cast<const uint4*>(kmeta + 32 * p + 8 * j + 4 * wi);  // (scale, minimum) words
      const uint4 qg = query[p][lane], qq = query[4 + p][lane];
      uint32_t a0 = hmul2(wi ? qg.z : qg.x, low_halves(w.x, w.y)), a1 = hmul2(wi ? qg.w : qg.y, low_halves(w.z, w.w));
      if (p > 0) {
        a0 = hmul2(a0, PLANE[p]);
        a1 = hmul2(a1, PLANE[p]);
      }
      a[wi][p][0] = a0;
      a[wi][p][1] = a1;
      const uint32_t m01 = high_halves(w.x, w.y), m23 = high_halves(w.z, w.w);
      mma16816_full(sums[wi], m01, m01, m23, m23, wi ? qq.z : qq.x, wi ? qq.w : qq.y);
    }
  bias[0] = sums[0][0] + sums[1][0];
  bias[1] = sums[0][1] + sums[1][1];
}

template <bool WIDE> __device__ __forceinline__ void history_attention(const Params& p, uint8_t* shared_bytes) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  WarpSmem<WIDE>& sm = reinterpret_cast<WarpSmem<WIDE>*>(shared_bytes)[warp];
  const int item = blockIdx.x * WARPS<WIDE> + warp;
  if (item >= p.batch * p.heads * p.splits) return;  // whole warps only
  const int bh = item / p.splits, split = item % p.splits;
  const int b = bh / p.heads, h = bh % p.heads;
  int n_sink = p.n_sink, n_hist = p.n_hist, q_start = p.q_start;
  if (p.lengths != nullptr) {
    n_sink = p.lengths[0];
    n_hist = p.lengths[1];
    q_start = p.lengths[4];
  }
  const int g = lane / 4, j = lane % 4;
  const int T = p.tokens_per_row_group;
  const int max_qpos = q_start + imin(p.rows, T) - 1;
  const int lo = split * p.split_tokens;
  const int hi = imin(imin(lo + p.split_tokens, n_hist), max_qpos + 1 - n_sink);
  const int wide_row = WIDE ? p.wide_table[h] : -1;
  const bool wide = WIDE && wide_row >= 0;  // uniform over the warp

  // the first tile is asked for before the query is set up, so that its copy's latency overlaps that work (a short
  // split has few tiles to hide it behind)
  static_assert(STAGES == 2, "one staged tile ahead: `pending` holds its fragment bits");
  KeyBlockCursor cursor;
  cursor.start(lo, p.key_chunk, p.key_table[2 * h], p.key_table[2 * h + 1]);
  const int n_tiles = hi > lo ? (hi - lo + TILE - 1) / TILE : 0;
  uint32_t pending = 0;  // the staged tile's subtiles that start a key block
  if (n_tiles > 0) pending = issue_tile<WIDE>(sm.stage[0], p, b, h, lo, hi, lane, wide_row, cursor, true);
  cp_async_commit();

  // the query rows, pre-scaled as the Triton kernel does (fp16), and gathered by the slots' pairing. Each lane reads
  // 4 pieces of 8 channels (row 2i + lane/16, piece lane % 16), all in flight at once: one round trip, where a load
  // per channel took one per unrolled step of the loop
  const uint16_t* qb = p.q + b * p.sq_b + h * p.sq_h;
  uint4 pieces[MAX_ROWS * D / 8 / 32];
#pragma unroll
  for (int i = 0; i < MAX_ROWS * D / 8 / 32; ++i) {
    const int row = 2 * i + lane / 16;
    pieces[i] = row < p.rows ? *reinterpret_cast<const uint4*>(qb + row * p.sq_m + 8 * (lane % 16)) : uint4{0, 0, 0, 0};
  }
#pragma unroll
  for (int i = 0; i < MAX_ROWS * D / 8 / 32; ++i) {
    const uint32_t in[4] = {pieces[i].x, pieces[i].y, pieces[i].z, pieces[i].w};
    uint32_t out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint16_t bits = static_cast<uint16_t>(in[w] >> (16 * e));
        x[e] = (p.q_bf16 ? bf16_bits_to_float(bits) : f16_bits_to_float(bits)) * p.scale;
      }
      out[w] = pack_f16x2(x[0], x[1]);
    }
    *reinterpret_cast<uint4*>(&sm.rows.q[2 * i + lane / 16][8 * (lane % 16)]) = uint4{out[0], out[1], out[2], out[3]};
  }
  sync_warp();
  const int n_wide = p.channel_table != nullptr ? p.channel_table[h] : 0;
  for (int e = lane; e < MAX_ROWS * D; e += 32) {
    int row = e / D, c = e % D;
    sm.rows.g[row][c] = sm.rows.q[row][c < D - n_wide ? c : c - (D - n_wide)];
  }
  sync_warp();
  {  // this lane's query slots (row g; slots 32p + 8j + 4wi + 0..3 of k-step (wi, p)) into WarpSmem::query
    uint32_t words[8][4];
#pragma unroll
    for (int pl = 0; pl < 4; ++pl)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int slot = 32 * pl + 8 * j + 4 * (k / 2) + 2 * (k % 2);
        words[pl][k] = *reinterpret_cast<const uint32_t*>(&sm.rows.g[g][slot]);
        words[4 + pl][k] = *reinterpret_cast<const uint32_t*>(&sm.rows.q[g][slot]);
      }
    sync_warp();  // every lane has read the rows before they are overwritten
#pragma unroll
    for (int k4 = 0; k4 < 8; ++k4) sm.query[k4][lane] = uint4{words[k4][0], words[k4][1], words[k4][2], words[k4][3]};
    sync_warp();
  }

  float acc[2][4][4];  // [odd][plane]: Oᵀ of channels 32·plane + 2g + odd (c0, c1) and + 16 (c2, c3)
#pragma unroll
  for (int odd = 0; odd < 2; ++odd)
#pragma unroll
    for (int pl = 0; pl < 4; ++pl)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[odd][pl][e] = 0.f;
  // this lane's query rows are 2j and 2j + 1 (e = 0, 1) from the scores on: their softmax state, and 1024·ΣP' of
  // each (2-bit value codes enter the MMAs as 1024 + c·4^p; this is subtracted once at the end)
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f}, min_sum[2] = {0.f, 0.f}, off[2] = {0.f, 0.f};
  uint32_t a[2][4][2];
  float bias[2] = {0.f, 0.f};
  int row_pos[2];
  bool row_in[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    row_in[e] = 2 * j + e < p.rows;
    row_pos[e] = q_start + (2 * j + e) % T;
  }

  for (int tt = 0; tt < n_tiles; ++tt) {
    const int ahead = tt + 1;
    const uint32_t starts = pending;
    pending = ahead < n_tiles ? issue_tile<WIDE>(sm.stage[ahead % STAGES], p, b, h, lo + ahead * TILE, hi, lane,
                                                 wide_row, cursor, false)
                              : 0u;
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    sync_warp();
    const Stage<WIDE>& st = sm.stage[tt % STAGES];
    const int t0 = lo + tt * TILE;

    float s[TILE / 16][2][2];  // [subtile][token g, g + 8][query row 2j + e]
    // a tile whose every token every query row sees (all but a split's last tile in decode): no per-token test
    const bool whole = t0 + TILE <= hi && n_sink + t0 + TILE - 1 <= q_start && p.mask == nullptr;
#pragma unroll
    for (int i = 0; i < TILE / 16; ++i) {
      if ((starts >> i) & 1u) key_block_fragments(a, bias, st.kmeta[i], sm.query, lane, j);
      uint32_t words[2][2], lows[2][2];  // [token g, g + 8][word wi]
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int offset = (16 * i + 8 * hh + g) * ROW_BYTES + 8 * j;
        const uint32_t* row = reinterpret_cast<const uint32_t*>(st.k + offset);
        words[hh][0] = row[0];
        words[hh][1] = row[1];
        if (wide) {
          const uint32_t* low = reinterpret_cast<const uint32_t*>(st.k_low + offset);
          lows[hh][0] = low[0];
          lows[hh][1] = low[1];
        }
      }
      // Sᵀ of the subtile's 16 tokens: the codes as A (rows g, g + 8 are tokens), the query fragments as B; the
      // k-steps of word 0 and of word 1 in two accumulators, so two independent chains of 4 MMAs
      float c[2][4];
#pragma unroll
      for (int wi = 0; wi < 2; ++wi)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[wi][e] = 0.f;
#pragma unroll
      for (int pl = 0; pl < 4; ++pl) {
        const uint32_t mask = 0x00030003u << (2 * pl);
#pragma unroll
        for (int wi = 0; wi < 2; ++wi) {
          const uint32_t lo0 = pair_bytes(words[0][wi]), hi0 = lo0 >> 8;  // token g: k 2j.. | 2j + 8..
          const uint32_t lo1 = pair_bytes(words[1][wi]), hi1 = lo1 >> 8;  // token g + 8
          if (wide) {
            const uint32_t llo0 = pair_bytes(lows[0][wi]), lhi0 = llo0 >> 8;
            const uint32_t llo1 = pair_bytes(lows[1][wi]), lhi1 = llo1 >> 8;
            mma16816_full(c[wi], wide_plane_f16x2(lo0, llo0, mask), wide_plane_f16x2(lo1, llo1, mask),
                          wide_plane_f16x2(hi0, lhi0, mask), wide_plane_f16x2(hi1, lhi1, mask), a[wi][pl][0],
                          a[wi][pl][1]);
          } else {
            mma16816_full(c[wi], plane_f16x2(lo0, mask), plane_f16x2(lo1, mask), plane_f16x2(hi0, mask),
                          plane_f16x2(hi1, mask), a[wi][pl][0], a[wi][pl][1]);
          }
        }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int tok = t0 + 16 * i + 8 * hh + g;
        bool token_ok = true;
        if (!whole) {  // branch-free: the split's end and the mask, then causality per row
          token_ok = tok < hi;
          if (p.mask != nullptr)
            token_ok = token_ok & (p.mask[b * p.smask_b + (n_sink + imin(tok, hi - 1)) * p.smask_n] != 0);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float score = c[0][2 * hh + e] + c[1][2 * hh + e] + bias[e];
          if (whole) {
            s[i][hh][e] = score;
          } else {
            const bool visible = token_ok & row_in[e] & (n_sink + tok <= row_pos[e]);
            s[i][hh][e] = visible ? score : -INFINITY;
          }
        }
      }
    }
    // online softmax over the tile (exp2: the scores are in log2 units), each row reduced over the 8 token lanes
    float m_safe[2], alpha[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < TILE / 16; ++i) tile_max = fmaxf(tile_max, fmaxf(s[i][0][e], s[i][1][e]));
      tile_max = fmaxf(tile_max, shfl_xor(tile_max, 4));
      tile_max = fmaxf(tile_max, shfl_xor(tile_max, 8));
      tile_max = fmaxf(tile_max, shfl_xor(tile_max, 16));
      const float m_new = fmaxf(m_i[e], tile_max);
      m_safe[e] = m_new == -INFINITY ? 0.f : m_new;
      alpha[e] = exp2_approx(m_i[e] - m_safe[e]);
      m_i[e] = m_new;
      l_i[e] *= alpha[e];
      min_sum[e] *= alpha[e];
      off[e] *= alpha[e];
    }
#pragma unroll
    for (int odd = 0; odd < 2; ++odd)
#pragma unroll
      for (int pl = 0; pl < 4; ++pl) {
        acc[odd][pl][0] *= alpha[0];
        acc[odd][pl][1] *= alpha[1];
        acc[odd][pl][2] *= alpha[0];
        acc[odd][pl][3] *= alpha[1];
      }
#pragma unroll
    for (int i = 0; i < TILE / 16; ++i) {
      // P' = P times the token's value scale, as Sᵀ's layout (token g or g + 8, rows 2j, 2j + 1) in fp16 pairs;
      // movmatrix transposes each 8 × 8 half into P'ᵀ's B fragment (rows g, tokens 2j, 2j + 1 | 2j + 8, 2j + 9)
      uint32_t pa[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t w = st.vmeta[16 * i + 8 * hh + g];
        const float scale = f16_bits_to_float(static_cast<uint16_t>(w & 0xFFFFu));
        const float minimum = f16_bits_to_float(static_cast<uint16_t>(w >> 16));
        float pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = s[i][hh][e] == -INFINITY ? 0.f : exp2_approx(s[i][hh][e] - m_safe[e]);
          l_i[e] += pe;
          pv[e] = pe == 0.f ? 0.f : pe * scale;  // a masked token's meta may be anything
          min_sum[e] += pe == 0.f ? 0.f : pe * minimum;
        }
        pa[hh] = movmatrix_trans(pack_f16x2(pv[0], pv[1]));
      }
      uint32_t d[4];
      const int n = 16 * i + (lane & 7) + 8 * ((lane >> 3) & 1), part = lane >> 4;
      const int offset = n * ROW_BYTES + 16 * (part ^ ((n >> 2) & 1));
      ldsm_x4_trans(d, st.v + offset);
      if (wide) {
        uint32_t dl[4];
        ldsm_x4_trans(dl, st.v_low + offset);
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          const uint32_t x0 = d[0] >> (8 * odd), x1 = d[2] >> (8 * odd), x2 = d[1] >> (8 * odd), x3 = d[3] >> (8 * odd);
          const uint32_t l0 = dl[0] >> (8 * odd), l1 = dl[2] >> (8 * odd), l2 = dl[1] >> (8 * odd),
                         l3 = dl[3] >> (8 * odd);
#pragma unroll
          for (int pl = 0; pl < 4; ++pl) {
            const uint32_t mask = 0x00030003u << (2 * pl);
            mma16816_full(acc[odd][pl], wide_plane_f16x2(x0, l0, mask), wide_plane_f16x2(x1, l1, mask),
                          wide_plane_f16x2(x2, l2, mask), wide_plane_f16x2(x3, l3, mask), pa[0], pa[1]);
          }
        }
      } else {
        float off_rows[4] = {off[0], off[1], off[0], off[1]};  // every MMA row alike: rows g and g + 8 agree
        mma16816_full(off_rows, MAGIC, MAGIC, MAGIC, MAGIC, pa[0], pa[1]);
        off[0] = off_rows[0];
        off[1] = off_rows[1];
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          // d: tokens 0-7 | 8-15 of bytes 0-15, then of bytes 16-31; byte 2g + odd of each 16-byte half
          const uint32_t x0 = d[0] >> (8 * odd), x1 = d[2] >> (8 * odd), x2 = d[1] >> (8 * odd), x3 = d[3] >> (8 * odd);
#pragma unroll
          for (int pl = 0; pl < 4; ++pl) {
            const uint32_t mask = 0x00030003u << (2 * pl);
            mma16816_full(acc[odd][pl], biased_plane_f16x2(x0, mask), biased_plane_f16x2(x1, mask),
                          biased_plane_f16x2(x2, mask), biased_plane_f16x2(x3, mask), pa[0], pa[1]);
          }
        }
      }
    }
    sync_warp();  // every lane is done with this stage before a later tile is copied into it
  }
  cp_async_wait<0>();

#pragma unroll
  for (int e = 0; e < 2; ++e) {  // each row's sums over its 8 token lanes
#pragma unroll
    for (int m = 4; m < 32; m *= 2) {
      l_i[e] += shfl_xor(l_i[e], m);
      min_sum[e] += shfl_xor(min_sum[e], m);
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int row = 2 * j + e;
    if (!row_in[e]) continue;
    if (g == 0)
      p.lse[b * p.sl_b + h * p.sl_h + row * p.sl_m + (p.first_split + split) * p.sl_s] =
          l_i[e] > 0.f ? (m_i[e] + log2f(l_i[e])) * 0.6931471805599453f : -INFINITY;
    const float inv_l = l_i[e] > 0.f ? 1.f / l_i[e] : 0.f;
    float* o = p.o + b * p.so_b + h * p.so_h + row * p.so_m + (p.first_split + split) * p.so_s;
#pragma unroll
    for (int odd = 0; odd < 2; ++odd)
#pragma unroll
      for (int pl = 0; pl < 4; ++pl) {
        const float plane = 1.0f / static_cast<float>(1 << (2 * pl));
        const int channel = 32 * pl + 2 * g + odd;
        o[channel] = ((acc[odd][pl][e] - off[e]) * plane + min_sum[e]) * inv_l;
        o[channel + 16] = ((acc[odd][pl][2 + e] - off[e]) * plane + min_sum[e]) * inv_l;
      }
  }
}
}  // namespace oscar

using namespace oscar;

extern "C" __global__ void __launch_bounds__(WARPS<false> * 32, BLOCKS_PER_SM<false>)
int2_history_attention(const Params p) {
  OSCAR_SHARED_BASE(shared_bytes);
  history_attention<false>(p, shared_bytes);
}

extern "C" __global__ void __launch_bounds__(WARPS<true> * 32, BLOCKS_PER_SM<true>)
int2_history_attention_wide(const Params p) {
  OSCAR_SHARED_BASE(shared_bytes);
  history_attention<true>(p, shared_bytes);
}
