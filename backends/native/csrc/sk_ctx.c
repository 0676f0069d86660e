/* A context's life cycle: the checks its config passes, which blocks keep keys and values (and the delta-net
 * blocks' context), every weight rewritten into the kernel table's layout in one arena, and the release;
 * also the kernel table a CPU gets. The forward over a context is in sk_model.c (sk_ctx.h lists the others).
 *
 * A context made with sk_ctx_new_over runs on another context's threads and may take weights that
 * context prepared (layout 1) as they are; it keeps that context alive until it is freed itself.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sk_ctx.h"

SKC_HIDDEN const sk_kernels *skc_pick_kernels(int cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (cap == SK_KERNELS_BEST && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        return &sk_avx512_kernels;
    if (cap != SK_KERNELS_GENERIC && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        return &sk_avx2_kernels;
#endif
    (void)cap;
    return &sk_generic_kernels;
}

SK_API const char *sk_kernel_name(int cap) { return skc_pick_kernels(cap)->name; }

/* Drops the creator's reference; the memory goes once no context made over this one remains. */
SK_API void sk_ctx_free(sk_ctx *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1) return;
    if (c->pool && !c->base) sk_pool_free(c->pool); /* a context over a base borrows the base's pool */
    if (c->kv)
        for (int s = 0; s < c->cfg.n_seq_max; s++) free(c->kv[s]);
    free(c->kv);
    if (c->att_scratch)
        for (int i = 0; i < c->cfg.n_threads; i++) free(c->att_scratch[i]);
    free(c->att_scratch);
    free(c->att_prefix);
    free(c->att_parts);
    if (c->packed) munmap(c->packed, c->packed_map);
    if (c->moe)
        for (int l = 0; l < c->cfg.n_layer; l++) sk_moe_free(c->moe[l]);
    free(c->moe);
    sk_moe_scratch_free(c->moe_scratch);
    sk_dn_ctx_free(c->dn);
    free(c->kv_layer);
    free(c->kv_off);
    free(c->kv_rows);
    free(c->att_prefix_swa);
    free(c->att_wave_at);
    free(c->att_wave_at_swa);
    free(c->att_order);
    free(c->att_order_swa);
    sk_swa_free(c->swa);
    free(c->swa_heads);
    skc_free_scratch(c);
    free(c->layers);
    sk_ctx *base = c->base;
    free(c);
    sk_ctx_free(base);
}

/* Give back the pages of a mapped source range the process no longer reads (they stay in the page
 * cache; only this process's resident size shrinks). */
static void drop_pages(const void *start, size_t len) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)start + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    uintptr_t b = ((uintptr_t)start + len) & ~((uintptr_t)page - 1);
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

/* Bytes a weight takes in the kernel table's layout, rounded to 64 for the next one's alignment (0: it
 * stays as it is); its packed row_bytes and exact size through the pointers when they are not NULL. */
static int64_t packed_footprint(const sk_ctx *c, const sk_tensor *w, int64_t *row_bytes, int64_t *size) {
    if (!w->data || w->layout != 0 || !c->kern->packed_size) return 0;
    int64_t rb = 0, sz = c->kern->packed_size(w, &rb);
    if (sz <= 0) return 0;
    if (row_bytes) *row_bytes = rb;
    if (size) *size = sz;
    return (sz + 63) / 64 * 64;
}

static int64_t size_tensor(sk_ctx *c, sk_tensor *w) { return packed_footprint(c, w, NULL, NULL); }

/* Rewrite a weight into the kernel table's layout when it has one, at the arena's next free bytes;
 * returns the bytes it took there. */
static int64_t pack_tensor(sk_ctx *c, sk_tensor *w) {
    if (w == &c->cfg.output && c->head_later) return 0; /* its footprint stays free at the arena's end */
    int64_t row_bytes = 0, size = 0, footprint = packed_footprint(c, w, &row_bytes, &size);
    if (footprint == 0) return 0;
    uint8_t *dst = c->packed + c->packed_used;
    c->packed_used += footprint;
    c->packed_bytes += size;
    /* In steps of ~1 MiB of source rows, giving their pages back as we go: the peak stays near the
     * packed size instead of packed + source. */
    const int64_t unit = c->kern->column_unit, units = (w->n_rows + unit - 1) / unit;
    const int64_t step = 1 + (1 << 20) / (unit * w->row_bytes);
    for (int64_t u = 0; u < units; u += step) {
        int64_t u1 = u + step < units ? u + step : units, r0 = u * unit, r1 = u1 * unit < w->n_rows ? u1 * unit : w->n_rows;
        c->kern->pack(w, u, u1, dst + u * row_bytes);
        drop_pages(w->data + r0 * w->row_bytes, (size_t)((r1 - r0) * w->row_bytes));
    }
    w->data = dst;
    w->row_bytes = row_bytes;
    w->layout = 1;
    return footprint;
}

