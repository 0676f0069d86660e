/* A sequence's keys, values and recurrent state as the calls outside the forward reach them: a slot's cache
 * allocated and released, a context shift, the sliding blocks' rings (sk_swa.h) and the recurrent state of
 * hybrid models (sk_deltanet.h) truncated, snapshot and restored, a slot's state exported and imported, and
 * the two hooks Gemma 4's assistant reads a target through. */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sk_assistant.h"
#include "sk_ctx.h"
#include "sk_step.h"

/* Keys and values of one sequence, all layers. calloc: pages become resident only when written. */
SK_API int sk_kv_alloc(sk_ctx *c, int slot) {
    if (slot < 0 || slot >= c->cfg.n_seq_max) return -1;
    if (c->kv[slot]) return 0;
    size_t n = (size_t)c->kv_slot_elems;
    c->kv[slot] = calloc(n > 0 ? n : 1, sizeof(uint16_t));
    if (c->swa) sk_swa_cut(c->swa, slot, 0);
    if (c->kv[slot] && c->dn && sk_dn_state_alloc(c->dn, slot) != 0) { free(c->kv[slot]); c->kv[slot] = NULL; }
    return c->kv[slot] ? 0 : -1;
}

SK_API void sk_kv_release(sk_ctx *c, int slot) {
    if (slot < 0 || slot >= c->cfg.n_seq_max) return;
    free(c->kv[slot]);
    c->kv[slot] = NULL;
    if (c->swa) sk_swa_cut(c->swa, slot, 0);
    if (c->dn) sk_dn_state_free(c->dn, slot);
}

/* Context shift of one slot (a server's --context-shift): positions [n_keep, n_keep + n_discard) leave the
 * cache and positions [n_keep + n_discard, n_past) move down by n_discard. Keys are re-roped by -n_discard
 * (a pure rotation: angles add per frequency, and YaRN's magnitude is already in the stored keys), in
 * float32 from the stored float16 and rounded back once, as llama.cpp's K-shift does; values are moved.
 * Only full-context attention blocks: -1 for a model with sliding-window rings or a recurrent state,
 * a bad slot or bad bounds. */
SK_API int sk_kv_shift(sk_ctx *c, int slot, int64_t n_keep, int64_t n_discard, int64_t n_past) {
    const sk_config *g = &c->cfg;
    if (slot < 0 || slot >= g->n_seq_max || !c->kv[slot] || c->swa || c->dn) return -1;
    if (n_keep < 0 || n_discard < 0 || n_keep + n_discard > n_past || n_past > c->n_ctx_pad) return -1;
    if (n_discard == 0) return 0;
    const int n_rot = g->n_rot, half = n_rot / 2;
    float *cs = malloc(sizeof(float) * (size_t)(n_rot > 0 ? n_rot : 1)), *k = malloc(sizeof(float) * (size_t)c->max_hd);
    if (!cs || !k) { free(cs); free(k); return -1; }
    for (int i = 0; i < half; i++) { /* the same rotation for every moved row: cos and sin of -n_discard * freq */
        const double th = -(double)n_discard * g->rope_inv_freq[i];
        cs[i] = (float)cos(th);
        cs[half + i] = (float)sin(th);
    }
    for (int l = 0; l < g->n_layer; l++) {
        const sk_layer *L = &c->layers[l];
        if (L->kv_shared || L->dn.qkv.data) continue; /* another block's cache, or no cache */
        const int hd = hd_of(g, L), nkv = nkv_of(g, L);
        for (int h = 0; h < nkv; h++) {
            uint16_t *kc = kcache(c, slot, l, h), *vc = vcache(c, slot, l, h);
            for (int64_t t = n_keep + n_discard; t < n_past; t++) { /* ascending: a row moves below its source */
                const int64_t to = t - n_discard;
                uint16_t *ks = kc + (t / SK_KEY_BLOCK) * hd * SK_KEY_BLOCK + t % SK_KEY_BLOCK;
                uint16_t *kd = kc + (to / SK_KEY_BLOCK) * hd * SK_KEY_BLOCK + to % SK_KEY_BLOCK;
                for (int d = 0; d < hd; d++) k[d] = sk_f16_to_f32(ks[d * SK_KEY_BLOCK]);
                rope_head(k, cs, n_rot, g->rope_neox);
                for (int d = 0; d < hd; d++) kd[d * SK_KEY_BLOCK] = sk_f32_to_f16(k[d]);
                memmove(vc + to * hd, vc + t * hd, sizeof(uint16_t) * (size_t)hd);
            }
        }
    }
    free(cs);
    free(k);
    return 0;
}

