// Runs a CUDA C++ kernel written against kernels/cuda/int2_history.cu's device primitives on the CPU: one std::thread
// per CUDA thread, the 32 threads of a warp meeting at a barrier at every warp-wide operation (mma.sync, ldmatrix,
// shuffles, __syncwarp), which this header computes from the PTX ISA's fragment layouts on all 32 lanes' registers.
// cp.async copies are queued per thread and done at cp.async.wait_group, as late as the hardware may do them, so a
// tile read before its wait sees stale bytes here too. Test-only (tests/test_cuda_history.py builds it with g++).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3_ threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
struct Warp {
  std::barrier<> sync{32};
  uint32_t words[32][8];  // each lane's operands for the op in progress
  float floats[32][4];
};
inline thread_local Warp* warp = nullptr;
inline thread_local uint8_t* shared = nullptr;
struct Copy { void* dst; const void* src; int bytes; };
inline thread_local std::deque<std::vector<Copy>> groups;  // committed groups, oldest first
inline thread_local std::vector<Copy> open_group;
inline int lane() { return threadIdx.x % 32; }

inline uint16_t f2h(float f) { _Float16 h = static_cast<_Float16>(f); uint16_t b; std::memcpy(&b, &h, 2); return b; }
inline float h2f(uint16_t b) { _Float16 h; std::memcpy(&h, &b, 2); return static_cast<float>(h); }
}  // namespace emu

#define OSCAR_SHARED_BASE(name) uint8_t* name = emu::shared

inline float f16_bits_to_float(uint16_t b) { return emu::h2f(b); }
inline uint16_t float_to_f16_bits(float f) { return emu::f2h(f); }
inline uint32_t pack_f16x2(float lo, float hi) { return emu::f2h(lo) | (static_cast<uint32_t>(emu::f2h(hi)) << 16); }
inline float exp2_approx(float x) { return std::exp2(x); }
inline uint32_t pair_bytes(uint32_t w) {  // __byte_perm(w, 0, 0x3120): bytes [b0, b2, b1, b3]
  uint32_t b0 = w & 0xFF, b1 = (w >> 8) & 0xFF, b2 = (w >> 16) & 0xFF, b3 = w >> 24;
  return b0 | (b2 << 8) | (b1 << 16) | (b3 << 24);
}
inline uint32_t biased_plane_f16x2(uint32_t x, uint32_t mask) { return (x & mask) | 0x64006400u; }  // lop3 alone
inline uint32_t low_halves(uint32_t a, uint32_t b) { return (a & 0xFFFFu) | (b << 16); }     // prmt 0x5410
inline uint32_t high_halves(uint32_t a, uint32_t b) { return (a >> 16) | (b & 0xFFFF0000u); }  // prmt 0x7632
inline uint32_t hmul2(uint32_t a, uint32_t b) {  // mul.rn.f16x2: the fp16 product is exact in float, rounded once
  return pack_f16x2(emu::h2f(a & 0xFFFF) * emu::h2f(b & 0xFFFF), emu::h2f(a >> 16) * emu::h2f(b >> 16));
}
struct uint4 { uint32_t x, y, z, w; };
inline uint32_t plane_f16x2(uint32_t x, uint32_t mask) {  // ((x & mask) | 0x6400 in each half) - 1024.0, per half
  uint32_t r = (x & mask) | 0x64006400u;
  return pack_f16x2(emu::h2f(r & 0xFFFF) - 1024.f, emu::h2f(r >> 16) - 1024.f);
}

inline uint32_t wide_plane_f16x2(uint32_t high, uint32_t low, uint32_t mask) {  // (h + l/4)·4^p per half
  const uint32_t h = plane_f16x2(high, mask), l = plane_f16x2(low, mask);
  return pack_f16x2(emu::h2f(h & 0xFFFF) + 0.25f * emu::h2f(l & 0xFFFF), emu::h2f(h >> 16) + 0.25f * emu::h2f(l >> 16));
}

inline void sync_warp() { emu::warp->sync.arrive_and_wait(); }

inline float shfl_xor(float v, int m) {
  auto& w = *emu::warp;
  const int l = emu::lane();
  w.floats[l][0] = v;
  w.sync.arrive_and_wait();
  const float out = w.floats[l ^ m][0];
  w.sync.arrive_and_wait();
  return out;
}

