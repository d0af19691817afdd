/* Few-row matrix products that read the weights once.
 *
 * MLX's CPU backend sends every matmul to cblas_sgemm. For a handful of rows (one
 * decode step of a few sequences) OpenBLAS's sgemm still packs the whole weight matrix
 * into its blocked layout before multiplying, so the weights cross memory twice, and
 * each of the many tiny attention products of a decode step pays the library's set-up.
 * Loaded into the global symbol scope before the BLAS itself, this library's
 * cblas_sgemm answers first:
 *   - up to 8 rows times transposed weights (a Linear layer, x . W^T; attention scores,
 *     q . K^T) go to `few_rows`, which streams each weight row once against all the
 *     rows, split over a small pool of threads when the product is large;
 *   - up to 8 rows times a small plain matrix (attention's scores . V) go to
 *     `few_rows_plain`;
 *   - up to MAX_BLOCKED_ROWS rows times a weight with a compact twin (a short prompt's
 *     prefill) go to `few_rows` in blocks of 8, each block reading the twin once;
 *   - other products with one row (or one column) of output go to the bound library's
 *     cblas_sgemv, and everything else to its cblas_sgemm unchanged.
 * Each output row is summed in the same order whatever the number of rows, so a
 * sequence's results do not depend on what it is batched with. The pool's threads spin
 * only briefly after a product, then sleep: a decode step keeps them awake between its
 * products without starving other threads between steps.
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MAX_ROWS = 8, MAX_THREADS = 8, LANES = 16 };
/* Products with fewer weights run on the calling thread alone. */
enum { MIN_SPLIT_WEIGHTS = 1 << 16 };
/* Up to this many rows, a product over a weight's compact twin runs as blocks of MAX_ROWS
 * rows, each block reading the twin once: below it that costs less than sgemm over the
 * float32 weights (a short prompt's prefill, such as the new words of a spoken turn). */
enum { MAX_BLOCKED_ROWS = 14 };
/* How far ahead of the weight row being read to prefetch (4 KiB). With 8 rows the loop
 * spends long enough on each cache line that the hardware prefetcher falls behind and
 * the loads stall on memory; asking for the weights this far ahead keeps them coming. */
enum { PREFETCH_FLOATS = 1024 };
/* How long an idle pool thread spins before it sleeps. */
static const long SPIN_NS = 50 * 1000;

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);
#if defined(__AVX512F__)
/* LANES floats; loads and stores through it need only float alignment. */
typedef float lanes __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
#else
/* Without AVX-512, LANES floats are two halves of 8. GCC keeps a 64-byte vector that a
 * loop carries (a product's sums) in memory there, and moves it through the stack on
 * every step: the products ran at a quarter of the speed of two 8-float halves. The
 * halves compute what the whole vector did, in the same order (`sum_lanes`). */
typedef float half_lanes __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float half_lanes_at __attribute__((vector_size(LANES / 2 * sizeof(float)), aligned(4)));
typedef struct {
  half_lanes lo, hi;
} lanes;
#endif

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int enabled = 1;

/* Bind to the BLAS at `path`; returns 1 when both routines were found. */
int gemv_forward_bind(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return 0;
  real_sgemm = (sgemm_fn)dlsym(lib, "cblas_sgemm");
  real_sgemv = (sgemv_fn)dlsym(lib, "cblas_sgemv");
  return real_sgemm != NULL && real_sgemv != NULL;
}

/* 0 sends every product to sgemm (for side-by-side timing); returns the old setting. */
int gemv_forward_enable(int on) {
  int old = enabled;
  enabled = on;
  return old;
}

/* c (m x n) = alpha * a (m x k, row stride lda) . b + beta * c, where b is n x k
 * (transposed weights) or k x n (plain), row stride ldb. */
struct product {
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
  const struct twin *twin; /* b's compressed copy, or NULL */
  /* a's rows in 8-bit groups for an integer product over the twin (NULL: rebuild the
   * weights in floats): k values per row, and per group its scale and its sum. */
  const int8_t *xq;
  const float *xd, *xsum;
};

/* BLAS leaves c unread when beta is 0, but a NaN already there could survive 0 * c. */
static inline float scaled(const struct product *p, float sum, const float *c) {
  return p->beta == 0.0f ? p->alpha * sum : p->alpha * sum + p->beta * *c;
}

/* The LANES floats at p, and the operations the products make of them. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) lanes load_lanes(const float *p) {
  return *(const lanes *)p;
}
static inline __attribute__((always_inline)) lanes zero_lanes(void) { return (lanes){0}; }
/* acc + w * x, lane by lane */
static inline __attribute__((always_inline)) lanes add_product(lanes acc, lanes w, lanes x) {
  return acc + w * x;
}
/* acc + a * x, lane by lane */
static inline __attribute__((always_inline)) lanes add_scaled(lanes acc, float a, lanes x) {
  return acc + a * x;
}
static inline __attribute__((always_inline)) float lane(lanes v, int i) { return v[i]; }
#else
static inline __attribute__((always_inline)) lanes load_lanes(const float *p) {
  return (lanes){*(const half_lanes_at *)p, *(const half_lanes_at *)(p + LANES / 2)};
}
static inline __attribute__((always_inline)) lanes zero_lanes(void) { return (lanes){{0}, {0}}; }
static inline __attribute__((always_inline)) lanes add_product(lanes acc, lanes w, lanes x) {
  return (lanes){acc.lo + w.lo * x.lo, acc.hi + w.hi * x.hi};
}
static inline __attribute__((always_inline)) lanes add_scaled(lanes acc, float a, lanes x) {
  return (lanes){acc.lo + a * x.lo, acc.hi + a * x.hi};
}
static inline __attribute__((always_inline)) float lane(lanes v, int i) {
  return i < LANES / 2 ? v.lo[i] : v.hi[i - LANES / 2];
}
#endif