/* Every weight the context packs, in one order for sizing and for packing; the sum of fn's results. */
static int64_t for_each_weight(sk_ctx *c, int64_t (*fn)(sk_ctx *, sk_tensor *)) {
    int64_t total = 0;
    for (int l = 0; l < c->cfg.n_layer; l++) {
        sk_layer *L = &c->layers[l];
        sk_tensor *ts[14] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down,
                             &L->dn.qkv, &L->dn.z, &L->dn.beta, &L->dn.alpha, &L->dn.out, &L->ple_gate, &L->ple_proj};
        for (int i = 0; i < 14; i++) total += fn(c, ts[i]);
        for (int64_t i = 0; c->moe[l] && i < sk_moe_n_tensors(c->moe[l]); i++) total += fn(c, sk_moe_tensor(c->moe[l], i));
    }
    return total + fn(c, &c->cfg.in_proj) + fn(c, &c->cfg.ctx_proj) + fn(c, &c->cfg.output) +
           fn(c, &c->cfg.ple_model_proj);
}

/* The packed weights live in one anonymous mapping that asks for transparent huge pages: a decode
 * step reads every weight once, and with 4 KiB pages that is tens of thousands of TLB entries for a
 * small model (the page walks show up in the step's time); 2 MiB pages need a few dozen. Where the
 * kernel gives no huge pages the mapping works as before, page by page. -1 when out of memory. */
