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
 *   - other products with one row (or one column) of output go to the bound library's
 *     cblas_sgemv, and everything else to its cblas_sgemm unchanged.
 * Each output row is summed in the same order whatever the number of rows, so a
 * sequence's results do not depend on what it is batched with. The pool's threads spin
 * only briefly after a product, then sleep: a decode step keeps them awake between its
 * products without starving other threads between steps.
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MAX_ROWS = 8, MAX_THREADS = 8, LANES = 16 };
/* Products with fewer weights run on the calling thread alone. */
enum { MIN_SPLIT_WEIGHTS = 1 << 16 };
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
/* LANES floats; loads and stores through it need only float alignment. */
typedef float lanes __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

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
};

/* BLAS leaves c unread when beta is 0, but a NaN already there could survive 0 * c. */
static inline float scaled(const struct product *p, float sum, const float *c) {
  return p->beta == 0.0f ? p->alpha * sum : p->alpha * sum + p->beta * *c;
}

/* Halve and add, four times: the same order for every output. */
static inline float sum_lanes(lanes v) {
#if defined(__clang__) || __GNUC__ >= 12
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
#else /* compilers without __builtin_shufflevector: the same sums, lane by lane */
  for (int half = LANES / 2; half > 0; half /= 2)
    for (int i = 0; i < half; i++) v[i] += v[i + half];
  return v[0];
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
    for (int r = 0; r < rows; r++) acc[r] = (lanes){0};
    for (int i = 0; i < whole; i += LANES) {
      __builtin_prefetch(w + i + PREFETCH_FLOATS, 0, 3);
      lanes wv = *(const lanes *)(w + i);
      for (int r = 0; r < rows; r++)
        acc[r] += wv * *(const lanes *)(p->a + (size_t)r * p->lda + i);
    }
    for (int r = 0; r < rows; r++) {
      float s = sum_lanes(acc[r]);
      for (int i = whole; i < k; i++) s += w[i] * p->a[(size_t)r * p->lda + i];
      float *out = p->c + (size_t)r * p->ldc + n;
      *out = scaled(p, s, out);
    }
  }
}

static void few_rows(const struct product *p, int n0, int n1) {
  switch (p->m) {
  case 1: few_rows_range(p, 1, n0, n1); break;
  case 2: few_rows_range(p, 2, n0, n1); break;
  case 3: few_rows_range(p, 3, n0, n1); break;
  case 4: few_rows_range(p, 4, n0, n1); break;
  case 5: few_rows_range(p, 5, n0, n1); break;
  case 6: few_rows_range(p, 6, n0, n1); break;
  case 7: few_rows_range(p, 7, n0, n1); break;
  default: few_rows_range(p, 8, n0, n1); break;
  }
}

/* --- plain b: rows of b scaled and summed, LANES columns at a time ----------------- */

static inline __attribute__((always_inline)) void few_rows_plain_rows(const struct product *p,
                                                                      int rows) {
  const int n = p->n, whole = n - n % LANES;
  for (int j = 0; j < whole; j += LANES) {
    lanes acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = (lanes){0};
    for (int i = 0; i < p->k; i++) {
      lanes bv = *(const lanes *)(p->b + (size_t)i * p->ldb + j);
      for (int r = 0; r < rows; r++) acc[r] += p->a[(size_t)r * p->lda + i] * bv;
    }
    for (int r = 0; r < rows; r++)
      for (int q = 0; q < LANES; q++) {
        float *out = p->c + (size_t)r * p->ldc + j + q;
        *out = scaled(p, acc[r][q], out);
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

/* --- a small thread pool: the caller takes the first slice, each helper one more -- */

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int pool_threads; /* 0: not started (again, after a fork) */
static const struct product *job;
static atomic_uint generation;
static atomic_int unfinished;
static unsigned born_at;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_slice(const struct product *p, int part, int parts) {
  few_rows(p, (int)((long)p->n * part / parts), (int)((long)p->n * (part + 1) / parts));
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
  int index = (int)(size_t)arg;
  for (unsigned seen = born_at;; seen++) { /* the product that started the pool is next */
    wait_for_job(seen);
    run_slice(job, index, pool_threads);
    atomic_fetch_sub_explicit(&unfinished, 1, memory_order_release);
  }
  return NULL;
}

/* A forked child has none of the helpers, and a lock a helper held stays held. */
static void forget_pool(void) {
  pool_threads = 0;
  pthread_mutex_init(&pool_busy, NULL);
  pthread_mutex_init(&wake_lock, NULL);
  pthread_cond_init(&wake, NULL);
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
    if (pthread_create(&t, NULL, helper_main, (void *)(size_t)started) != 0) break;
    pthread_detach(t);
  }
  return started;
}

static void few_rows_split(const struct product *p) {
  if ((long)p->n * p->k < MIN_SPLIT_WEIGHTS || pthread_mutex_trylock(&pool_busy) != 0) {
    few_rows(p, 0, p->n); /* small, or another caller holds the pool: all of it here */
    return;
  }
  if (pool_threads == 0) pool_threads = start_pool();
  job = p;
  atomic_store(&unfinished, pool_threads - 1);
  pthread_mutex_lock(&wake_lock);
  atomic_fetch_add_explicit(&generation, 1, memory_order_release);
  pthread_cond_broadcast(&wake);
  pthread_mutex_unlock(&wake_lock);
  run_slice(p, 0, pool_threads);
  /* A helper still at work may share this core with us: after a short spin, let it run. */
  long start = now_ns();
  while (atomic_load_explicit(&unfinished, memory_order_acquire) > 0)
    if (now_ns() - start > SPIN_NS) sched_yield();
  pthread_mutex_unlock(&pool_busy);
}

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
  struct product p = {m, n, k, lda, ldb, ldc, alpha, beta, rows, b, c};
  if (tb == TRANS)
    few_rows_split(&p);
  else
    few_rows_plain(&p);
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
  int usable = enabled && real_sgemv != NULL && order == ROW_MAJOR && k > 0;
  int few = usable && m <= MAX_ROWS && (tb == TRANS || (long)n * k < MIN_SPLIT_WEIGHTS);
  if (few && few_rows_product(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
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
