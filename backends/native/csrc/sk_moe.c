/* Mixture-of-experts FFN: routing, grouped expert matmuls and a fixed-order combine.
 *
 * Phases of one block, run by every thread of the pool with barriers between them:
 *   1. router logits of every row (one matmul, its columns split between threads);
 *   2. per row: probabilities (softmax or sigmoid), the n_expert_used best by probability + selection
 *      bias (ties to the lower expert index), their weights (normalised, scaled);
 *   3. thread 0 groups the (row, rank) pairs by expert: expert e's pairs get the gathered slots
 *      [off[e], off[e + 1]) in row order; the shared expert, when there is one, is one more group
 *      holding every row;
 *   4. each slot copies its row's input (and quantizes it to int8 when the weights are quantized);
 *   5. gate and up of every group with slots: one matmul per expert over its slots, split between
 *      threads by output columns (and by cost, as groups differ in slot counts);
 *   6. per slot silu(gate) * up, quantized for the down matmul;
 *   7. down of every group with slots;
 *   8. per row: the chosen experts' outputs times their weights, summed in rank order, plus the
 *      shared expert's output, added to the residual.
 * An expert no row chose is skipped, so a decode step reads only the chosen experts' weights.
 *
 * Exactness (see sk.h): a matmul's value for a slot depends only on that slot's input row, a row's
 * routing only on its own logits, and the combine adds a row's terms in rank order, so a row's result
 * is bitwise the same whatever other rows share the batch, wherever its slots land and whatever the
 * thread count.
 */
#include "sk_moe.h"
#include "sk_swa.h" /* sk_geglu */
#include "sk_oai.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Below this, a sum of chosen weights is clamped before dividing by it (2^-14, as llama.cpp does). */
#define WEIGHT_SUM_MIN 6.103515625e-5f
/* A matmul's work unit (16 output columns) costs about its slot count plus this, in rows: the
 * weight's bytes are read whatever the row count. */
enum { UNIT_OVERHEAD_ROWS = 2 };

typedef struct {
    const sk_tensor *w;
    sk_act a;       /* quantized input rows (a view of the gathered ones) */
    const float *x; /* the same rows as floats, for float weights */
    int64_t ldx, m;
    float *out;
    int64_t ldo;
} moe_part;

struct sk_moe_scratch {
    int64_t n_embd, width, k_max, groups_max; /* width: widest expert (routed or shared) of any block */
    int64_t cap_rows, cap_slots, ldx, ldgu;
    float *logits;          /* [cap_rows, groups_max]: router logits, then probabilities */
    int32_t *chosen, *slot; /* [cap_rows, k_max]: expert of each rank, its gathered slot */
    float *weight;          /* [cap_rows, k_max] */
    int32_t *src, *group;   /* [cap_slots]: source row and group of each slot */
    int64_t *off, *cursor;  /* [groups_max + 1] */
    float *xg;              /* [cap_slots, ldx]: gathered inputs, then silu(gate) * up */
    float *gu;              /* [cap_slots, ldgu]: gate outputs, then up outputs */
    float *og;              /* [cap_slots, n_embd]: down outputs */
    int8_t *q;
    float *d, *s;
    int32_t *qs16;
    sk_act act_in, act_mid; /* the quantized gathered inputs / silu outputs (one buffer) */
    moe_part *parts;        /* [2 * groups_max] gate/up matmuls, then [groups_max] down */
    int n_up, n_down, quant_in;
};

/* Expert matmul groups run (gate, up and down of one expert over its rows), all contexts together. */
static atomic_llong experts_run;

SK_API int64_t sk_moe_experts_run(void) { return (int64_t)atomic_exchange(&experts_run, 0); }

static void *xalloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static void split(int64_t n, int ith, int nth, int64_t *a, int64_t *b) {
    *a = n * ith / nth;
    *b = n * (ith + 1) / nth;
}

static int has_shared(const sk_moe *m) { return m->shared_gate.data != NULL; }

/* ---- description ------------------------------------------------------------------------------ */