static int pack_weights(sk_ctx *c) {
    const int64_t total = for_each_weight(c, size_tensor);
    if (total == 0) return 0;
    const size_t huge = (size_t)2 << 20, len = ((size_t)total + huge - 1) / huge * huge;
    /* Mapped with a huge page to spare and trimmed to a 2 MiB boundary: huge pages need aligned ranges. */
    uint8_t *raw = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return -1;
    uint8_t *arena = (uint8_t *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
    if (arena > raw) munmap(raw, (size_t)(arena - raw));
    munmap(arena + len, (size_t)(raw + huge - arena)); /* the tail: arena < raw + huge, so never empty */
#ifdef MADV_HUGEPAGE
    madvise(arena, len, MADV_HUGEPAGE);
#endif
    c->packed = arena;
    c->packed_map = len;
    for_each_weight(c, pack_tensor);
    return 0;
}

static int in_proj_fits(const sk_config *cfg) {
    const sk_tensor *p = &cfg->in_proj;
    const int64_t E2 = 2 * (int64_t)cfg->n_embd;
    if (cfg->wide_input) { /* one block whose separate q, k and v read the 2 n_embd wide row */
        const sk_layer *L = &cfg->layers[0];
        return (!p->data || p->n_rows == cfg->n_embd) && cfg->wide_input <= SK_WIDE_RESIDUAL_NORMED &&
               cfg->n_layer == 1 && cfg->in_embd_norm &&
               cfg->in_hidden_norm && L->wk.data && L->wq.n_cols == E2 && L->wk.n_cols == E2 && L->wv.n_cols == E2;
    }
    return !p->data || (p->n_rows == cfg->n_embd && p->n_cols == E2 && cfg->in_embd_norm && cfg->in_hidden_norm);
}

/* A context encoder writes keys and values of blocks with separate k and v projections, from n_embd rows. */
static int ctx_proj_fits(const sk_config *cfg) {
    if (!cfg->ctx_proj.data) return 1;
    if (cfg->ctx_proj.n_rows != cfg->n_embd || cfg->ctx_proj.n_cols < 1 || !cfg->ctx_norm || cfg->wide_input) return 0;
    for (int l = 0; l < cfg->n_layer; l++)
        if (!cfg->layers[l].wk.data || cfg->layers[l].wk.n_cols != cfg->n_embd || cfg->layers[l].wv.n_cols != cfg->n_embd)
            return 0;
    return 1;
}

/* Which blocks keep keys and values, the qkv row width, and the delta-net blocks' context; -1 when the
 * blocks do not fit together or out of memory. */
static int set_up_blocks(sk_ctx *c) {
    const sk_config *g = &c->cfg;
    const sk_dn **dn = calloc((size_t)g->n_layer, sizeof(sk_dn *));
    c->kv_layer = malloc(sizeof(int32_t) * (size_t)g->n_layer);
    c->kv_off = calloc((size_t)g->n_layer, sizeof(int64_t));
    c->kv_rows = calloc((size_t)g->n_layer, sizeof(int64_t));
    if (!dn || !c->kv_layer || !c->kv_off || !c->kv_rows) { free(dn); return -1; }
    c->qkvd = (int64_t)(g->n_head + 2 * g->n_head_kv) * g->head_dim;
    c->max_hd = g->head_dim;
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        const int hd = hd_of(g, L);
        if (L->moe_pre_norm && (!L->moe || L->moe->shared_inp.data || !L->router_scale || !L->dense_post_norm ||
                                !L->moe_post_norm || !L->ffn_post_norm || !L->w_gate.data || g->n_ff < 1)) {
            free(dn);
            return -1;
        }
        if (hd > c->max_hd) c->max_hd = hd;
        const int nkv = nkv_of(g, L);
        if (nkv < 1 || g->n_head % nkv) { free(dn); return -1; }
        if (L->kv_shared) { /* another block's keys and values: an earlier one of the same kind and head size */
            const int o = L->kv_shared - 1;
            if (o >= l || L->dn.qkv.data || c->layers[o].kv_shared || c->layers[o].dn.qkv.data ||
                c->layers[o].sliding != L->sliding || hd_of(g, &c->layers[o]) != hd || L->attn_gate ||
                nkv_of(g, &c->layers[o]) != nkv_of(g, L)) { free(dn); return -1; }
            c->kv_layer[l] = c->kv_layer[o];
            if (q_width(g, L) > c->qkvd) c->qkvd = q_width(g, L);
            continue;
        }
        if (L->dn.qkv.data) {
            if (L->attn_gate || L->dn.qkv.n_cols != g->n_embd || L->dn.out.n_rows != g->n_embd) { free(dn); return -1; }
            dn[l] = &L->dn;
            c->kv_layer[l] = -1;
            continue;
        }
        c->kv_layer[l] = c->n_kv_layers++;
        if (L->sliding && (g->swa_window <= 0 || g->swa_row_cap <= 0 || !g->rope_inv_freq_swa)) { free(dn); return -1; }
        c->kv_rows[l] = L->sliding ? sk_swa_ring_rows(c->n_ctx_pad, g->swa_window, g->swa_row_cap) : c->n_ctx_pad;
        if (L->sliding) {
            if (c->swa_hd && c->swa_hd != hd) { free(dn); return -1; } /* one ring row size (sk_swa.h) */
            c->swa_hd = hd;
            c->swa_ring = c->kv_rows[l];
            c->n_swa_heads += 2 * nkv;
        }
        c->kv_off[l] = c->kv_slot_elems;
        c->kv_slot_elems += 2 * (int64_t)nkv * c->kv_rows[l] * hd;
        const int64_t w = q_width(g, L) + 2 * (int64_t)nkv * hd;
        if (L->attn_gate && (L->wq.n_rows != (L->wk.data ? q_width(g, L) : w) || g->wide_input)) { free(dn); return -1; }
        if (w > c->qkvd) c->qkvd = w;
    }
    int err = 0;
    c->dn = sk_dn_ctx_new(dn, g->n_layer, g->n_seq_max, g->rms_eps, &err);
    free(dn);
    return err;
}

/* base NULL: own threads (cfg->n_threads) and kernel table; else base's, and base lives on until this
 * context is freed (a weight of layout 1 in cfg is taken as prepared for that kernel table). */
