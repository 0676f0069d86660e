/* The encoders' entry points, on a context's threads and kernels: EAGLE-3's input encoder over the target's
 * features (sk_project_in), and DFlash's context encoder, whose output becomes every block's keys and values
 * without running the blocks (sk_inject_kv). They run the forward's steps (sk_step.h). */
#define _GNU_SOURCE
#include <stdlib.h>

#include "sk_ctx.h"
#include "sk_step.h"

typedef struct {
    sk_ctx *c;
    const float *x;
    int64_t m;
    float *out;
} project_job;

static void project_in_job(void *arg, int ith, int nth) {
    project_job *j = arg;
    sk_ctx *c = j->c;
    const sk_tensor *w = &c->cfg.in_proj;
    int64_t r0, r1;
    split(j->m, ith, nth, &r0, &r1);
    part p = {w, j->out, w->n_rows, 0};
    if (sk_is_quant(w->type)) quantize(c, j->x, w->n_cols, w->n_cols, r0, r1);
    skc_barrier(c->pool, ith);
    skc_gemm_parts(c, &p, 1, j->x, w->n_cols, j->m, ith, nth);
}

/* out[m, n_embd] = in_proj . x[m, in_proj.n_cols] for a context with a wide input and an encoder, on the
 * context's threads and kernels: 0, -1 out of memory, -2 no encoder or no rows. */
SK_API int sk_project_in(sk_ctx *c, const float *x, int64_t m, float *out) {
    if (!c->cfg.wide_input || !c->cfg.in_proj.data || m < 1) return -2;
    if (skc_ensure_scratch(c, m) != 0) return -1;
    project_job j = {c, x, m, out};
    sk_pool_run(c->pool, project_in_job, &j);
    return 0;
}

typedef struct {
    sk_ctx *c;
    const float *features;
    const sk_batch *b; /* the rows' positions and sequence */
} inject_job;

/* ctx_norm(ctx_proj . features) per row, then for every block its k and v projections of that, keys
 * normed and roped, into the cache: the rows' queries, attention and FFN are never computed. */
static void inject_kv_job(void *arg, int ith, int nth) {
    inject_job *j = arg;
    sk_ctx *c = j->c;
    const sk_batch *b = j->b;
    const sk_config *g = &c->cfg;
    const int64_t m = b->n_rows, E = g->n_embd;
    const int64_t kvd = (int64_t)g->n_head_kv * g->head_dim, qkvd = c->qkvd, k_in = g->ctx_proj.n_cols;
    int64_t r0, r1;
    split(m, ith, nth, &r0, &r1);
    part enc = {&g->ctx_proj, c->x, E, 0};
    if (any_quant(&enc, 1)) quantize(c, j->features, k_in, k_in, r0, r1);
    skc_barrier(c->pool, ith);
    skc_gemm_parts(c, &enc, 1, j->features, k_in, m, ith, nth);
    skc_barrier(c->pool, ith);
    for (int64_t r = r0; r < r1; r++) {
        c->kern->rms_norm(c->x + r * E, g->ctx_norm, E, g->rms_eps, c->h + r * E);
        skc_rope_angles(c, b->pos[r], r);
    }
    int quant = 0; /* every block reads the same rows: quantized once */
    for (int l = 0; l < g->n_layer; l++)
        quant |= sk_is_quant(g->layers[l].wk.type) || sk_is_quant(g->layers[l].wv.type);
    if (quant) quantize(c, c->h, E, E, r0, r1);
    skc_barrier(c->pool, ith);
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        const int64_t qw = q_width(g, L);
        part kv[2] = {{&L->wk, c->qkv + qw, qkvd, 0}, {&L->wv, c->qkv + qw + kvd, qkvd, 0}};
        skc_gemm_parts(c, kv, 2, c->h, E, m, ith, nth);
        skc_barrier(c->pool, ith);
        skc_qkv_post(c, b, l, g->n_head, r0, r1);
        skc_barrier(c->pool, ith); /* the next block's products overwrite qkv */
    }
}

/* Context rows for one sequence: features [m, ctx_proj.n_cols] at positions start .. start + m - 1 become
 * every block's keys and values there. 0, -1 out of memory, -2 no context encoder or a bad range. */
SK_API int sk_inject_kv(sk_ctx *c, const float *features, int64_t m, int slot, int32_t start) {
    const sk_config *g = &c->cfg;
    if (!g->ctx_proj.data || c->swa_ring || m < 1 || slot < 0 || slot >= g->n_seq_max || !c->kv[slot] || start < 0 ||
        (int64_t)start + m > g->n_ctx)
        return -2;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)m), *seq = malloc(sizeof(int32_t) * (size_t)m);
    if (!pos || !seq || skc_ensure_scratch(c, m) != 0) { free(pos); free(seq); return -1; }
    for (int64_t r = 0; r < m; r++) {
        pos[r] = start + (int32_t)r;
        seq[r] = slot;
    }
    sk_batch b = {.n_rows = m, .pos = pos, .seq = seq};
    inject_job j = {c, features, &b};
    sk_pool_run(c->pool, inject_kv_job, &j);
    free(pos);
    free(seq);
    return 0;
}
