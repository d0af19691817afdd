/* Kernels for the CPU, time-major (rows of channels): direct 1-D convolutions for the
 * VITS voice, the layer norm, GELU and softmax of its text encoder and Whisper's audio
 * encoder, and the quantising steps of Smart Turn's int8 encoder.
 *
 * Through MLX a conv of a few dozen channels is one small GEMM per tap, each reading
 * and writing the whole output again, plus a pass each for the activation before it,
 * the zero padding and the residual: at 32 channels the passes cost more than the
 * multiplications. Here one call does all of it: the input is padded and put through
 * its leaky ReLU once into a scratch copy, and each block of output rows keeps its
 * sums in registers over every tap and input channel, starting from the bias and the
 * residual. Every output value is summed in the same order (taps, then input
 * channels) whatever the rows around it, so results do not depend on how the rows are
 * split over threads or on the other items of a batch. A quantised model's codes (Smart
 * Turn's) are multiplied as 16-bit integers where the CPU has AVX2, two input channels
 * an instruction, in exact 32-bit sums.
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { ROWS = 6, CHUNK = 16 * ROWS, MAX_THREADS = 8 };
/* Calls with fewer multiply-adds than this run on the calling thread alone. */
static const long MIN_SPLIT_MACS = 1L << 22;

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v8u __attribute__((vector_size(8 * sizeof(float)), aligned(4)));
typedef int v8i __attribute__((vector_size(8 * sizeof(int))));