static int expert_fits(const sk_tensor *g, const sk_tensor *u, const sk_tensor *d, int64_t n_embd, int64_t width) {
    return g->data && u->data && d->data && g->n_cols == n_embd && u->n_cols == n_embd && g->n_rows == width &&
           u->n_rows == width && d->n_rows == n_embd && d->n_cols == width && width > 0;
}

sk_moe *sk_moe_clone(const sk_moe *src, int64_t n_embd) {
    const int32_t ne = src->n_expert;
    if (ne < 1 || src->n_expert_used < 1 || src->n_expert_used > ne || !src->gate || !src->up || !src->down ||
        (src->gating != SK_GATING_SOFTMAX && src->gating != SK_GATING_SIGMOID &&
         src->gating != SK_GATING_SOFTMAX_WEIGHT) ||
        (src->activation != SK_ACT_SWIGLU && src->activation != SK_ACT_SWIGLU_OAI && src->activation != SK_ACT_GEGLU) ||
        !src->router.data ||
        src->router.n_rows != ne || src->router.n_cols != n_embd)
        return NULL;
    for (int32_t e = 0; e < ne; e++)
        if (!expert_fits(&src->gate[e], &src->up[e], &src->down[e], n_embd, src->gate[0].n_rows)) return NULL;
    if (has_shared(src) &&
        !expert_fits(&src->shared_gate, &src->shared_up, &src->shared_down, n_embd, src->shared_gate.n_rows))
        return NULL;
    if (src->shared_inp.data && (!has_shared(src) || src->shared_inp.n_rows != 1 || src->shared_inp.n_cols != n_embd))
        return NULL;
    sk_moe *m = malloc(sizeof *m);
    sk_tensor *t = malloc(sizeof(sk_tensor) * 3 * (size_t)ne);
    if (!m || !t) { free(m); free(t); return NULL; }
    *m = *src;
    memcpy(t, src->gate, sizeof(sk_tensor) * (size_t)ne);
    memcpy(t + ne, src->up, sizeof(sk_tensor) * (size_t)ne);
    memcpy(t + 2 * ne, src->down, sizeof(sk_tensor) * (size_t)ne);
    m->gate = t;
    m->up = t + ne;
    m->down = t + 2 * ne;
    return m;
}

void sk_moe_free(sk_moe *m) {
    if (!m) return;
    free(m->gate); /* one allocation holds gate, up and down */
    free(m);
}

int64_t sk_moe_n_tensors(const sk_moe *m) {
    return 1 + 3 * (int64_t)m->n_expert + (has_shared(m) ? 3 : 0) + (m->shared_inp.data ? 1 : 0);
}

sk_tensor *sk_moe_tensor(sk_moe *m, int64_t i) {
    if (i == 0) return &m->router;
    i -= 1;
    if (i < 3 * (int64_t)m->n_expert) return &m->gate[i]; /* gate, up, down are consecutive */
    i -= 3 * (int64_t)m->n_expert;
    return i == 0 ? &m->shared_gate : i == 1 ? &m->shared_up : i == 2 ? &m->shared_down : &m->shared_inp;
}

/* ---- scratch ---------------------------------------------------------------------------------- */

static void free_buffers(sk_moe_scratch *s) {
    free(s->logits); free(s->chosen); free(s->slot); free(s->weight); free(s->src); free(s->group);
    free(s->xg); free(s->gu); free(s->og); free(s->q); free(s->d); free(s->s); free(s->qs16);
    s->logits = s->weight = s->xg = s->gu = s->og = s->d = s->s = NULL;
    s->chosen = s->slot = s->src = s->group = s->qs16 = NULL;
    s->q = NULL;
    s->cap_rows = s->cap_slots = 0;
}

void sk_moe_scratch_free(sk_moe_scratch *s) {
    if (!s) return;
    free_buffers(s);
    free(s->off); free(s->cursor); free(s->parts);
    free(s);
}