/* ---- the sliding blocks' rings of a sequence (sk_swa.h); -2 for a context without them or a bad slot --- */

/* c->swa_heads filled with the slot's rings, in sk_swa.h's order; their count. */
SKC_HIDDEN int skc_swa_heads(sk_ctx *c, int slot) {
    int n = 0;
    for (int l = 0; l < c->cfg.n_layer; l++)
        for (int h = 0; c->layers[l].sliding && !c->layers[l].kv_shared && h < nkv_of(&c->cfg, &c->layers[l]); h++) {
            c->swa_heads[n++] = kcache(c, slot, l, h);
            c->swa_heads[n++] = vcache(c, slot, l, h);
        }
    return n;
}

static int has_rings(const sk_ctx *c, int slot) { return c->swa && slot >= 0 && slot < c->cfg.n_seq_max && c->kv[slot]; }

/* Gemma 4's assistant (sk_assistant.c) reads the target's tables and caches through these two. */
int sk_assistant_target(const sk_ctx *c, sk_target_view *out) {
    const sk_config *g = &c->cfg;
    if (!g->rope_inv_freq || g->in_proj.data || g->wide_input || g->ctx_proj.data) return -1;
    *out = (sk_target_view){c->kern, c->pool, &g->token_embd, g->n_embd, g->n_vocab, g->n_seq_max, g->swa_window,
                            g->rope_neox, g->n_rot, n_rot_swa(g), g->rope_inv_freq,
                            g->rope_inv_freq_swa ? g->rope_inv_freq_swa : g->rope_inv_freq, g->rope_mscale};
    return 0;
}

int sk_assistant_kv(const sk_ctx *c, int slot, int layer, int64_t lo, int64_t hi, sk_kv_view *out) {
    if (slot < 0 || slot >= c->cfg.n_seq_max || !c->kv[slot] || layer < 0 || layer >= c->cfg.n_layer ||
        c->kv_layer[layer] < 0 || c->layers[layer].kv_shared)
        return -1;
    const sk_layer *L = &c->layers[layer];
    if (lo < 0 || hi <= lo || hi > c->n_ctx_pad || hi - lo > c->kv_rows[layer] ||
        (L->sliding && sk_swa_floor_of(c->swa, slot) > lo))
        return -2;
    const int hd = hd_of(&c->cfg, L), nkv = nkv_of(&c->cfg, L);
    uint16_t *k = kcache((sk_ctx *)c, slot, layer, 0);
    *out = (sk_kv_view){k, k + (int64_t)nkv * c->kv_rows[layer] * hd, c->kv_rows[layer] * hd, c->kv_rows[layer], hd, nkv};
    return 0;
}

SK_API int64_t sk_swa_floor(const sk_ctx *c, int slot) { return has_rings(c, slot) ? sk_swa_floor_of(c->swa, slot) : -2; }

SK_API void sk_swa_truncate(sk_ctx *c, int slot, int64_t n) {
    if (has_rings(c, slot)) sk_swa_cut(c->swa, slot, n);
}

SK_API int sk_swa_snapshot(sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_keep(c->swa, slot, n) : -2;
}

SK_API int64_t sk_swa_snapshot_at(const sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_kept_below(c->swa, slot, n) : -2;
}

SK_API int sk_swa_restore(sk_ctx *c, int slot, int64_t n) {
    return has_rings(c, slot) ? sk_swa_bring_back(c->swa, slot, n, c->swa_heads, skc_swa_heads(c, slot), c->swa_hd) : -2;
}

/* ---- the recurrent state of hybrid models (sk_deltanet.h); -2 for a context without one or a bad slot --- */

static int has_state(const sk_ctx *c, int slot) {
    return c->dn && slot >= 0 && slot < c->cfg.n_seq_max && sk_dn_has_state(c->dn, slot);
}

SK_API int sk_rs_checkpoint(sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_checkpoint(c->dn, slot) : -2; }

