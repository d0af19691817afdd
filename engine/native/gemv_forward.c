/* One-row matrix products through BLAS's matrix-vector routine.
 *
 * MLX's CPU backend sends every matmul to cblas_sgemm. For a single row (one decode
 * step of one sequence) OpenBLAS's sgemm still packs the whole weight matrix into its
 * blocked layout before multiplying, so the weights cross memory twice; sgemv reads them
 * once, in place. Loaded into the global symbol scope before the BLAS itself, this
 * library's cblas_sgemm answers first: products with one row (or one column) of output
 * go to the bound library's cblas_sgemv, all others to its cblas_sgemm unchanged.
 */
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

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

/* BLAS leaves y unread when beta is 0, but a NaN already there could survive 0 * y. */
static void clear(float *y, int n, int inc) {
  for (int i = 0; i < n; i++) y[(size_t)i * inc] = 0.0f;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  int usable = enabled && real_sgemv != NULL && order == ROW_MAJOR && k > 0;
  if (usable && m == 1 && n > 1) {
    /* c (1 x n) = alpha * op(a) (1 x k) . op(b) (k x n) + beta * c */
    int incx = ta == NO_TRANS ? 1 : lda;
    if (beta == 0.0f) clear(c, n, 1);
    if (tb == TRANS) /* b is n x k */
      real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    else /* b is k x n */
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