namespace emu {
// D = A·B + C of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 for the calling lane, from every lane's registers
// in warp->words[lane] = {a0, a1, a2, a3, b0, b1}. Fragments (lane = 4g + t): A a0:(g, 2t..2t+1) a1:(g+8, 2t..)
// a2:(g, 2t+8..) a3:(g+8, 2t+8..); B b0:(k 2t..2t+1, n g) b1:(k 2t+8.., n g); C c0,c1:(g, 2t..2t+1) c2,c3:(g+8, ..).
inline void mma_from_words(float (&c)[4]) {
  float A[16][16], B[16][8];
  for (int ln = 0; ln < 32; ++ln) {
    const int g = ln / 4, t = ln % 4;
    const uint32_t* r = warp->words[ln];
    auto lo = [](uint32_t x) { return h2f(x & 0xFFFF); };
    auto hi = [](uint32_t x) { return h2f(x >> 16); };
    A[g][2 * t] = lo(r[0]); A[g][2 * t + 1] = hi(r[0]);
    A[g + 8][2 * t] = lo(r[1]); A[g + 8][2 * t + 1] = hi(r[1]);
    A[g][2 * t + 8] = lo(r[2]); A[g][2 * t + 9] = hi(r[2]);
    A[g + 8][2 * t + 8] = lo(r[3]); A[g + 8][2 * t + 9] = hi(r[3]);
    B[2 * t][g] = lo(r[4]); B[2 * t + 1][g] = hi(r[4]);
    B[2 * t + 8][g] = lo(r[5]); B[2 * t + 9][g] = hi(r[5]);
  }
  const int g = lane() / 4, t = lane() % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A[rows[e]][k] * B[k][cols[e]];
    c[e] += sum;
  }
}
}  // namespace emu

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8i..8i+7 give the rows of matrix i (16 bytes each); lane
// 4g + t receives, of each matrix, the b16 elements (row 2t, column g) and (row 2t + 1, column g).
inline void ldsm_x4_trans(uint32_t (&d)[4], const void* row) {
  auto& w = *emu::warp;
  const int l = emu::lane();
  std::memcpy(w.words[l], row, 16);
  w.sync.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    uint16_t e0, e1;
    std::memcpy(&e0, reinterpret_cast<const uint8_t*>(w.words[8 * i + 2 * t]) + 2 * g, 2);
    std::memcpy(&e1, reinterpret_cast<const uint8_t*>(w.words[8 * i + 2 * t + 1]) + 2 * g, 2);
    d[i] = e0 | (static_cast<uint32_t>(e1) << 16);
  }
  w.sync.arrive_and_wait();
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane 4r + c/2 holds element (r, c) of an 8 × 8 b16 matrix (half c % 2);
// each lane receives the transpose's elements in the same places.
inline uint32_t movmatrix_trans(uint32_t x) {
  auto& w = *emu::warp;
  const int l = emu::lane();
  w.words[l][0] = x;
  w.sync.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  auto element = [&](int r, int c) { return (w.words[4 * r + c / 2][0] >> (16 * (c % 2))) & 0xFFFFu; };
  const uint32_t out = element(2 * t, g) | (element(2 * t + 1, g) << 16);
  w.sync.arrive_and_wait();
  return out;
}

inline void cp_async16(void* dst, const void* src) { emu::open_group.push_back({dst, src, 16}); }
inline void cp_async4(void* dst, const void* src) { emu::open_group.push_back({dst, src, 4}); }
inline void cp_async_commit() { emu::groups.push_back(std::move(emu::open_group)); emu::open_group.clear(); }
template <int N> inline void cp_async_wait() {
  while (emu::groups.size() > static_cast<size_t>(N)) {
    for (const auto& c : emu::groups.front()) std::memcpy(c.dst, c.src, c.bytes);
    emu::groups.pop_front();
  }
}

// A launch: blocks one after another, each with its threads and shared memory.
template <typename Params>
void emulate_launch(void (*kernel)(const Params), unsigned grid, unsigned threads, size_t shared_bytes,
                    const Params& params) {
  for (unsigned block = 0; block < grid; ++block) {
    std::vector<uint8_t> shared(shared_bytes + 16);
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared.data()) + 15) & ~uintptr_t(15));
    std::vector<emu::Warp> warps(threads / 32);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        threadIdx.x = t; blockIdx.x = block; blockDim.x = threads; gridDim.x = grid;
        emu::warp = &warps[t / 32];
        emu::shared = base;
        kernel(params);
        cp_async_wait<0>();
      });
    for (auto& th : pool) th.join();
  }
}

inline float shfl_idx(float v, int src) {
  auto& w = *emu::warp;
  const int l = emu::lane();
  w.floats[l][0] = v;
  w.sync.arrive_and_wait();
  const float out = w.floats[src][0];
  w.sync.arrive_and_wait();
  return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 with all four A registers.
inline void mma16816_full(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                          uint32_t b1) {
  auto& w = *emu::warp;
  const int l = emu::lane();
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  std::memcpy(w.words[l], mine, sizeof mine);
  w.sync.arrive_and_wait();
  emu::mma_from_words(c);
  w.sync.arrive_and_wait();
}