/* Halve and add, four times: the same order for every output. */
static inline float sum_lanes(lanes v) {
#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 12)
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
#elif defined(__clang__) || __GNUC__ >= 12
  half_lanes h = v.lo + v.hi; /* the first halving: lane i and lane i + 8 */
  h += __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1, 2, 3, 0, 1);
  return h[0] + h[1];
#else /* compilers without __builtin_shufflevector: the same sums, lane by lane */
  float f[LANES];
  for (int i = 0; i < LANES; i++) f[i] = lane(v, i);
  for (int half = LANES / 2; half > 0; half /= 2)
    for (int i = 0; i < half; i++) f[i] += f[i + half];
  return f[0];
#endif
}

/* --- transposed weights: one dot product per output ------------------------------ */

/* Weight rows [n0, n1) against all `rows` rows of a. Inlined with a constant `rows`, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
few_rows_range(const struct product *p, int rows, int n0, int n1) {
  const int k = p->k, whole = k - k % LANES;
  for (int n = n0; n < n1; n++) {
    const float *w = p->b + (size_t)n * p->ldb;
    lanes acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = zero_lanes();
    for (int i = 0; i < whole; i += LANES) {
      __builtin_prefetch(w + i + PREFETCH_FLOATS, 0, 3);
      lanes wv = load_lanes(w + i);
      for (int r = 0; r < rows; r++)
        acc[r] = add_product(acc[r], wv, load_lanes(p->a + (size_t)r * p->lda + i));
    }
    for (int r = 0; r < rows; r++) {
      float s = sum_lanes(acc[r]);
      for (int i = whole; i < k; i++) s += w[i] * p->a[(size_t)r * p->lda + i];
      float *out = p->c + (size_t)r * p->ldc + n;
      *out = scaled(p, s, out);
    }
  }
}

/* --- compressed twins: the same weights in a quarter or an eighth of the bytes ------
 *
 * A decode step is bound by the weights it reads, not by its arithmetic. Weights that
 * are exactly `scale * q + offset` per group of 32 (q a 4-bit or 8-bit integer: what a
 * model dequantized from GGUF's Q4_1 and Q8_0 blocks holds) get a twin in that form,
 * found by the fp32 matrix's address; few-row products read the twin and either rebuild
 * each weight, bit for bit, in registers (the sums then run in the same order as over the
 * fp32 weights, so a product's result is the same either way, only sooner), or, over
 * 4-bit twins by default, multiply in integers (below). A matrix whose every weight is a
 * half (a model stored in float16, as Whisper's is) gets a 16-bit twin of those halves:
 * half the bytes, rebuilt exactly, never multiplied in integers. */

/* Twins of rows up to MAX_ROW_GROUPS groups drop offsets that are all zero. */
enum { GROUP = 32, MAX_TWINS = 2048, MAX_ROW_GROUPS = 1024 };

struct twin {
  const float *w; /* the fp32 matrix it stands for: MLX's argument b */
  int n, k, bits;
  /* A group's q: 4 bits, byte j holds weight j (low nibble) and j + 16 (high); 8 bits,
   * one signed byte each. */
  uint8_t *q;
  float *scale, *offset; /* per group; offset NULL when every one is 0 (8 bits) */
};

static struct twin twins[MAX_TWINS];
static atomic_int twin_count;
static atomic_long twin_products;
static int use_twins = 1;

typedef uint8_t bytes16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t signed16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));

/* An IEEE half as a float (where the CPU has no conversion instruction). */
static float half_to_float(uint16_t h) {
  int exponent = (h >> 10) & 31, mantissa = h & 1023;
  float v = exponent == 0    ? ldexpf((float)mantissa, -24)
            : exponent == 31 ? (mantissa ? NAN : INFINITY)
                             : ldexpf((float)(mantissa | 1024), exponent - 25);
  return h >> 15 ? -v : v;
}

/* LANES halves as floats. */
static inline __attribute__((always_inline)) lanes halves(const uint8_t *q) {
  lanes v;
#if defined(__AVX512F__)
  __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q));
  __builtin_memcpy(&v, &f, sizeof v);
#elif defined(__F16C__)
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)q));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q + 16)));
  __builtin_memcpy(&v, &lo, sizeof lo);
  __builtin_memcpy((char *)&v + sizeof lo, &hi, sizeof hi);
#else
  float f[LANES];
  for (int i = 0; i < LANES; i++) {
    uint16_t h;
    __builtin_memcpy(&h, q + 2 * i, sizeof h);
    f[i] = half_to_float(h);
  }
  v = load_lanes(f);
#endif
  return v;
}

/* The weights 16 * half .. 16 * half + 15 of a group as floats, the one way both the
 * check and the products compute them. (Bytes widen to ints before floats: a direct
 * conversion is done lane by lane.) A 16-bit group has no scale or offset. */
static inline __attribute__((always_inline)) lanes rebuild(const uint8_t *q, int bits, int half,
                                                           float scale, float offset) {
  if (bits == 16) return halves(q + 2 * LANES * half);
  ints values;
#if defined(__AVX512F__)
  __m128i b = _mm_loadu_si128((const __m128i *)(q + (bits == 8 ? 16 * half : 0)));
  if (bits == 4)
    values = (ints)_mm512_cvtepu8_epi32(
        _mm_and_si128(half ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15)));
  else
    values = (ints)_mm512_cvtepi8_epi32(b);