static sk_ctx *ctx_new(const sk_config *cfg, sk_ctx *base, int kernel_cap, int head_later) {
    if ((!base && cfg->n_threads < 1) || cfg->n_ctx < 1 || cfg->n_seq_max < 1 || cfg->n_head_kv < 1 ||
        cfg->n_head % cfg->n_head_kv != 0 || cfg->n_layer < 1 || !in_proj_fits(cfg) ||
        !ctx_proj_fits(cfg))
        return NULL;
    sk_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    atomic_init(&c->refs, 1);
    c->cfg = *cfg;
    c->head_later = head_later;
    if (base) {
        atomic_fetch_add(&base->refs, 1);
        c->base = base;
        c->pool = base->pool;
        c->kern = base->kern;
        c->cfg.n_threads = sk_pool_size(base->pool);
    } else {
        c->kern = skc_pick_kernels(kernel_cap);
    }
    c->layers = malloc(sizeof(sk_layer) * (size_t)cfg->n_layer);
    c->moe = calloc((size_t)cfg->n_layer, sizeof(sk_moe *));
    c->kv = calloc((size_t)cfg->n_seq_max, sizeof(uint16_t *));
    c->att_scratch = calloc((size_t)c->cfg.n_threads, sizeof(float *));
    c->n_ctx_pad = sk_round_up(cfg->n_ctx, SK_ATTN_CHUNK); /* whole chunks: a ring's pieces map to its rows */
    c->kv_head_elems = c->n_ctx_pad * cfg->head_dim;
    if (!c->layers || !c->moe || !c->kv || !c->att_scratch) { sk_ctx_free(c); return NULL; }
    memcpy(c->layers, cfg->layers, sizeof(sk_layer) * (size_t)cfg->n_layer);
    c->cfg.layers = c->layers;
    for (int l = 0; l < cfg->n_layer; l++) {
        if (!cfg->layers[l].moe) continue;
        if (!(c->moe[l] = sk_moe_clone(cfg->layers[l].moe, cfg->n_embd))) { sk_ctx_free(c); return NULL; }
        c->layers[l].moe = c->moe[l];
    }
    if (set_up_blocks(c) != 0) { sk_ctx_free(c); return NULL; }
    if (c->swa_ring && (!(c->swa = sk_swa_new(cfg->n_seq_max, cfg->swa_window, c->swa_ring)) ||
                        !(c->swa_heads = calloc((size_t)c->n_swa_heads, sizeof(uint16_t *))))) {
        sk_ctx_free(c);
        return NULL;
    }
    for (int i = 0; i < c->cfg.n_threads; i++) {
        c->att_scratch[i] = xalloc((size_t)cfg->n_head * SK_ATTN_CHUNK * 4); /* a block's group: up to n_head */
        if (!c->att_scratch[i]) { sk_ctx_free(c); return NULL; }
    }
    if (!base) c->pool = sk_pool_new(cfg->n_threads);
    if (!c->pool || sk_pool_size(c->pool) != c->cfg.n_threads || pack_weights(c) != 0) { sk_ctx_free(c); return NULL; }
    return c;
}

SK_API sk_ctx *sk_ctx_new(const sk_config *cfg, int kernel_cap) { return ctx_new(cfg, NULL, kernel_cap, 0); }

/* As sk_ctx_new, with the output head (a small model's largest weight: 170 of Gemma 3 270M's 235 MiB) left
 * unpacked until sk_ctx_pack_head, so a caller can put that growth after another load's peak (a tokenizer
 * built meanwhile). No forward before sk_ctx_pack_head. */
SK_API sk_ctx *sk_ctx_new_head_later(const sk_config *cfg, int kernel_cap) { return ctx_new(cfg, NULL, kernel_cap, 1); }

SK_API void sk_ctx_pack_head(sk_ctx *c) {
    if (!c->head_later) return;
    c->head_later = 0;
    pack_tensor(c, &c->cfg.output);
}

/* A context over base's threads and kernel table (see the top of this file); NULL as sk_ctx_new. */
SK_API sk_ctx *sk_ctx_new_over(const sk_config *cfg, sk_ctx *base) {
    return base ? ctx_new(cfg, base, 0, 0) : NULL;
}

/* The context's config as it runs: token_embd, output and in_proj as prepared (layers: its own copy). */
SK_API void sk_ctx_config(const sk_ctx *c, sk_config *out) { *out = c->cfg; }

/* Bytes of the weight copies this context made in its kernels' layout (none for the generic table). */
SK_API int64_t sk_ctx_packed_bytes(const sk_ctx *c) { return c->packed_bytes; }

SK_API const char *sk_ctx_kernel_name(const sk_ctx *c) { return c->kern->name; }