static sk_moe_scratch *scratch_new(sk_moe *const *blocks, int n_layer, int64_t n_embd) {
    int64_t width = 0, k_max = 0, groups = 0;
    for (int l = 0; l < n_layer; l++) {
        const sk_moe *b = blocks[l];
        if (!b) continue;
        width = b->gate[0].n_rows > width ? b->gate[0].n_rows : width;
        if (has_shared(b)) width = b->shared_gate.n_rows > width ? b->shared_gate.n_rows : width;
        k_max = b->n_expert_used > k_max ? b->n_expert_used : k_max;
        groups = b->n_expert + 1 > groups ? b->n_expert + 1 : groups;
    }
    if (!groups) return NULL;
    sk_moe_scratch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->n_embd = n_embd;
    s->width = width;
    s->k_max = k_max;
    s->groups_max = groups;
    s->ldx = n_embd > width ? n_embd : width;
    s->ldgu = 2 * width;
    s->off = malloc(sizeof(int64_t) * (size_t)(groups + 1));
    s->cursor = malloc(sizeof(int64_t) * (size_t)(groups + 1));
    s->parts = malloc(sizeof(moe_part) * (size_t)(3 * groups));
    if (!s->off || !s->cursor || !s->parts) { sk_moe_scratch_free(s); return NULL; }
    return s;
}

int sk_moe_reserve(sk_moe_scratch **sp, sk_moe *const *blocks, int n_layer, int64_t n_embd, int64_t m_rows) {
    if (!*sp) {
        int any = 0;
        for (int l = 0; l < n_layer; l++) any |= blocks[l] != NULL;
        if (!any) return 0;
        if (!(*sp = scratch_new(blocks, n_layer, n_embd))) return -1;
    }
    sk_moe_scratch *s = *sp;
    if (m_rows <= s->cap_rows) return 0;
    free_buffers(s);
    const int64_t slots = m_rows * (s->k_max + 1), pairs = m_rows * s->k_max;
    const int64_t kp = sk_round_up(s->ldx, 64);
    s->logits = malloc(sizeof(float) * (size_t)(m_rows * s->groups_max));
    s->chosen = malloc(sizeof(int32_t) * (size_t)pairs);
    s->slot = malloc(sizeof(int32_t) * (size_t)pairs);
    s->weight = malloc(sizeof(float) * (size_t)pairs);
    s->src = malloc(sizeof(int32_t) * (size_t)slots);
    s->group = malloc(sizeof(int32_t) * (size_t)slots);
    s->xg = xalloc(sizeof(float) * (size_t)(slots * s->ldx));
    s->gu = xalloc(sizeof(float) * (size_t)(slots * s->ldgu));
    s->og = xalloc(sizeof(float) * (size_t)(slots * s->n_embd));
    s->q = xalloc((size_t)(slots * kp));
    s->d = xalloc(sizeof(float) * (size_t)(slots * kp / 32));
    s->s = xalloc(sizeof(float) * (size_t)(slots * kp / 32));
    s->qs16 = xalloc(sizeof(int32_t) * (size_t)(slots * kp / 16));
    if (!s->logits || !s->chosen || !s->slot || !s->weight || !s->src || !s->group || !s->xg || !s->gu || !s->og ||
        !s->q || !s->d || !s->s || !s->qs16) {
        free_buffers(s);
        return -1;
    }
    /* Both views share the buffers with their own row stride: inputs n_embd wide, silu outputs width. */
    const int64_t kp_in = sk_round_up(s->n_embd, 64), kp_mid = sk_round_up(s->width, 64);
    s->act_in = (sk_act){s->q, s->d, s->s, s->qs16, kp_in, slots};
    s->act_mid = (sk_act){s->q, s->d, s->s, s->qs16, kp_mid, slots};
    s->cap_rows = m_rows;
    s->cap_slots = slots;
    return 0;
}

/* ---- routing ---------------------------------------------------------------------------------- */