#elif defined(__AVX2__)
  __m128i b = _mm_loadu_si128((const __m128i *)(q + (bits == 8 ? 16 * half : 0)));
  if (bits == 4) b = _mm_and_si128(half ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  __m256i first = bits == 4 ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b);
  __m128i rest = _mm_srli_si128(b, 8);
  __m256i second = bits == 4 ? _mm256_cvtepu8_epi32(rest) : _mm256_cvtepi8_epi32(rest);
  __builtin_memcpy(&values, &first, sizeof first);
  __builtin_memcpy((char *)&values + sizeof first, &second, sizeof second);
#else
  if (bits == 4) {
    bytes16 b = *(const bytes16 *)q;
    values = __builtin_convertvector(half ? b >> 4 : b & 15, ints);
  } else {
    values = __builtin_convertvector(*(const signed16 *)(q + 16 * half), ints);
  }
#endif
#if defined(__AVX512F__)
  return __builtin_convertvector(values, lanes) * scale + offset;
#else
  typedef int32_t half_ints __attribute__((vector_size(LANES / 2 * sizeof(int32_t))));
  half_ints lo, hi;
  __builtin_memcpy(&lo, &values, sizeof lo);
  __builtin_memcpy(&hi, (char *)&values + sizeof lo, sizeof hi);
  return (lanes){__builtin_convertvector(lo, half_lanes) * scale + offset,
                 __builtin_convertvector(hi, half_lanes) * scale + offset};
#endif
}

/* One group's q, scale and offset for `w`; 0 when w is not exactly of that form. */
static int compress_group(const float *w, int bits, uint8_t *q, float *scale, float *offset) {
  float lo = w[0], hi = w[0];
  for (int i = 1; i < GROUP; i++) {
    lo = w[i] < lo ? w[i] : lo;
    hi = w[i] > hi ? w[i] : hi;
  }
  float s, o;
  if (bits == 4) { /* unsigned q in 0..15 from the group's least weight up */
    s = (hi - lo) / 15.0f;
    o = lo;
  } else { /* signed q in -127..127 around zero */
    float top = fabsf(lo) > fabsf(hi) ? fabsf(lo) : fabsf(hi);
    s = top / 127.0f;
    o = 0.0f;
  }
  int qs[GROUP];
  for (int i = 0; i < GROUP; i++) {
    float v = s == 0.0f ? 0.0f : rintf((w[i] - o) / s);
    if (!(v >= (bits == 4 ? 0.0f : -127.0f) && v <= (bits == 4 ? 15.0f : 127.0f))) return 0;
    qs[i] = (int)v;
  }
  if (bits == 4)
    for (int j = 0; j < GROUP / 2; j++) q[j] = (uint8_t)(qs[j] | qs[j + GROUP / 2] << 4);
  else
    for (int j = 0; j < GROUP; j++) q[j] = (uint8_t)(int8_t)qs[j];
  for (int half = 0; half < 2; half++) {
    lanes back = rebuild(q, bits, half, s, o);
    for (int i = 0; i < LANES; i++)
      if (lane(back, i) != w[half * LANES + i]) return 0;
  }
  *scale = s;
  *offset = o;
  return 1;
}

static pthread_mutex_t twins_lock = PTHREAD_MUTEX_INITIALIZER;

static const float no_offsets[MAX_ROW_GROUPS];

/* Row n's offsets, or zeros when the twin keeps none. */
static inline const float *row_offsets(const struct twin *t, int n) {
  return t->offset != NULL ? t->offset + (size_t)n * (t->k / GROUP) : no_offsets;
}

/* Offsets all zero (8-bit groups) are not kept: a group's 40 bytes become 36. */
static void drop_zero_offsets(struct twin *t) {
  size_t groups = (size_t)t->n * (t->k / GROUP);
  if (t->k / GROUP > MAX_ROW_GROUPS) return;
  for (size_t g = 0; g < groups; g++)
    if (t->offset[g] != 0.0f) return;
  free(t->offset);
  t->offset = NULL;
}

static void free_twin(struct twin *t) {
  free(t->q);
  free(t->scale);
  free(t->offset);
}

/* Make the twin of the n x k matrix `w` (row-major, contiguous) in `bits` bits.
 * 1: made; 0: w is not exactly of that form (nothing changes); -1: no room. Call it
 * before the products that should use it, and `gemv_forward_untwin` before `w` is
 * freed: its address may then hold other numbers. */
/* A new twin of n x k weights in `bits` bits, its arrays allocated; NULL without memory. */
static int new_twin(struct twin *t, const float *w, int n, int k, int bits) {
  size_t groups = (size_t)n * (k / GROUP);
  *t = (struct twin){w, n, k, bits, NULL, NULL, NULL};
  t->q = aligned_alloc(64, (groups * GROUP * bits / 8 + 63) / 64 * 64);
  t->scale = malloc(groups * sizeof(float));
  t->offset = malloc(groups * sizeof(float));
  return t->q != NULL && t->scale != NULL && t->offset != NULL ? 1 : -1;
}