static inline v8 load(const float *p) { return *(const v8u *)p; }
static inline void store(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 splat(float s) { return (v8){s, s, s, s, s, s, s, s}; }

struct conv {
  const float *xs; /* padded input after the activation: (t_out + (taps-1)*dilation) x ci */
  const float *w;  /* per 16 output channels (8 for the last if co % 16 is 8): taps x ci x 16 */
  /* Or, for integer operands: the padded input as int16 (xs's layout) and the weights
   * as int16 in pairs of input channels, per 16 output channels: taps x ci/2 x 16 x 2. */
  const int16_t *xi, *wi;
  const float *bias, *residual; /* co, t_out x co; either may be NULL */
  float *out;                   /* t_out x co */
  long t_out;
  long chunk; /* rows a thread takes at a time */
  int ci, co, taps, dilation;
  /* Or another pass over rows instead of the conv: run(p, from, to), its own arguments
   * in `args` (`split_rows`). */
  void (*run)(const struct conv *p, long from, long to);
  const void *args;
};

/* `rows` output rows from row t, output channels j .. j + 8*width. */
static inline __attribute__((always_inline)) void block(const struct conv *p, long t, int j,
                                                        int rows, int width) {
  v8 acc[ROWS][2];
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < width; h++) {
      v8 a = p->bias != NULL ? load(p->bias + j + 8 * h) : splat(0.0f);
      if (p->residual != NULL) a += load(p->residual + (t + r) * p->co + j + 8 * h);
      acc[r][h] = a;
    }
  /* This block's weights lie in one run, read in order. */
  const float *w = p->w + (long)j * p->taps * p->ci;
  for (int k = 0; k < p->taps; k++) {
    const float *x = p->xs + (t + (long)k * p->dilation) * p->ci;
    for (int c = 0; c < p->ci; c++, w += 8 * width) {
      v8 b0 = load(w), b1 = width > 1 ? load(w + 8) : b0;
      for (int r = 0; r < rows; r++) {
        v8 a = splat(x[(long)r * p->ci + c]);
        acc[r][0] += a * b0;
        if (width > 1) acc[r][1] += a * b1;
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < width; h++) store(p->out + (t + r) * p->co + j + 8 * h, acc[r][h]);
}

/* `block` over integer operands: each multiply-add instruction takes two input
 * channels at once, in 32-bit sums that are exact (float32 sums of integers are exact
 * only below 2^24), twice the products per instruction of the float path. */
#if defined(__AVX2__)
enum { INTEGER_PRODUCTS = 1 };
static inline __attribute__((always_inline)) void int_block(const struct conv *p, long t, int j,
                                                            int rows, int width) {
  __m256i acc[ROWS][2];
  for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int16_t *w = p->wi + (long)j * p->taps * p->ci;
  int pairs = p->ci / 2;
  for (int k = 0; k < p->taps; k++) {
    const int16_t *x = p->xi + (t + (long)k * p->dilation) * p->ci;
    for (int c = 0; c < pairs; c++, w += 16 * width) {
      __m256i b0 = _mm256_loadu_si256((const __m256i *)w);
      __m256i b1 = width > 1 ? _mm256_loadu_si256((const __m256i *)(w + 16)) : b0;
      for (int r = 0; r < rows; r++) {
        int32_t pair;
        memcpy(&pair, x + (long)r * p->ci + 2 * c, sizeof pair);
        __m256i a = _mm256_set1_epi32(pair);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(a, b0));
        if (width > 1) acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(a, b1));
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < width; h++) {
      v8 v = (v8)_mm256_cvtepi32_ps(acc[r][h]);
      if (p->bias != NULL) v += load(p->bias + j + 8 * h);
      if (p->residual != NULL) v += load(p->residual + (t + r) * p->co + j + 8 * h);
      store(p->out + (t + r) * p->co + j + 8 * h, v);
    }
}
#else
enum { INTEGER_PRODUCTS = 0 };
static inline void int_block(const struct conv *p, long t, int j, int rows, int width) {
  (void)p, (void)t, (void)j, (void)rows, (void)width; /* never called: see native_int_conv */
}
#endif

/* `kernel` (block or int_block) over `rows` rows, each count its own unrolled copy. */
#define BLOCK_CASES(kernel, width)                                                           \
  switch (rows) {                                                                          \
  case 1: kernel(p, t, j, 1, width); break;                                                \
  case 2: kernel(p, t, j, 2, width); break;                                                \
  case 3: kernel(p, t, j, 3, width); break;                                                \
  case 4: kernel(p, t, j, 4, width); break;                                                \
  case 5: kernel(p, t, j, 5, width); break;                                                \
  default: kernel(p, t, j, 6, width); break;                                               \
  }

/* Rows in chunks of CHUNK, each chunk's input read from cache for every block of
 * output channels: swept over all the rows at once, a wide conv (an upsampling layer's
 * 512 channels) read its whole input from memory again for every 16 of them. */
static void conv_rows(const struct conv *p, long from, long to) {
  for (long chunk = from; chunk < to; chunk += p->chunk) {
    long end = chunk + p->chunk < to ? chunk + p->chunk : to;
    for (int j = 0; j < p->co; j += 16) {
      int wide = p->co - j >= 16;
      for (long t = chunk; t < end; t += ROWS) {
        int rows = end - t < ROWS ? (int)(end - t) : ROWS;
        if (p->wi != NULL && wide) {
          BLOCK_CASES(int_block, 2)
        } else if (p->wi != NULL) {
          BLOCK_CASES(int_block, 1)
        } else if (wide) {
          BLOCK_CASES(block, 2)
        } else {
          BLOCK_CASES(block, 1)
        }
      }
    }
  }
}

/* --- helpers that stay awake between the calls of a render ---------------------------
 * A vocoder pass makes hundreds of calls of a millisecond or less, a few tens of
 * microseconds apart. A thread started per call, or woken from sleep, reaches its core
 * late on a virtual machine, and the calls then ran no faster on two cores than on one:
 * the helpers spin for 50 us after each call before they sleep. They inherit the
 * priority of the thread that starts them (the gateway runs the engine's threads below
 * its event loop: gateway/server/priority.py), and the rows are taken a chunk at a
 * time by whichever thread is free: where a thread of higher priority takes a helper's
 * core, the caller takes the helper's rows itself and waits only for a chunk already
 * begun. One call at a time uses them; a call that finds them busy runs on its own
 * thread. */

static const long SPIN_NS = 50 * 1000;

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t finished = PTHREAD_COND_INITIALIZER; /* the job's last chunk is done */
static int pool_threads; /* 0: not started (again, after a fork) */
static _Atomic(const struct conv *) job;
/* The job's serial (32 bits), its number of chunks (16) and the next chunk to take (16)
 * in one word: a thread takes a chunk by moving the word on, so a helper that woke late
 * takes no chunk of a job that ended, and the caller never waits for one that has not
 * woken: it takes that helper's chunks itself. */
static _Atomic uint64_t ticket;
static atomic_long chunks_done;
static atomic_uint generation;
static unsigned born_at; /* the generation before the helpers' first call */

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_rows(const struct conv *p, long from, long to) {
  if (p->run != NULL)
    p->run(p, from, to);
  else
    conv_rows(p, from, to);
}

/* Chunks of rows until none is left; each row comes out the same whoever takes it. */
static void take_rows(void) {
  uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
  for (;;) {
    long chunks = (long)(t >> 16 & 0xffff), chunk = (long)(t & 0xffff);
    if (chunk >= chunks) return;
    if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                               memory_order_acquire))
      continue; /* t now holds the word's new value */
    /* The chunk is ours, so its job cannot end (and be replaced) before we are done. */
    const struct conv *p = atomic_load_explicit(&job, memory_order_relaxed);
    long from = chunk * p->chunk;
    run_rows(p, from, from + p->chunk < p->t_out ? from + p->chunk : p->t_out);
    if (atomic_fetch_add_explicit(&chunks_done, 1, memory_order_acq_rel) + 1 == chunks) {
      pthread_mutex_lock(&wake_lock);
      pthread_cond_signal(&finished);
      pthread_mutex_unlock(&wake_lock);
    }
    t = atomic_load_explicit(&ticket, memory_order_acquire);
  }
}