/* One row: p holds its logits and is left holding the probabilities. */
static void route_row(const sk_moe *moe, float *p, int32_t *chosen, float *weight) {
    const int ne = moe->n_expert, k = moe->n_expert_used;
    if (moe->gating == SK_GATING_SOFTMAX_WEIGHT) { /* no selection bias, weights already sum to 1 */
        sk_oai_route(p, ne, k, chosen, weight);
        if (moe->weights_scale != 1.0f)
            for (int j = 0; j < k; j++) weight[j] *= moe->weights_scale;
        return;
    }
    if (moe->gating == SK_GATING_SOFTMAX) {
        float mx = p[0], sum = 0.0f;
        for (int e = 1; e < ne; e++) mx = p[e] > mx ? p[e] : mx;
        for (int e = 0; e < ne; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        for (int e = 0; e < ne; e++) p[e] /= sum;
    } else {
        for (int e = 0; e < ne; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
    }
    /* Rank by p + bias; a tie (or a NaN score) keeps the lower expert index. */
    for (int j = 0; j < k; j++) {
        int best = -1;
        float best_score = 0.0f;
        for (int e = 0; e < ne; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (taken) continue;
            const float score = moe->selection_bias ? p[e] + moe->selection_bias[e] : p[e];
            if (best < 0 || score > best_score) { best = e; best_score = score; }
        }
        chosen[j] = best;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        weight[j] = p[chosen[j]];
        sum += weight[j];
    }
    if (moe->norm_weights) {
        if (sum < WEIGHT_SUM_MIN) sum = WEIGHT_SUM_MIN;
        for (int j = 0; j < k; j++) weight[j] /= sum;
    }
    if (moe->weights_scale != 1.0f)
        for (int j = 0; j < k; j++) weight[j] *= moe->weights_scale;
    if (moe->expert_scale)
        for (int j = 0; j < k; j++) weight[j] *= moe->expert_scale[chosen[j]];
}

static const sk_tensor *group_tensor(const sk_moe *moe, int g, int which) {
    if (g == moe->n_expert) return which == 0 ? &moe->shared_gate : which == 1 ? &moe->shared_up : &moe->shared_down;
    return which == 0 ? &moe->gate[g] : which == 1 ? &moe->up[g] : &moe->down[g];
}

static sk_act act_rows(const sk_act *a, int64_t r0, int64_t n) {
    return (sk_act){a->q + r0 * a->kp, a->d + r0 * (a->kp / 32), a->s + r0 * (a->kp / 32), a->qs16 + r0 * (a->kp / 16),
                    a->kp, n};
}

/* Thread 0: slots per group, the slot of every (row, rank), and the matmuls of the groups with slots. */
static void plan(sk_moe_scratch *s, const sk_moe *moe, int64_t m) {
    const int ne = moe->n_expert, k = moe->n_expert_used, ng = ne + has_shared(moe);
    const int64_t km = s->k_max;
    int64_t *off = s->off;
    for (int g = 0; g <= ng; g++) off[g] = 0;
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < k; j++) off[s->chosen[r * km + j] + 1]++;
    if (has_shared(moe)) off[ne + 1] = m;
    for (int g = 0; g < ng; g++) off[g + 1] += off[g];
    memcpy(s->cursor, off, sizeof(int64_t) * (size_t)ng);
    for (int64_t r = 0; r < m; r++)
        for (int j = 0; j < k; j++) {
            const int e = s->chosen[r * km + j];
            const int64_t slot = s->cursor[e]++;
            s->slot[r * km + j] = (int32_t)slot;
            s->src[slot] = (int32_t)r;
            s->group[slot] = e;
        }
    for (int64_t r = 0; has_shared(moe) && r < m; r++) {
        s->src[off[ne] + r] = (int32_t)r;
        s->group[off[ne] + r] = ne;
    }
    moe_part *up = s->parts, *down = s->parts + 2 * s->groups_max;
    s->n_up = s->n_down = 0;
    s->quant_in = 0;
    for (int g = 0; g < ng; g++) {
        const int64_t n = off[g + 1] - off[g];
        if (n == 0) continue;
        const sk_tensor *wg = group_tensor(moe, g, 0), *wu = group_tensor(moe, g, 1), *wd = group_tensor(moe, g, 2);
        const sk_act a_in = act_rows(&s->act_in, off[g], n), a_mid = act_rows(&s->act_mid, off[g], n);
        const float *x = s->xg + off[g] * s->ldx;
        float *gu = s->gu + off[g] * s->ldgu;
        up[s->n_up++] = (moe_part){wg, a_in, x, s->ldx, n, gu, s->ldgu};
        up[s->n_up++] = (moe_part){wu, a_in, x, s->ldx, n, gu + wg->n_rows, s->ldgu};
        down[s->n_down++] = (moe_part){wd, a_mid, x, s->ldx, n, s->og + off[g] * s->n_embd, s->n_embd};
        s->quant_in |= sk_is_quant(wg->type) | sk_is_quant(wu->type);
    }
    atomic_fetch_add_explicit(&experts_run, s->n_down, memory_order_relaxed);
}

/* ---- matmuls ---------------------------------------------------------------------------------- */

static void run_part(const sk_kernels *kern, const moe_part *p, int64_t n0, int64_t n1) {
    const sk_kernels *k = kern->supports(p->w) ? kern : &sk_generic_kernels;
    if (sk_is_quant(p->w->type)) k->gemm_q(p->w, n0, n1, &p->a, p->m, p->out, p->ldo, 0);
    else k->gemm_f(p->w, n0, n1, p->x, p->ldx, p->m, p->out, p->ldo, 0);
}

static int64_t clamp_units(int64_t cost_left, int64_t unit_cost, int64_t units) {
    if (cost_left <= 0) return 0;
    const int64_t u = (cost_left + unit_cost - 1) / unit_cost;
    return u < units ? u : units;
}

/* This thread's share of several matmuls: units of 16 output columns, each costing its part's row
 * count plus an overhead; unit u of a part is this thread's when its starting cost falls in the
 * thread's equal slice of the total. */
static void run_parts(const sk_kernels *kern, const moe_part *parts, int np, int ith, int nth) {
    const int64_t unit = kern->column_unit;
    int64_t total = 0;
    for (int i = 0; i < np; i++) total += (parts[i].w->n_rows + unit - 1) / unit * (parts[i].m + UNIT_OVERHEAD_ROWS);
    int64_t t0, t1, start = 0;
    split(total, ith, nth, &t0, &t1);
    for (int i = 0; i < np && start < t1; i++) {
        const moe_part *p = &parts[i];
        const int64_t units = (p->w->n_rows + unit - 1) / unit, cost = p->m + UNIT_OVERHEAD_ROWS;
        const int64_t u0 = clamp_units(t0 - start, cost, units), u1 = clamp_units(t1 - start, cost, units);
        if (u1 > u0) run_part(kern, p, u0 * unit, u1 * unit < p->w->n_rows ? u1 * unit : p->w->n_rows);
        start += units * cost;
    }
}

/* ---- the block -------------------------------------------------------------------------------- */

static void moe_ffn(const sk_moe_env *env, const sk_moe *moe, const float *route_in, const float *h, float *x,
                    int64_t n_embd, int64_t m, int ith, int nth);

void sk_moe_ffn(const sk_moe_env *env, const sk_moe *moe, const float *h, float *x, int64_t n_embd, int64_t m,
                int ith, int nth) {
    moe_ffn(env, moe, h, h, x, n_embd, m, ith, nth);
}

int sk_moe_ffn_routed(const sk_moe_env *env, const sk_moe *moe, const float *route_in, const float *h, float *x,
                      int64_t n_embd, int64_t m, int ith, int nth) {
    if (moe->shared_inp.data) return -1; /* its gate logit is computed beside the router's, from the same input */
    moe_ffn(env, moe, route_in, h, x, n_embd, m, ith, nth);
    return 0;
}

static void moe_ffn(const sk_moe_env *env, const sk_moe *moe, const float *route_in, const float *h, float *x,
                    int64_t n_embd, int64_t m, int ith, int nth) {
    sk_moe_scratch *s = env->scratch;
    const sk_kernels *kern = env->kern;
    const int ne = moe->n_expert, k = moe->n_expert_used;
    const int64_t km = s->k_max, ldl = s->groups_max, slots = m * k + (has_shared(moe) ? m : 0);
    int64_t r0, r1, g0, g1;
    split(m, ith, nth, &r0, &r1);
    split(slots, ith, nth, &g0, &g1);
    sk_pool_barrier(env->pool);

    /* The router's logits, and the shared expert's gate logit in the spare column ne of each row. */
    const int gated = moe->shared_inp.data != NULL;
    moe_part router[2] = {{&moe->router, act_rows(&s->act_in, 0, m), route_in, n_embd, m, s->logits, ldl},
                          {&moe->shared_inp, act_rows(&s->act_in, 0, m), h, n_embd, m, s->logits + ne, ldl}};
    if (sk_is_quant(moe->router.type) || (gated && sk_is_quant(moe->shared_inp.type))) {
        if (r1 > r0) kern->quantize_rows(route_in + r0 * n_embd, n_embd, r1 - r0, n_embd, &s->act_in, r0);
        sk_pool_barrier(env->pool);
    }
    run_parts(kern, router, 1 + gated, ith, nth);
    sk_pool_barrier(env->pool);

    for (int64_t r = r0; r < r1; r++) route_row(moe, s->logits + r * ldl, s->chosen + r * km, s->weight + r * km);
    sk_pool_barrier(env->pool);
    if (ith == 0) plan(s, moe, m);
    sk_pool_barrier(env->pool);

    for (int64_t g = g0; g < g1; g++) memcpy(s->xg + g * s->ldx, h + s->src[g] * n_embd, sizeof(float) * (size_t)n_embd);
    if (s->quant_in && g1 > g0) kern->quantize_rows(s->xg + g0 * s->ldx, s->ldx, g1 - g0, n_embd, &s->act_in, g0);
    sk_pool_barrier(env->pool);
    run_parts(kern, s->parts, s->n_up, ith, nth);
    sk_pool_barrier(env->pool);

    for (int64_t g = g0; g < g1; g++) {
        const int grp = s->group[g];
        const sk_tensor *down = group_tensor(moe, grp, 2);
        const int64_t f = down->n_cols;
        float *xr = s->xg + g * s->ldx, *gu = s->gu + g * s->ldgu;
        if (grp < ne && moe->activation == SK_ACT_SWIGLU_OAI) sk_oai_swiglu(gu, gu + f, f, xr);
        else if (grp < ne && moe->activation == SK_ACT_GEGLU) sk_geglu(gu, gu + f, f, xr);
        else kern->silu_mul(gu, gu + f, f, xr);
        if (sk_is_quant(down->type)) kern->quantize_rows(xr, s->ldx, 1, f, &s->act_mid, g);
    }
    sk_pool_barrier(env->pool);
    run_parts(kern, s->parts + 2 * s->groups_max, s->n_down, ith, nth);
    sk_pool_barrier(env->pool);

    /* Rank 0's output row accumulates the others (each slot belongs to one (row, rank) alone). */
    for (int64_t r = r0; r < r1; r++) {
        const int32_t *slot = s->slot + r * km;
        const float *w = s->weight + r * km;
        float *y = s->og + (int64_t)slot[0] * n_embd, *xr = x + r * n_embd;
        for (int64_t i = 0; i < n_embd; i++) y[i] *= w[0];
        for (int j = 1; j < k; j++) {
            const float *o = s->og + (int64_t)slot[j] * n_embd, wj = w[j];
            for (int64_t i = 0; i < n_embd; i++) y[i] += wj * o[i];
        }
        if (has_shared(moe)) {
            const float *o = s->og + (s->off[ne] + r) * n_embd;
            if (gated) {
                const float gate = 1.0f / (1.0f + expf(-s->logits[r * ldl + ne]));
                for (int64_t i = 0; i < n_embd; i++) y[i] += gate * o[i];
            } else {
                for (int64_t i = 0; i < n_embd; i++) y[i] += o[i];
            }
        }
        for (int64_t i = 0; i < n_embd; i++) xr[i] += y[i];
    }
    sk_pool_barrier(env->pool);
}