/* Publish t (made == 1) or free it; returns made, or -1 when there is no room. */
static int keep_twin(struct twin t, int made) {
  if (made == 1) drop_zero_offsets(&t);
  pthread_mutex_lock(&twins_lock);
  int slot = 0, count = atomic_load(&twin_count);
  while (slot < count && twins[slot].w != NULL) slot++; /* a freed slot, or the next one */
  if (made == 1 && slot == MAX_TWINS) made = -1;
  if (made == 1) {
    /* The key goes in last: a product that finds it finds the rest. */
    const float *key = t.w;
    t.w = NULL;
    twins[slot] = t;
    atomic_store(&twin_count, slot == count ? count + 1 : count);
    __atomic_store_n(&twins[slot].w, key, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&twins_lock);
  if (made != 1) free_twin(&t);
  return made;
}

int gemv_forward_twin(const float *w, int n, int k, int bits) {
  if ((bits != 4 && bits != 8) || n <= 0 || k <= 0 || k % GROUP != 0) return 0;
  struct twin t;
  int made = new_twin(&t, w, n, k, bits);
  for (size_t g = 0; made == 1 && g < (size_t)n * (k / GROUP); g++)
    made = compress_group(w + g * GROUP, bits, t.q + g * GROUP * bits / 8, t.scale + g,
                          t.offset + g);
  return keep_twin(t, made);
}

/* The 4-bit twin of w from given groups (a GGUF file's own 4-bit blocks, whose values a
 * group's least and greatest need not span): q packed as a twin's (byte j of a group,
 * weights j and j + 16), and each group's scale and offset. Made only where every
 * group rebuilds w exactly; returns as gemv_forward_twin. */
int gemv_forward_twin_groups(const float *w, int n, int k, const uint8_t *q, const float *scale,
                             const float *offset) {
  if (n <= 0 || k <= 0 || k % GROUP != 0) return 0;
  size_t groups = (size_t)n * (k / GROUP);
  struct twin t;
  int made = new_twin(&t, w, n, k, 4);
  if (made == 1) {
    __builtin_memcpy(t.q, q, groups * GROUP / 2);
    __builtin_memcpy(t.scale, scale, groups * sizeof(float));
    __builtin_memcpy(t.offset, offset, groups * sizeof(float));
  }
  for (size_t g = 0; made == 1 && g < groups; g++)
    for (int half = 0; half < 2 && made == 1; half++) {
      lanes back = rebuild(t.q + g * GROUP / 2, 4, half, t.scale[g], t.offset[g]);
      for (int i = 0; i < LANES; i++)
        if (lane(back, i) != w[g * GROUP + half * LANES + i]) made = 0;
    }
  return keep_twin(t, made);
}

/* The 16-bit twin of w from its values as halves `h` (n x k); made only where every half
 * is w's value exactly. Returns as gemv_forward_twin. */
int gemv_forward_twin_halves(const float *w, int n, int k, const uint16_t *h) {
  if (n <= 0 || k <= 0 || k % GROUP != 0) return 0;
  size_t groups = (size_t)n * (k / GROUP);
  struct twin t;
  int made = new_twin(&t, w, n, k, 16);
  if (made == 1) {
    __builtin_memcpy(t.q, h, groups * GROUP * sizeof *h);
    /* Unread by the rebuild; set so that the twin is whole as every other kind is. */
    for (size_t g = 0; g < groups; g++) t.scale[g] = 1.0f, t.offset[g] = 0.0f;
  }
  for (size_t g = 0; made == 1 && g < groups; g++)
    for (int half = 0; half < 2 && made == 1; half++) {
      lanes back = rebuild(t.q + g * GROUP * 2, 16, half, 1.0f, 0.0f);
      for (int i = 0; i < LANES; i++)
        if (lane(back, i) != w[g * GROUP + half * LANES + i]) made = 0;
    }
  return keep_twin(t, made);
}

/* Forget the twin of `w` (a matrix about to be freed); 0 when it had none. */
int gemv_forward_untwin(const float *w) {
  int found = 0;
  pthread_mutex_lock(&twins_lock);
  for (int i = 0; i < atomic_load(&twin_count) && !found; i++)
    if (twins[i].w == w) {
      __atomic_store_n(&twins[i].w, NULL, __ATOMIC_RELEASE);
      free_twin(&twins[i]);
      found = 1;
    }
  pthread_mutex_unlock(&twins_lock);
  return found;
}

/* 0 leaves the twins unread (for side-by-side timing); returns the old setting. */
int gemv_forward_use_twins(int on) {
  int old = use_twins;
  use_twins = on;
  return old;
}

/* Matrices with a twin now, and products that read one so far (for tests, benches). */
int gemv_forward_live_twins(void) {
  int live = 0, count = atomic_load(&twin_count);
  for (int i = 0; i < count; i++) live += __atomic_load_n(&twins[i].w, __ATOMIC_ACQUIRE) != NULL;
  return live;
}

long gemv_forward_twin_products(void) { return atomic_load(&twin_products); }

static const struct twin *twin_of(const float *b, int n, int k, int ldb) {
  int count = use_twins ? atomic_load(&twin_count) : 0;
  for (int i = 0; i < count; i++)
    if (__atomic_load_n(&twins[i].w, __ATOMIC_ACQUIRE) == b)
      return twins[i].n == n && twins[i].k == k && ldb == k ? &twins[i] : NULL;
  return NULL;
}

/* As few_rows_range, over the twin: the same weights, the same order of sums. */
static inline __attribute__((always_inline)) void
twin_rows_range(const struct product *p, int rows, int n0, int n1) {
  const struct twin *t = p->twin;
  const int k = p->k, groups = k / GROUP, row_bytes = k * t->bits / 8;
  for (int n = n0; n < n1; n++) {
    const uint8_t *q = t->q + (size_t)n * row_bytes;
    const float *scale = t->scale + (size_t)n * groups, *offset = row_offsets(t, n);
    lanes acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = zero_lanes();
    for (int g = 0; g < groups; g++) {
      const uint8_t *gq = q + (size_t)g * GROUP * t->bits / 8;
      __builtin_prefetch(gq + 512, 0, 3);
      for (int half = 0; half < 2; half++) {
        lanes wv = rebuild(gq, t->bits, half, scale[g], offset[g]);
        const int i = g * GROUP + half * LANES;
        for (int r = 0; r < rows; r++)
          acc[r] = add_product(acc[r], wv, load_lanes(p->a + (size_t)r * p->lda + i));
      }
    }
    for (int r = 0; r < rows; r++) {
      float *out = p->c + (size_t)r * p->ldc + n;
      *out = scaled(p, sum_lanes(acc[r]), out);
    }
  }
}

/* --- integer products over the twins ----------------------------------------------
 *
 * Rebuilding 32 floats per group costs more than reading the group's bytes, so by
 * default a product over a twin runs in integers, as llama.cpp's do: each row of a is
 * rounded per group of 32 to 8-bit integers (`quantize_rows`, scale = largest |x| /
 * 127), and a group's 32 multiply-adds take one or two instructions. The result differs
 * from the fp32 product by that rounding of the activations (the weights are exact);
 * each output row still depends on its own row of a alone. `gemv_forward_exact_twins`
 * turns the float rebuild back on. */

static int exact_twins;

/* 1: products over twins rebuild the weights in floats, bit for bit the fp32 product;
 * 0: those over 4-bit twins run in integers, and over 8-bit ones too with 512-bit VNNI
 * (with 256 bits their integer products measured no faster than the rebuild). Returns
 * the old setting. */
int gemv_forward_exact_twins(int on) {
  int old = exact_twins;
  exact_twins = on;
  return old;
}

/* Per row r and group g of a: xq the 32 rounded values, xd their scale and xsum the
 * scale times their sum (what a group's offset multiplies). */
static void quantize_rows(const struct product *p, int8_t *xq, float *xd, float *xsum) {
  const int k = p->k, groups = k / GROUP;
  for (int r = 0; r < p->m; r++)
    for (int g = 0; g < groups; g++) {
      const float *x = p->a + (size_t)r * p->lda + (size_t)g * GROUP;
      int8_t *q = xq + (size_t)r * k + (size_t)g * GROUP;
      float top = 0.0f;
      for (int i = 0; i < GROUP; i++) top = fmaxf(top, fabsf(x[i]));
      const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
      int sum = 0;
      for (int i = 0; i < GROUP; i++) {
        q[i] = (int8_t)nearbyintf(x[i] * inverse);
        sum += q[i];
      }
      xd[(size_t)r * groups + g] = top / 127.0f;
      xsum[(size_t)r * groups + g] = top / 127.0f * (float)sum;
    }
}

#if defined(__AVX2__)
/* A group's 32 weights as bytes against 32 signed bytes of x: 8 partial int32 sums.
 * 4-bit q are unsigned (0..15); 8-bit q are signed, so they multiply as |q| times x with
 * q's sign, which keeps maddubs's 16-bit pair sums from saturating. */
static inline __attribute__((always_inline)) __m256i group_dot(const uint8_t *q, int bits,
                                                               __m256i x) {
  __m256i w;
  if (bits == 4) {
    __m128i b = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
  } else {
    w = _mm256_loadu_si256((const __m256i *)q);
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* The sum over groups of each group's offset times its share of a row's values. */
static inline float offsets_dot(const float *offset, const float *xsum, int groups) {
  float sum = 0.0f;
  int g = 0;
#if defined(__AVX2__)
  __m256 v = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8)
    v = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(xsum + g), v);
  sum = sum8(v);
#endif
  for (; g < groups; g++) sum += offset[g] * xsum[g];
  return sum;
}

/* One group's integer dot product, scaled by d, added to acc. */
#if defined(__AVX2__)
typedef __m256 group_acc;
static inline __attribute__((always_inline)) group_acc add_group(group_acc acc, const uint8_t *q,
                                                                 int bits, const int8_t *x,
                                                                 float d) {
  __m256i dot = group_dot(q, bits, _mm256_loadu_si256((const __m256i *)x));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc);
}
static inline float group_acc_sum(group_acc a, group_acc b) { return sum8(_mm256_add_ps(a, b)); }
#else
typedef float group_acc;
static inline group_acc add_group(group_acc acc, const uint8_t *q, int bits, const int8_t *x,
                                  float d) {
  int dot = 0;
  for (int i = 0; i < GROUP; i++)
    dot += (bits == 4 ? (q[i % 16] >> (i < 16 ? 0 : 4)) & 15 : (int8_t)q[i]) * x[i];
  return acc + d * (float)dot;
}
static inline float group_acc_sum(group_acc a, group_acc b) { return a + b; }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With 512-bit VNNI, two groups go through one instruction, and 8-bit twins run in
 * integers too (with 256 bits, their signed bytes cost as much as the rebuild). */