static void *helper_main(void *arg) {
  (void)arg;
  unsigned seen = born_at;
  for (;;) {
    long start = now_ns();
    while (atomic_load_explicit(&generation, memory_order_acquire) == seen &&
           now_ns() - start < SPIN_NS)
      ;
    pthread_mutex_lock(&wake_lock);
    while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &wake_lock);
    pthread_mutex_unlock(&wake_lock);
    seen = atomic_load(&generation);
    take_rows();
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

static int usable_cores(void) {
  cpu_set_t set;
  long n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                       : sysconf(_SC_NPROCESSORS_ONLN);
  return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
}

static int start_pool(void) {
  static int at_fork_set;
  if (!at_fork_set) at_fork_set = pthread_atfork(NULL, NULL, forget_pool) == 0;
  born_at = atomic_load(&generation);
  int started = 1, want = usable_cores();
  for (; started < want; started++) {
    pthread_t t;
    if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
    pthread_detach(t);
  }
  return started;
}

/* Chunks of CHUNK rows where there are enough for every thread (the vocoder's tiles);
 * fewer rows (a sentence's text encoder, a few dozen rows of 768 channels) are cut
 * evenly, so that every thread has some. */
static long chunk_rows(long t_out, int threads) {
  long even = (t_out + threads - 1) / threads;
  even = (even + ROWS - 1) / ROWS * ROWS;
  return even < CHUNK ? even : CHUNK;
}

static void conv_split(struct conv *p) {
  long macs = p->t_out * p->ci * p->co * p->taps;
  if (macs < MIN_SPLIT_MACS || pthread_mutex_trylock(&pool_busy) != 0) {
    run_rows(p, 0, p->t_out);
    return;
  }
  if (pool_threads == 0) pool_threads = start_pool();
  p->chunk = chunk_rows(p->t_out, pool_threads);
  while ((p->t_out + p->chunk - 1) / p->chunk > 0xffff) p->chunk *= 2; /* the ticket's 16 bits */
  long chunks = (p->t_out + p->chunk - 1) / p->chunk;
  atomic_store_explicit(&job, p, memory_order_relaxed);
  atomic_store_explicit(&chunks_done, 0, memory_order_relaxed);
  uint64_t serial = (atomic_load_explicit(&ticket, memory_order_relaxed) >> 32) + 1;
  atomic_store_explicit(&ticket, serial << 32 | (uint64_t)chunks << 16, memory_order_release);
  pthread_mutex_lock(&wake_lock);
  atomic_fetch_add_explicit(&generation, 1, memory_order_release);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&wake_lock);
  take_rows();
  /* A helper may still be on its last chunk, behind threads of higher priority: after
   * a short spin, sleep until it is done rather than hold a core they want. */
  long start = now_ns();
  while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks &&
         now_ns() - start < SPIN_NS)
    ;
  pthread_mutex_lock(&wake_lock);
  while (atomic_load_explicit(&chunks_done, memory_order_acquire) < chunks)
    pthread_cond_wait(&finished, &wake_lock);
  pthread_mutex_unlock(&wake_lock);
  pthread_mutex_unlock(&pool_busy);
}

