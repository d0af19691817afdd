/* One decode step of a llama decoder (`engine/models/llama.py`) in one call.
 *
 * On a CPU a decode step of a small model is mostly the overhead of its operations: MLX
 * schedules some 1,400 of them for SmolLM2-135M, a few microseconds each, beside about
 * 120 weight products. Here the step is one C function: the products go through
 * `cblas_sgemm`, which in the process's global scope is the few-row forwarder's
 * (`gemv_forward.c`: compact twins, helper threads), and everything between them (the
 * norms, rotary embedding, attention over the cache, SwiGLU, the residuals) is plain
 * loops over a few rows, the attention's split over the forwarder's threads by row and
 * key/value head. The step writes each row's new key and value into the batch's cache
 * in place, at position `idx`, and returns the logits.
 *
 * Every row is computed alone: its norms, rotation and attention read only its own
 * values, and the forwarder sums each product row the same whatever the rows beside it,
 * so a sequence's logits do not depend on the batch it decodes in.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc);
/* The forwarder's thread pool: run(context, part, parts) for each part. */
void gemv_forward_split(void (*run)(const void *context, int part, int parts),
                        const void *context);

/* A layer's weights, in this order in `weights` (a bias may be NULL). */
enum {
  IN_NORM,
  QKV,
  QKV_BIAS,
  OUT,
  OUT_BIAS,
  POST_NORM,
  GATE_UP,
  GATE_UP_BIAS,
  DOWN,
  DOWN_BIAS,
  LAYER_WEIGHTS
};
/* After the layers' weights: the embedding table, the final norm and the LM head. */
enum { EMBED, FINAL_NORM, HEAD };
/* The model's sizes, in this order in `shape`. */
enum { LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB };

struct model {
  int layers, dim, heads, kv_heads, head_dim, hidden, vocab;
  float eps;
};

static void rms_norm(const float *x, const float *weight, float *out, int n, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < n; i++) sum += x[i] * x[i];
  float inverse = 1.0f / sqrtf(sum * (1.0f / (float)n) + eps);
  for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inverse);
}

/* out (rows x n) = x (rows x k) . w^T (w: n x k) + bias */
static void linear(const float *x, int rows, const float *w, const float *bias, int n, int k,
                   float *out) {
  cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS, rows, n, k, 1.0f, x, k, w, k, 0.0f, out, n);
  if (bias == NULL) return;
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < n; i++) out[(size_t)r * n + i] += bias[i];
}

/* RoPE with the two halves of a head as the pairs; `sin`'s first half is negated, as
 * `engine.models.llama.rotary_angles` gives it. */
static void rotate(float *x, const float *cos, const float *sin, int d) {
  float turned[d];
  int half = d / 2;
  for (int i = 0; i < half; i++) turned[i] = x[i] * cos[i] + x[i + half] * sin[i];
  for (int i = half; i < d; i++) turned[i] = x[i] * cos[i] + x[i - half] * sin[i];
  memcpy(x, turned, sizeof turned);
}

/* Eight floats; loads and stores through it need only float alignment. */
typedef float lanes __attribute__((vector_size(8 * sizeof(float)), aligned(4)));

