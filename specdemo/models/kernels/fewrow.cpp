// y[M, N] = x[M, K] @ W.T for the few rows of a decoding pass, on a W packed once as [N / VW][K][VW], VW being the
// vector width: 16 floats with AVX-512, else 8. Built for the machine it runs on by native.py (-march=native).
// W is float32, or float16 where every weight is a float16 value (an EAGLE-3 head's checkpoint): each weight vector
// is widened to float32 in registers (exact), so the products are bit for bit the float32 kernel's from half the bytes.
// The float16 entry point exists where the CPU widens in one instruction (x86's F16C); elsewhere only float32's.
//
// The weights stream from memory once per call and every streamed vector meets up to MMAX rows while it is in
// registers, so a 9-row call costs about what a 1-row call does; more rows go in even chunks, each unit of weights
// meeting every chunk while it is in cache. Each output
// is one chain of fused multiply-adds over k in order, the same for every M: a row's result does not depend on how
// many rows share the call, so a verify pass of 9 tokens computes each token's products bit for bit as a 1-token pass.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
constexpr int VW = 16, REGS = 28, MMAX = 14;  // 32 vector registers: 28 accumulators, weights and a broadcast
#else
constexpr int VW = 8, REGS = 12, MMAX = 12;  // 16
#endif
constexpr int NVMAX = 8;          // weight vectors a unit streams side by side
constexpr int64_t AHEAD = 1024;   // how far ahead (floats) each stream is prefetched

typedef float vec __attribute__((vector_size(VW * 4)));
typedef uint16_t half;  // a float16's bits
#if defined(__F16C__)
#include <immintrin.h>
#define HALVES 1
#else
#define HALVES 0
#endif

template <typename T>
static inline vec load(const T* p) {
  vec v;
  if constexpr (sizeof(T) == 4) {
    std::memcpy(&v, p, sizeof(vec));
  } else {
#if HALVES && defined(__AVX512F__)
    __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&v, &w, sizeof(vec));
#elif HALVES
    __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    std::memcpy(&v, &w, sizeof(vec));
#endif
  }
  return v;
}
#define UNROLL _Pragma("GCC unroll 32")

// rows 0..M of y for the output columns of blocks b0..b0+NV
template <typename T, int M, int NV>
static void unit(const float* __restrict x, const T* __restrict wp, float* __restrict y, int64_t K, int64_t N,
                 int64_t b0) {
  vec acc[M][NV];
  const T* w[NV];
  UNROLL for (int m = 0; m < M; m++) UNROLL for (int v = 0; v < NV; v++) acc[m][v] = (vec){};
  UNROLL for (int v = 0; v < NV; v++) w[v] = wp + (b0 + v) * K * VW;
  for (int64_t k = 0; k < K; k++) {
    vec wv[NV];
    UNROLL for (int v = 0; v < NV; v++) {
      __builtin_prefetch(w[v] + k * VW + AHEAD);
      wv[v] = load(w[v] + k * VW);
    }
    UNROLL for (int m = 0; m < M; m++) {
      vec xb = (vec){} + x[m * K + k];
      UNROLL for (int v = 0; v < NV; v++) acc[m][v] += xb * wv[v];
    }
  }
  UNROLL for (int m = 0; m < M; m++) UNROLL for (int v = 0; v < NV; v++)
    std::memcpy(y + m * N + (b0 + v) * VW, &acc[m][v], sizeof(vec));
}

template <typename T>
using unit_fn = void (*)(const float*, const T*, float*, int64_t, int64_t, int64_t);

constexpr int widest(int m) { return REGS / m < 1 ? 1 : (REGS / m > NVMAX ? NVMAX : REGS / m); }

template <typename T, int M, int NV>
static void fill_row(unit_fn<T>* row) {
  row[NV] = unit<T, M, NV>;
  if constexpr (NV > 1) fill_row<T, M, NV - 1>(row);
}

template <typename T, int M>
static void fill(unit_fn<T> (*table)[NVMAX + 1]) {
  fill_row<T, M, widest(M)>(table[M]);
  if constexpr (M > 1) fill<T, M - 1>(table);
}

static unit_fn<float> table[MMAX + 1][NVMAX + 1];
static const bool filled = [] { fill<float, MMAX>(table); return true; }();
#if HALVES
static unit_fn<half> table_h[MMAX + 1][NVMAX + 1];
static const bool filled_h = [] { fill<half, MMAX>(table_h); return true; }();
#endif

template <typename T>
static void fewrow(const unit_fn<T> (*tab)[NVMAX + 1], const float* x, const T* wp, float* y, int64_t M, int64_t K,
                   int64_t N, int threads) {
  int64_t chunks = (M + MMAX - 1) / MMAX, size = (M + chunks - 1) / chunks;
  int64_t blocks = N / VW, nv = widest((int)size);
  int64_t even = (blocks + 2 * threads - 1) / (2 * threads);  // at least two units a thread where N allows
  if (even < nv) nv = even < 1 ? 1 : even;
  int64_t units = (blocks + nv - 1) / nv;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < units; u++) {
    int64_t width = u + 1 < units ? nv : blocks - u * nv;  // a smaller chunk has room for at least as many
    for (int64_t r = 0; r < M; r += size) {
      int64_t rows = M - r < size ? M - r : size;
      tab[rows][width](x + r * K, wp, y + r * N, K, N, u * nv);
    }
  }
}

extern "C" {
int specdemo_vector_width() { return VW; }
int specdemo_max_rows() { return MMAX; }

// M >= 1; N a multiple of VW; x, wp and y contiguous
void specdemo_fewrow(const float* x, const float* wp, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  fewrow<float>(table, x, wp, y, M, K, N, threads);
}

#if HALVES
// the same with W's values stored as float16
void specdemo_fewrow_h(const float* x, const half* wp, float* y, int64_t M, int64_t K, int64_t N, int threads) {
  fewrow<half>(table_h, x, wp, y, M, K, N, threads);
}
#endif
}