/* Rows [0, rows) of another pass, `run` with `args`, over the helpers where the pass
 * makes about MIN_SPLIT_MACS multiply-adds' worth of work (`per_row` a row). */
static void split_rows(long rows, long per_row, void (*run)(const struct conv *, long, long),
                       const void *args) {
  struct conv p = {0};
  p.t_out = rows, p.co = 1, p.taps = 1, p.run = run, p.args = args;
  p.ci = per_row < (1L << 30) ? (int)per_row : 1 << 30; /* the work a row, for conv_split */
  conv_split(&p);
}

/* The calling thread's scratch of at least `n` floats, kept between calls: a fresh
 * megabyte from malloc comes back from the kernel page by page, and faulting it in
 * cost as much as the convolution it held. Freed when the thread ends. */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static __thread float *scratch_at;
static __thread size_t scratch_floats;

static void make_scratch_key(void) { pthread_key_create(&scratch_key, free); }

static float *scratch(size_t n) {
  if (n <= scratch_floats) return scratch_at;
  pthread_once(&scratch_once, make_scratch_key);
  float *grown = malloc(n * sizeof(float));
  if (grown == NULL) return NULL;
  free(scratch_at);
  scratch_at = grown, scratch_floats = n;
  pthread_setspecific(scratch_key, grown);
  return grown;
}

/* out (t_out x co) = bias + residual + conv(act(x)), where act is a leaky ReLU of
 * `slope` in [0, 1] (1: none), x (t_in rows of ci, `ldx` floats apart) is read with
 * `pad_left` zero rows before it (and as many after as the taps need), and w holds the
 * weights in blocks of 16 output channels (see struct conv). co must be a multiple of
 * 8. Returns 0, or -1 when it cannot (co, or no memory). */
int native_conv(const float *x, long t_in, long ldx, int ci, long pad_left, long t_out, int taps,
                int dilation, const float *w, int co, const float *bias, const float *residual,
                float slope, float *out) {
  if (co % 8 != 0 || ci < 1 || ldx < ci || taps < 1 || dilation < 1 || t_out < 1 || pad_left < 0 ||
      !(slope >= 0.0f && slope <= 1.0f))
    return -1;
  long rows = t_out + (long)(taps - 1) * dilation;
  float *xs = scratch((size_t)rows * ci);
  if (xs == NULL) return -1;
  for (long i = 0; i < rows; i++) {
    long src = i - pad_left;
    float *row = xs + i * ci;
    if (src < 0 || src >= t_in) {
      memset(row, 0, (size_t)ci * sizeof(float));
      continue;
    }
    const float *restrict in = x + src * ldx;
    float *restrict to = row;
    /* Branch-free, so the compiler vectorizes it: with 0 <= slope <= 1 the larger of
     * v and slope * v is the leaky ReLU of v (a branch on the sign mispredicts half the
     * time on audio, and cost as much as the products at 32 channels). */
    for (int c = 0; c < ci; c++) {
      float v = in[c], scaled = v * slope;
      to[c] = v > scaled ? v : scaled; /* maxps; fmaxf would be a call per value */
    }
  }
  struct conv p = {xs, w, NULL, NULL, bias, residual, out, t_out, CHUNK, ci, co, taps, dilation};
  conv_split(&p);
  return 0;
}

/* Whether native_int_conv runs here (AVX2's 16-bit multiply-adds). */
int native_integer_products(void) { return INTEGER_PRODUCTS; }

/* native_conv over operands that are integers of at most 16 bits (a quantised model's
 * codes, given as floats), without activation: the same sums, exact, from `wi` (the
 * int16 pairs of struct conv) and the input rounded to int16 once. ci must be even.
 * Returns 0, or -1 when it cannot (no AVX2, co, ci, or no memory). */