SK_API int sk_rs_snapshot(sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_snapshot(c->dn, c->kern, c->pool, slot) : -2; }

SK_API int64_t sk_rs_restorable(const sk_ctx *c, int slot, int64_t n) {
    return has_state(c, slot) ? sk_dn_restorable(c->dn, slot, n) : -2;
}

SK_API int sk_rs_truncate(sk_ctx *c, int slot, int64_t n) {
    return has_state(c, slot) ? sk_dn_truncate(c->dn, slot, n) : -2;
}

SK_API int64_t sk_rs_length(const sk_ctx *c, int slot) { return has_state(c, slot) ? sk_dn_length(c->dn, slot) : -2; }

/* ---- a sequence's state as a slot file carries it (backends/native/backend.py: export_seq / import_seq) ---- */

/* Rows [0, n) of a KV block as stored: whole groups of 16 keys (the key layout's), a ring whole once n passes it. */
static int64_t kv_rows_of(const sk_ctx *c, int layer, int64_t n) {
    const int64_t r = sk_round_up(n, 16);
    return r < c->kv_rows[layer] ? r : c->kv_rows[layer];
}

/* uint16 values sk_kv_copy moves for length n: every KV-owning block's keys then values, head by head. */
SK_API int64_t sk_kv_state_elems(const sk_ctx *c, int64_t n) {
    int64_t total = 0;
    for (int l = 0; l < c->cfg.n_layer; l++)
        if (c->kv_rows[l] > 0)
            total += 2 * (int64_t)nkv_of(&c->cfg, &c->layers[l]) * kv_rows_of(c, l, n) * hd_of(&c->cfg, &c->layers[l]);
    return total;
}

/* A slot's KV rows [0, n) into buf (to_buf) or from it: values moved, or -2 for a bad slot, n or size. */
SK_API int64_t sk_kv_copy(sk_ctx *c, int slot, int64_t n, uint16_t *buf, int64_t cap, int to_buf) {
    if (slot < 0 || slot >= c->cfg.n_seq_max || !c->kv[slot] || n < 0 || n > c->cfg.n_ctx ||
        cap != sk_kv_state_elems(c, n))
        return -2;
    int64_t o = 0;
    for (int l = 0; l < c->cfg.n_layer; l++) {
        if (c->kv_rows[l] <= 0) continue; /* a recurrent block, or one reading another block's KV */
        const int nkv = nkv_of(&c->cfg, &c->layers[l]);
        const int64_t rows = kv_rows_of(c, l, n), hd = hd_of(&c->cfg, &c->layers[l]);
        for (int h = 0; h < 2 * nkv; h++) { /* keys of every head, then values */
            uint16_t *at = c->kv[slot] + c->kv_off[l] + (int64_t)h * c->kv_rows[l] * hd;
            if (to_buf) memcpy(buf + o, at, sizeof(uint16_t) * (size_t)(rows * hd));
            else memcpy(at, buf + o, sizeof(uint16_t) * (size_t)(rows * hd));
            o += rows * hd;
        }
    }
    return o;
}

SK_API int64_t sk_rs_state_floats(const sk_ctx *c) { return c->dn ? sk_dn_state_floats(c->dn) : 0; }

SK_API int64_t sk_rs_export(sk_ctx *c, int slot, float *out, int64_t cap) {
    return has_state(c, slot) ? sk_dn_export(c->dn, c->kern, c->pool, slot, out, cap) : -2;
}

SK_API int sk_rs_import(sk_ctx *c, int slot, const float *in, int64_t n_floats, int64_t n) {
    return has_state(c, slot) ? sk_dn_import(c->dn, slot, in, n_floats, n) : -2;
}

SK_API void sk_swa_reset_slot(sk_ctx *c, int slot, int64_t floor) {
    if (c->swa && slot >= 0 && slot < c->cfg.n_seq_max && c->kv[slot]) sk_swa_reset(c->swa, slot, floor);
}

/* Block `layer`'s live state of a slot ([S | conv rows]) into out[cap], for tests: floats written or -1. */
SK_API int64_t sk_rs_read(sk_ctx *c, int slot, int layer, float *out, int64_t cap) {
    return has_state(c, slot) ? sk_dn_read_state(c->dn, c->kern, c->pool, slot, layer, out, cap) : -1;
}