#define WIDE_INT 1

/* Two groups' 64 weights against 64 bytes of x: 16 partial int32 sums, the first 8 the
 * first group's. 4-bit q are unsigned; signed 8-bit q multiply x + 128 (unsigned), less
 * 128 times their own sums. */
static inline __attribute__((always_inline)) __m512i pair_dot(const uint8_t *q, int bits,
                                                              __m512i x) {
  const __m512i zero = _mm512_setzero_si512();
  if (bits == 4) {
    __m256i b = _mm256_loadu_si256((const __m256i *)q), low = _mm256_set1_epi8(15);
    __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low)),
                                   _mm256_and_si256(_mm256_srli_epi16(b, 4), low), 1);
    /* low nibbles of both groups, then high: to group 1's 32 weights, then group 2's */
    w = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm512_dpbusd_epi32(zero, w, x);
  }
  __m512i w = _mm512_loadu_si512((const void *)q);
  __m512i own = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, _mm512_set1_epi8(1), w), 7);
  __m512i shifted = _mm512_xor_si512(x, _mm512_set1_epi8((char)0x80));
  return _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, shifted, w), own);
}

/* Two groups' dot products, scaled by d0 and d1, added to acc. */
typedef __m512 pair_acc;
static inline __attribute__((always_inline)) pair_acc add_pair(pair_acc acc, const uint8_t *q,
                                                               int bits, const int8_t *x,
                                                               float d0, float d1) {
  __m512i dot = pair_dot(q, bits, _mm512_loadu_si512((const void *)x));
  __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc);
}
static inline float pair_sum(pair_acc a) { return _mm512_reduce_add_ps(a); }
#else
#define WIDE_INT 0