int native_int_conv(const float *x, long t_in, long ldx, int ci, long pad_left, long t_out,
                    int taps, int dilation, const int16_t *wi, int co, const float *bias,
                    const float *residual, float *out) {
  if (!INTEGER_PRODUCTS || co % 8 != 0 || ci < 2 || ci % 2 || ldx < ci || taps < 1 ||
      dilation < 1 || t_out < 1 || pad_left < 0)
    return -1;
  long rows = t_out + (long)(taps - 1) * dilation;
  int16_t *xs = (int16_t *)scratch(((size_t)rows * ci + 1) / 2);
  if (xs == NULL) return -1;
  for (long i = 0; i < rows; i++) {
    long src = i - pad_left;
    int16_t *restrict row = xs + i * ci;
    if (src < 0 || src >= t_in) {
      memset(row, 0, (size_t)ci * sizeof(int16_t));
      continue;
    }
    const float *restrict in = x + src * ldx;
    for (int c = 0; c < ci; c++) row[c] = (int16_t)in[c];
  }
  struct conv p = {NULL, NULL, xs, wi, bias, residual, out, t_out, CHUNK, ci, co, taps, dilation};
  conv_split(&p);
  return 0;
}

/* --- e^x, and WaveNet's gate -------------------------------------------------------- */

/* Selects of floats (the clamp below) vectorize only when the compiler may ignore the
 * floating-point exception flags, which nothing here reads. */
#pragma GCC optimize("no-trapping-math")