/* a . b in eight running sums (a plain loop adds one product at a time, in order). */
static float dot(const float *a, const float *b, int n) {
  lanes sums = {0};
  int i = 0;
  for (; i + 8 <= n; i += 8) sums += *(const lanes *)(a + i) * *(const lanes *)(b + i);
  float sum = 0.0f;
  for (int j = 0; j < 8; j++) sum += sums[j];
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

/* One query head against positions first..last of its key/value head. */
static void attend(const float *q, const float *keys, const float *values, int first, int last,
                   int d, float scale, float *scores, float *out) {
  float scaled[d];
  for (int i = 0; i < d; i++) scaled[i] = q[i] * scale;
  float top = -INFINITY;
  for (int j = first; j <= last; j++) {
    scores[j] = dot(scaled, keys + (size_t)j * d, d);
    top = scores[j] > top ? scores[j] : top;
  }
  float total = 0.0f;
  for (int j = first; j <= last; j++) total += scores[j] = expf(scores[j] - top);
  for (int i = 0; i < d; i++) out[i] = 0.0f;
  for (int j = first; j <= last; j++) {
    const float *v = values + (size_t)j * d;
    float p = scores[j] / total;
    for (int i = 0; i < d; i++) out[i] += p * v[i];
  }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

struct buffers {
  float *x, *normed, *qkv, *heads, *mixed, *gate_up, *act;
};

static int allocate(struct buffers *b, const struct model *m, int rows) {
  int qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
  size_t sizes[] = {(size_t)rows * m->dim, (size_t)rows * m->dim,
                    (size_t)rows * qkv,    (size_t)rows * m->heads * m->head_dim,
                    (size_t)rows * m->dim, (size_t)rows * 2 * m->hidden,
                    (size_t)rows * m->hidden};
  float **slots[] = {&b->x, &b->normed, &b->qkv, &b->heads, &b->mixed, &b->gate_up, &b->act};
  size_t total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
  float *all = malloc(total * sizeof(float));
  if (all == NULL) return 0;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) *slots[i] = all, all += sizes[i];
  return 1;
}

/* One layer's attention over the batch; its parts are (row, key/value head) pairs. */
struct attention {
  const struct model *m;
  const struct buffers *b;
  int rows, capacity, idx;
  float *keys, *values;
  const int *first;
  const float *cos, *sin;
};

/* Row r's key/value head g: rotate its key and its group of queries, write the key and
 * value at idx, and attend each query head of the group. */
static void attend_group(const struct attention *a, int r, int g, float *scores) {
  const struct model *m = a->m;
  int d = m->head_dim, group = m->heads / m->kv_heads;
  float *row = a->b->qkv + (size_t)r * (m->heads + 2 * m->kv_heads) * d;
  const float *cos = a->cos + (size_t)r * d, *sin = a->sin + (size_t)r * d;
  float *key = row + (m->heads + g) * d, *value = row + (m->heads + m->kv_heads + g) * d;
  rotate(key, cos, sin, d);
  size_t at = ((size_t)r * m->kv_heads + g) * a->capacity * d;
  memcpy(a->keys + at + (size_t)a->idx * d, key, d * sizeof(float));
  memcpy(a->values + at + (size_t)a->idx * d, value, d * sizeof(float));
  float scale = 1.0f / sqrtf((float)d);
  for (int h = g * group; h < (g + 1) * group; h++) {
    rotate(row + h * d, cos, sin, d);
    attend(row + h * d, a->keys + at, a->values + at, a->first[r], a->idx, d, scale, scores,
           a->b->heads + ((size_t)r * m->heads + h) * d);
  }
}

static void attention_slice(const void *context, int part, int parts) {
  const struct attention *a = context;
  int pairs = a->rows * a->m->kv_heads;
  float scores[a->idx + 1];
  for (int p = pairs * part / parts; p < pairs * (part + 1) / parts; p++)
    attend_group(a, p / a->m->kv_heads, p % a->m->kv_heads, scores);
}

static void add(float *x, const float *y, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* One decode step of `rows` sequences. `cache` holds each layer's keys and values, each
 * (rows, kv_heads, capacity, head_dim); row r's valid positions are first[r]..idx-1 and
 * its new token goes at idx. `cos` and `sin` are each row's rotary factors (rows x
 * head_dim). Writes logits (rows x vocab); returns 0, or -1 when out of memory. */
int llama_step(const int *shape, float eps, const float *const *weights, float *const *cache,
               int rows, int capacity, int idx, const int *tokens, const int *first,
               const float *cos, const float *sin, float *logits) {
  struct model m = {shape[LAYERS],   shape[DIM],    shape[HEADS], shape[KV_HEADS],
                    shape[HEAD_DIM], shape[HIDDEN], shape[VOCAB], eps};
  struct buffers b;
  if (!allocate(&b, &m, rows)) return -1;
  const float *const *model_weights = weights + (size_t)m.layers * LAYER_WEIGHTS;
  size_t width = (size_t)rows * m.dim;
  for (int r = 0; r < rows; r++)
    memcpy(b.x + (size_t)r * m.dim, model_weights[EMBED] + (size_t)tokens[r] * m.dim,
           m.dim * sizeof(float));
  int qkv = (m.heads + 2 * m.kv_heads) * m.head_dim, attended = m.heads * m.head_dim;
  for (int l = 0; l < m.layers; l++) {
    const float *const *w = weights + (size_t)l * LAYER_WEIGHTS;
    for (int r = 0; r < rows; r++)
      rms_norm(b.x + (size_t)r * m.dim, w[IN_NORM], b.normed + (size_t)r * m.dim, m.dim, eps);
    linear(b.normed, rows, w[QKV], w[QKV_BIAS], qkv, m.dim, b.qkv);
    struct attention a = {&m, &b, rows, capacity, idx, cache[2 * l], cache[2 * l + 1],
                          first, cos, sin};
    gemv_forward_split(attention_slice, &a);
    linear(b.heads, rows, w[OUT], w[OUT_BIAS], m.dim, attended, b.mixed);
    add(b.x, b.mixed, width);
    for (int r = 0; r < rows; r++)
      rms_norm(b.x + (size_t)r * m.dim, w[POST_NORM], b.normed + (size_t)r * m.dim, m.dim,
               eps);
    linear(b.normed, rows, w[GATE_UP], w[GATE_UP_BIAS], 2 * m.hidden, m.dim, b.gate_up);
    for (int r = 0; r < rows; r++) {
      const float *gate = b.gate_up + (size_t)r * 2 * m.hidden, *up = gate + m.hidden;
      float *act = b.act + (size_t)r * m.hidden;
      for (int i = 0; i < m.hidden; i++) act[i] = silu(gate[i]) * up[i];
    }
    linear(b.act, rows, w[DOWN], w[DOWN_BIAS], m.dim, m.hidden, b.mixed);
    add(b.x, b.mixed, width);
  }
  for (int r = 0; r < rows; r++)
    rms_norm(b.x + (size_t)r * m.dim, model_weights[FINAL_NORM], b.normed + (size_t)r * m.dim,
             m.dim, eps);
  linear(b.normed, rows, model_weights[HEAD], NULL, m.vocab, m.dim, logits);
  free(b.x);
  return 0;
}