/* Two groups, each into its own accumulator, so that two chains of additions run at
 * once. */
typedef struct {
  group_acc even, odd;
} pair_acc;
static inline __attribute__((always_inline)) pair_acc add_pair(pair_acc acc, const uint8_t *q,
                                                               int bits, const int8_t *x,
                                                               float d0, float d1) {
  acc.even = add_group(acc.even, q, bits, x, d0);
  acc.odd = add_group(acc.odd, q + GROUP * bits / 8, bits, x + GROUP, d1);
  return acc;
}
static inline float pair_sum(pair_acc a) { return group_acc_sum(a.even, a.odd); }
#endif

/* As twin_rows_range, in integers over p's rounded rows, two groups at a time. */
static inline __attribute__((always_inline)) void
int_rows_range(const struct product *p, int rows, int n0, int n1) {
  const struct twin *t = p->twin;
  const int k = p->k, groups = k / GROUP, row_bytes = k * t->bits / 8;
  const int group_bytes = GROUP * t->bits / 8;
  const group_acc none = {0};
  for (int n = n0; n < n1; n++) {
    const uint8_t *q = t->q + (size_t)n * row_bytes;
    const float *scale = t->scale + (size_t)n * groups, *offset = row_offsets(t, n);
    pair_acc acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = (pair_acc){0};
    int g = 0;
    for (; g + 2 <= groups; g += 2) {
      const uint8_t *gq = q + (size_t)g * group_bytes;
      __builtin_prefetch(gq + 512, 0, 3);
      for (int r = 0; r < rows; r++) {
        const float *xd = p->xd + (size_t)r * groups + g;
        acc[r] = add_pair(acc[r], gq, t->bits, p->xq + (size_t)r * k + (size_t)g * GROUP,
                          scale[g] * xd[0], scale[g + 1] * xd[1]);
      }
    }
    for (int r = 0; r < rows; r++) {
      float sum = pair_sum(acc[r]);
      if (g < groups) /* an odd group out */
        sum += group_acc_sum(add_group(none, q + (size_t)g * group_bytes, t->bits,
                                       p->xq + (size_t)r * k + (size_t)g * GROUP,
                                       scale[g] * p->xd[(size_t)r * groups + g]),
                             none);
      if (t->offset != NULL) sum += offsets_dot(offset, p->xsum + (size_t)r * groups, groups);
      float *out = p->c + (size_t)r * p->ldc + n;
      *out = scaled(p, sum, out);
    }
  }
}

/* Weight rows [n0, n1) against `rows` rows of a, from the twin if b has one. */
static inline __attribute__((always_inline)) void
rows_range(const struct product *p, int rows, int n0, int n1) {
  if (p->xq != NULL)
    int_rows_range(p, rows, n0, n1);
  else if (p->twin != NULL)
    twin_rows_range(p, rows, n0, n1);
  else
    few_rows_range(p, rows, n0, n1);
}

static void few_rows(const struct product *p, int n0, int n1) {
  switch (p->m) {
  case 1: rows_range(p, 1, n0, n1); break;
  case 2: rows_range(p, 2, n0, n1); break;
  case 3: rows_range(p, 3, n0, n1); break;
  case 4: rows_range(p, 4, n0, n1); break;
  case 5: rows_range(p, 5, n0, n1); break;
  case 6: rows_range(p, 6, n0, n1); break;
  case 7: rows_range(p, 7, n0, n1); break;
  default: rows_range(p, 8, n0, n1); break;
  }
}

/* --- plain b: rows of b scaled and summed, LANES columns at a time ----------------- */

static inline __attribute__((always_inline)) void few_rows_plain_rows(const struct product *p,
                                                                      int rows) {
  const int n = p->n, whole = n - n % LANES;
  for (int j = 0; j < whole; j += LANES) {
    lanes acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = zero_lanes();
    for (int i = 0; i < p->k; i++) {
      lanes bv = load_lanes(p->b + (size_t)i * p->ldb + j);
      for (int r = 0; r < rows; r++) acc[r] = add_scaled(acc[r], p->a[(size_t)r * p->lda + i], bv);
    }
    for (int r = 0; r < rows; r++)
      for (int q = 0; q < LANES; q++) {
        float *out = p->c + (size_t)r * p->ldc + j + q;
        *out = scaled(p, lane(acc[r], q), out);
      }
  }
  for (int j = whole; j < n; j++)
    for (int r = 0; r < rows; r++) {
      float s = 0.0f;
      for (int i = 0; i < p->k; i++)
        s += p->a[(size_t)r * p->lda + i] * p->b[(size_t)i * p->ldb + j];
      float *out = p->c + (size_t)r * p->ldc + j;
      *out = scaled(p, s, out);
    }
}