/* e^x for x <= 0 within 2 ulp-ish: 2^n times a polynomial of the rest. Written for one
 * value, so the compiler vectorizes the loop that calls it (MLX's CPU runs
 * transcendentals one value at a time). */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  /* Rounded to the nearest integer by adding and taking away 1.5 * 2^23 (|x| < 2^22). */
  float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int bits = ((int)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* tanh(v) from e^-2|v|, which cannot overflow. */
static inline float tanh_of(float v) {
  float e = exp_nonpositive(-2.0f * __builtin_fabsf(v));
  return __builtin_copysignf((1.0f - e) / (1.0f + e), v);
}

/* out (rows x h) = tanh(a[:, :h]) * sigmoid(a[:, h:]), a (rows x 2h); sigmoid(v) is
 * (1 + tanh(v / 2)) / 2, within 1e-7 of it. */
void native_gate(const float *a, long rows, int h, float *out) {
  for (long t = 0; t < rows; t++) {
    const float *restrict left = a + t * 2 * h, *restrict right = left + h;
    float *restrict to = out + t * h;
    for (int c = 0; c < h; c++) to[c] = tanh_of(left[c]) * (0.5f + 0.5f * tanh_of(0.5f * right[c]));
  }
}

/* --- layer norm, and the GELU after it ---------------------------------------------- */

/* x Phi(x), with erf from Abramowitz and Stegun 7.1.26 (within 1.5e-7). */
static inline float gelu_of(float x) {
  float a = __builtin_fabsf(x) * 0.70710678f;
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float p = t * (0.254829592f +
                 t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  float erf_abs = 1.0f - p * exp_nonpositive(-a * a);
  return 0.5f * x * (1.0f + __builtin_copysignf(erf_abs, x));
}

/* out (n) = the GELU of x (n); out may be x. */
void native_gelu(const float *x, long n, float *out) {
  for (long i = 0; i < n; i++) out[i] = gelu_of(x[i]);
}

/* The sum of v[0..c) (and of its squared distances from `mean`), in eight lanes: one
 * running sum would make every addition wait for the one before it. */
static inline float lane_sum(const float *v, int c, float mean, int squares) {
  v8 acc = splat(0.0f), m = splat(mean);
  int i = 0;
  for (; i + 8 <= c; i += 8) {
    v8 d = load(v + i) - m;
    acc += squares ? d * d : d;
  }
  float total = 0.0f;
  for (int k = 0; k < 8; k++) total += acc[k];
  for (; i < c; i++) total += squares ? (v[i] - mean) * (v[i] - mean) : v[i] - mean;
  return total;
}

/* Each of the rows (n values each) of x replaced by its softmax, in place. */
void native_softmax(float *x, long rows, long n) {
  for (long t = 0; t < rows; t++) {
    float *restrict r = x + t * n;
    v8 top8 = splat(r[0]);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
      v8 v = load(r + i);
      v8i higher = v > top8; /* all ones where v is: C has no ?: on vectors */
      top8 = (v8)(((v8i)v & higher) | ((v8i)top8 & ~higher));
    }
    float top = r[0];
    for (int k = 0; k < 8; k++) top = top8[k] > top ? top8[k] : top;
    for (; i < n; i++) top = r[i] > top ? r[i] : top;
    for (i = 0; i < n; i++) r[i] = exp_nonpositive(r[i] - top);
    float inv = 1.0f / (lane_sum(r, (int)n, 0.0f, 0));
    for (i = 0; i < n; i++) r[i] *= inv;
  }
}

/* out (rows x c) = LN(x + residual) * gamma + beta over each row's c channels, then
 * the GELU where `gelu`; residual may be NULL, out may be x or residual. One pass per
 * row in place of the five or six array operations it takes in NumPy or MLX. */
void native_layer_norm(const float *x, const float *residual, long rows, int c,
                       const float *gamma, const float *beta, float eps, int gelu, float *out) {
  for (long t = 0; t < rows; t++) {
    /* Not restrict: out may be x or residual. */
    const float *xr = x + t * c, *rr = residual ? residual + t * c : NULL;
    float *o = out + t * c;
    if (rr)
      for (int i = 0; i < c; i++) o[i] = xr[i] + rr[i];
    else if (o != xr)
      memcpy(o, xr, (size_t)c * sizeof(float));
    float mean = lane_sum(o, c, 0.0f, 0) / (float)c;
    float inv = 1.0f / __builtin_sqrtf(lane_sum(o, c, mean, 1) / (float)c + eps);
    if (gelu)
      for (int i = 0; i < c; i++) o[i] = gelu_of((o[i] - mean) * inv * gamma[i] + beta[i]);
    else
      for (int i = 0; i < c; i++) o[i] = (o[i] - mean) * inv * gamma[i] + beta[i];
  }
}

/* --- a stage of HiFi-GAN resblocks in one call --------------------------------------- */

/* total (rows x c) = the mean over `blocks` resblocks of block(x). Each block has
 * `per_block` convs, given in order in taps, bias, kernel and dilation (c x c each,
 * same padding): kind "2" (pairs 0) runs y = conv(act(y)) + y for each; kind "1"
 * (pairs 1) runs each pair as t = conv_a(act(y)), y = conv_b(act(t)) + y. act is the
 * leaky ReLU of `slope`. `work` and `tmp` are rows x c of scratch. One call per tile
 * keeps the caller's language runtime out of the loop: from Python, every return took
 * the interpreter's lock back from the event loop. Returns 0, or -1 as native_conv. */
int native_resblocks(const float *x, long rows, int c, int blocks, int per_block, int pairs,
                     const float *const *taps, const float *const *bias, const int *kernel,
                     const int *dilation, float slope, float *total, float *work, float *tmp) {
  for (int b = 0; b < blocks; b++) {
    float *acc = b == 0 ? total : work;
    const float *y = x;
    for (int i = 0; i < per_block; i++) {
      int at = b * per_block + i, k = kernel[at], d = dilation[at];
      long pad = (long)d * (k - 1) / 2;
      if (pairs && i % 2 == 0) {
        if (native_conv(y, rows, c, c, pad, rows, k, d, taps[at], c, bias[at], NULL, slope, tmp))
          return -1;
        continue;
      }
      const float *in = pairs ? tmp : y;
      if (native_conv(in, rows, c, c, pad, rows, k, d, taps[at], c, bias[at], y, slope, acc))
        return -1;
      y = acc;
    }
    if (b > 0)
      for (long i = 0; i < rows * c; i++) total[i] += work[i];
  }
  for (long i = 0; i < rows * c; i++) total[i] /= (float)blocks;
  return 0;
}

/* --- quantised activations (Smart Turn's int8 graph) --------------------------------- */

/* As onnxruntime's kernels and the MLX port compute them: one float32 rounding per
 * operation, so no multiply and add may be fused into one instruction here. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* The uint8 level of a value already divided by its quantiser's scale. */
static inline float level_of(float scaled, float zero) {
  float v = __builtin_rintf(scaled) + zero;
  return v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v;
}

/* x (rows x cols) in place: the level of x * mult[col] (x / mult[col] where `divide`),
 * then as `mode` says: 0 the level, 1 its code (level - zero), 2 its value (code * scale,
 * + bias[col] where bias is not NULL). */
void native_requantize(float *x, long rows, int cols, const float *mult, int divide,
                       float zero, int mode, float scale, const float *bias) {
  for (long t = 0; t < rows; t++) {
    float *restrict r = x + t * cols;
    if (divide)
      for (int c = 0; c < cols; c++) r[c] = level_of(r[c] / mult[c], zero);
    else
      for (int c = 0; c < cols; c++) r[c] = level_of(r[c] * mult[c], zero);
    if (mode >= 1)
      for (int c = 0; c < cols; c++) r[c] = r[c] - zero;
    if (mode == 2)
      for (int c = 0; c < cols; c++) r[c] = r[c] * scale;
    if (mode == 2 && bias)
      for (int c = 0; c < cols; c++) r[c] = r[c] + bias[c];
  }
}

/* out (rows x cols) = table[level, col] for the levels (rows x cols), the table (256 x
 * channels) having one column per channel, or one column for all (channels 1). */
void native_lookup(const float *levels, long rows, int cols, const float *table, int channels,
                   float *out) {
  for (long t = 0; t < rows; t++) {
    const float *restrict l = levels + t * cols;
    float *restrict o = out + t * cols;
    if (channels == 1)
      for (int c = 0; c < cols; c++) o[c] = table[(int)l[c]];
    else
      for (int c = 0; c < cols; c++) o[c] = table[(int)l[c] * channels + c];
  }
}

struct quant_softmax {
  float *x;
  long n;
  float mult, zero_in, unit, zero_out;
  const float *table;
};

static void quant_softmax_rows(const struct conv *p, long from, long to) {
  const struct quant_softmax *a = p->args;
  long n = a->n;
  for (long t = from; t < to; t++) {
    float *restrict r = a->x + t * n;
    float top = 0.0f;
    for (long i = 0; i < n; i++) {
      r[i] = level_of(r[i] * a->mult, a->zero_in);
      top = r[i] > top ? r[i] : top;
    }
    float shift = 255.0f - top;
    v8 lanes = splat(0.0f);
    for (long i = 0; i < n; i += 8) {
      v8 e;
      for (int k = 0; k < 8; k++) e[k] = a->table[(int)(r[i + k] + shift)];
      store(r + i, e);
      lanes += e;
    }
    float total = lanes[0];
    for (int k = 1; k < 8; k++) total = total + lanes[k];
    float s = (1.0f / total) * a->unit;
    for (long i = 0; i < n; i++) {
      float v = __builtin_rintf(r[i] * s + a->zero_out);
      r[i] = (v < 255.0f ? v : 255.0f) - a->zero_out;
    }
  }
}

/* A value of the softmax weighs as this many multiply-adds in `split_rows`: Smart Turn's
 * 400 x 400 scores (about 0.3 ms on one core) go to the helpers. */
enum { SOFTMAX_COST = 32 };

/* onnxruntime's QLinearSoftmax over each row of n integer sums x, in place: the row's
 * levels (x * mult, zero `zero_in`); e^ read from `table`, shifted so that the row's
 * largest level reads entry 255; summed in eight interleaved lanes, each one element
 * after another, then the lanes in order (its AVX2 kernel's order); scaled by `unit` (the
 * floor of 1 / the output scale) over the sum and rounded: the codes of the output
 * quantiser (zero `zero_out`). n must be a multiple of 8. Returns 0, or -1 when not. */
int native_quant_softmax(float *x, long rows, long n, float mult, float zero_in,
                         const float *table, float unit, float zero_out) {
  if (n % 8 != 0) return -1;
  struct quant_softmax args = {x, n, mult, zero_in, unit, zero_out, table};
  split_rows(rows, n * SOFTMAX_COST, quant_softmax_rows, &args);
  return 0;
}

#pragma GCC pop_options