static void few_rows_plain(const struct product *p) {
  switch (p->m) {
  case 1: few_rows_plain_rows(p, 1); break;
  case 2: few_rows_plain_rows(p, 2); break;
  case 3: few_rows_plain_rows(p, 3); break;
  case 4: few_rows_plain_rows(p, 4); break;
  case 5: few_rows_plain_rows(p, 5); break;
  case 6: few_rows_plain_rows(p, 6); break;
  case 7: few_rows_plain_rows(p, 7); break;
  default: few_rows_plain_rows(p, 8); break;
  }
}

/* --- a small thread pool: the parts of a job go to whichever thread is free -------- *
 * A job is cut into PARTS_PER_THREAD parts per thread, taken one at a time by the caller
 * and the helpers. Where another thread (the gateway's small lanes run at a higher
 * priority, or another process) holds a helper's core, the caller takes the helper's
 * parts itself and waits only for a part already begun: a static half each made every
 * product wait for the slowest core, and a decode step under one busy core took three
 * times as long as alone. */
enum { PARTS_PER_THREAD = 4 };

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t finished = PTHREAD_COND_INITIALIZER; /* the job's last part is done */
static int pool_threads; /* 0: not started (again, after a fork) */
/* The work the pool's threads share: run(context, part, parts) for each part. */
typedef void (*slice_fn)(const void *context, int part, int parts);
static _Atomic(slice_fn) job;
static _Atomic(const void *) job_context;
/* The job's serial (32 bits), its number of parts (16) and the next part to take (16)
 * in one word: a thread takes a part by moving the word on, so a helper that woke late
 * can take no part of a job that ended, nor of one not yet published. */
static _Atomic uint64_t ticket;
static atomic_int parts_done;
static atomic_uint generation;
static unsigned born_at;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void product_slice(const void *context, int part, int parts) {
  const struct product *p = context;
  few_rows(p, (int)((long)p->n * part / parts), (int)((long)p->n * (part + 1) / parts));
}

/* Take and run parts of the current job until none is left. */
static void take_parts(void) {
  uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
  for (;;) {
    int parts = (int)(t >> 16 & 0xffff), part = (int)(t & 0xffff);
    if (part >= parts) return;
    if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue; /* t now holds the word's new value */
    /* The part is ours, so its job cannot end (and be replaced) before we are done. */
    slice_fn run = atomic_load_explicit(&job, memory_order_relaxed);
    run(atomic_load_explicit(&job_context, memory_order_relaxed), part, parts);
    if (atomic_fetch_add_explicit(&parts_done, 1, memory_order_acq_rel) + 1 == parts) {
      pthread_mutex_lock(&wake_lock);
      pthread_cond_signal(&finished);
      pthread_mutex_unlock(&wake_lock);
    }
    t = atomic_load_explicit(&ticket, memory_order_acquire);
  }
}

static void wait_for_job(unsigned seen) {
  long start = now_ns();
  while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
    if (now_ns() - start < SPIN_NS) continue;
    pthread_mutex_lock(&wake_lock);
    while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &wake_lock);
    pthread_mutex_unlock(&wake_lock);
  }
}

static void *helper_main(void *arg) {
  (void)arg;
  for (unsigned seen = born_at;;) { /* the product that started the pool is next */
    wait_for_job(seen);
    seen = atomic_load_explicit(&generation, memory_order_acquire);
    take_parts();
  }
  return NULL;
}

/* A forked child has none of the helpers, and a lock a helper held stays held. */
static void forget_pool(void) {
  pool_threads = 0;
  pthread_mutex_init(&pool_busy, NULL);
  pthread_mutex_init(&wake_lock, NULL);
  pthread_cond_init(&wake, NULL);
  pthread_cond_init(&finished, NULL);
}

/* The cores this process may run on (a container's cpuset, taskset), not the machine's. */
static long usable_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return sysconf(_SC_NPROCESSORS_ONLN);
}

static int start_pool(void) {
  long cores = usable_cores();
  int want = cores < 1 ? 1 : cores > MAX_THREADS ? MAX_THREADS : (int)cores;
  static int at_fork_set;
  if (!at_fork_set) at_fork_set = pthread_atfork(NULL, NULL, forget_pool) == 0;
  born_at = atomic_load(&generation);
  int started = 1;
  for (; started < want; started++) {
    pthread_t t;
    if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
    pthread_detach(t);
  }
  return started;
}

/* run(context, part, parts) for every part, over the pool's threads and the caller's;
 * all of it here (one part) while another caller holds the pool. */
static void split(slice_fn run, const void *context) {
  if (pthread_mutex_trylock(&pool_busy) != 0) {
    run(context, 0, 1);
    return;
  }
  if (pool_threads == 0) pool_threads = start_pool();
  int parts = pool_threads * PARTS_PER_THREAD;
  atomic_store_explicit(&job, run, memory_order_relaxed);
  atomic_store_explicit(&job_context, context, memory_order_relaxed);
  atomic_store_explicit(&parts_done, 0, memory_order_relaxed);
  uint64_t serial = (atomic_load_explicit(&ticket, memory_order_relaxed) >> 32) + 1;
  atomic_store_explicit(&ticket, serial << 32 | (uint64_t)parts << 16, memory_order_release);
  pthread_mutex_lock(&wake_lock);
  atomic_fetch_add_explicit(&generation, 1, memory_order_release);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&wake_lock);
  take_parts();
  /* A helper may still be on its last part, behind a thread of higher priority: after
   * a short spin, sleep until it is done rather than hold a core that thread wants. */
  long start = now_ns();
  while (atomic_load_explicit(&parts_done, memory_order_acquire) < parts &&
         now_ns() - start < SPIN_NS)
    ;
  pthread_mutex_lock(&wake_lock);
  while (atomic_load_explicit(&parts_done, memory_order_acquire) < parts)
    pthread_cond_wait(&finished, &wake_lock);
  pthread_mutex_unlock(&wake_lock);
  pthread_mutex_unlock(&pool_busy);
}

static void few_rows_split(const struct product *p) {
  if ((long)p->n * p->k < MIN_SPLIT_WEIGHTS)
    few_rows(p, 0, p->n); /* small: all of it here */
  else
    split(product_slice, p);
}

/* The pool for other native code in the process (`llama_step.c`'s attention), so that
 * its threads, awake between products, are the ones that share it. */
void gemv_forward_split(slice_fn run, const void *context) { split(run, context); }

/* --- the entry point MLX calls ---------------------------------------------------- */

/* op(a) as rows of k floats: a itself, or a transposed copy (freed by the caller). */
static const float *rows_of(int ta, int m, int k, const float *a, int *lda, float **copy) {
  *copy = NULL;
  if (ta == NO_TRANS) return a;
  float *out = malloc((size_t)m * k * sizeof(float));
  if (out == NULL) return NULL;
  for (int r = 0; r < m; r++)
    for (int i = 0; i < k; i++) out[(size_t)r * k + i] = a[(size_t)i * *lda + r];
  *lda = k;
  return *copy = out;
}

static int few_rows_product(int ta, int tb, int m, int n, int k, float alpha, const float *a,
                            int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  float *copy;
  const float *rows = rows_of(ta, m, k, a, &lda, &copy);
  if (rows == NULL) return 0;
  struct product p = {m, n, k, lda, ldb, ldc, alpha, beta, rows, b, c, NULL, NULL, NULL, NULL};
  void *quantized = NULL;
  if (tb == TRANS) {
    p.twin = twin_of(b, n, k, ldb);
    if (p.twin != NULL) atomic_fetch_add_explicit(&twin_products, 1, memory_order_relaxed);
    int in_integers = p.twin != NULL && (p.twin->bits == 4 || (p.twin->bits == 8 && WIDE_INT));
    if (in_integers && !exact_twins) {
      size_t groups = (size_t)m * (k / GROUP);
      quantized = malloc(groups * 2 * sizeof(float) + (size_t)m * k);
      if (quantized != NULL) {
        float *xd = quantized;
        int8_t *xq = (int8_t *)(xd + 2 * groups);
        quantize_rows(&p, xq, xd, xd + groups);
        p.xq = xq, p.xd = xd, p.xsum = xd + groups;
      }
    }
    few_rows_split(&p);
  } else {
    few_rows_plain(&p);
  }
  free(quantized);
  free(copy);
  return 1;
}

/* As in `scaled`: with beta 0 the BLAS does not read y, so clear it first. */
static void clear(float *y, int n, int inc) {
  for (int i = 0; i < n; i++) y[(size_t)i * inc] = 0.0f;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (real_sgemm == NULL) {
    /* Only a library that bound is made global (engine/gemv_forward.py): reaching here
     * unbound is a loading bug, and there is no product to forward to. */
    fputs("gemv_forward: cblas_sgemm called before binding to a BLAS\n", stderr);
    abort();
  }
  int usable = enabled && real_sgemv != NULL && order == ROW_MAJOR && k > 0;
  int few = usable && m >= 1 && m <= MAX_ROWS &&
            (tb == TRANS || (long)n * k < MIN_SPLIT_WEIGHTS);
  if (few && few_rows_product(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  if (usable && m > MAX_ROWS && m <= MAX_BLOCKED_ROWS && ta == NO_TRANS && tb == TRANS &&
      twin_of(b, n, k, ldb) != NULL) {
    /* Each row is summed as it is alone (see the top of the file), whatever its block. */
    for (int r = 0; r < m; r += MAX_ROWS) {
      int rows = m - r < MAX_ROWS ? m - r : MAX_ROWS;
      few_rows_product(ta, tb, rows, n, k, alpha, a + (size_t)r * lda, lda, b, ldb, beta,
                       c + (size_t)r * ldc, ldc);
    }
    return;
  }
  if (usable && m == 1 && n > 1) {
    /* c (1 x n) = alpha * op(a) (1 x k) . b (k x n) + beta * c */
    int incx = ta == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) clear(c, n, 1);
    real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    return;
  }
  if (usable && n == 1 && m > 1) {
    /* c (m x 1) = alpha * op(a) (m x k) . op(b) (k x 1) + beta * c */
    int incx = tb == NO_TRANS ? ldb : 1;
    if (beta == 0.0f) clear(c, m, ldc);
    if (ta == NO_TRANS) /* a is m x k */
      real_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
    else /* a is k x m */
      real_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
    return;
  }
  real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
