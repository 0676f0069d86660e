/* A context's scratch and a batch's attention plan, made before the threads start: scratch buffers sized for
 * the batch's rows (a dense FFN's passes of ffn_rows rows included), and the order and number of the
 * attention's work items, wave by wave of ATT_WAVE_ROWS rows (sk_model.c runs them). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "sk_ctx.h"

SKC_HIDDEN void skc_free_scratch(sk_ctx *c) {
    free(c->x); free(c->h); free(c->qkv); free(c->rope); free(c->rope_swa); /* att and gu live in qkv's block */
    free(c->ple); free(c->ple_tmp); free(c->beside);
    c->ple = c->ple_tmp = c->beside = NULL;
    free(c->act.q); free(c->act.d); free(c->act.s); free(c->act.qs16);
    c->x = c->h = c->qkv = c->att = c->gu = c->rope = c->rope_swa = NULL;
    memset(&c->act, 0, sizeof c->act);
    c->cap_rows = 0;
}

static int64_t n_waves(int64_t n_rows) { return (n_rows + ATT_WAVE_ROWS - 1) / ATT_WAVE_ROWS; }

/* First key piece of each row, and their total: a block's work items are (row, kv head, piece), so row r's
 * first is prefix[r] times the block's kv heads. */
static int64_t plan_spans(const sk_config *g, const sk_batch *b, int sliding, int64_t *prefix) {
    int64_t items = 0;
    for (int64_t r = 0; r < b->n_rows; r++) {
        prefix[r] = items;
        items += sk_span_pieces(row_first_key(g, b, r, sliding), row_keys(b, r));
    }
    prefix[b->n_rows] = items;
    return items;
}

/* The order of a block's (row, piece)s for attention: rows of one sequence that share their first key
 * (every row of a verification or a prompt chunk, outside a sliding window) go piece by piece, each
 * piece for all those rows in turn, so a piece's keys and values are read from memory once and then
 * from the core's cache for the other rows. Each (row, piece) is computed as alone: the order changes
 * what is cached, never a result. Returns the number of entries. */
static int64_t plan_order(const sk_config *g, const sk_batch *b, int sliding, const int64_t *prefix, sk_att_item *out,
                          int64_t r_begin, int64_t r_end) {
    int64_t n = 0;
    for (int64_t r0 = r_begin, r1; r0 < r_end; r0 = r1) {
        const int64_t lo = row_first_key(g, b, r0, sliding);
        int64_t pieces = prefix[r0 + 1] - prefix[r0];
        for (r1 = r0 + 1; r1 < r_end && b->seq[r1] == b->seq[r0] && row_first_key(g, b, r1, sliding) == lo; r1++)
            if (prefix[r1 + 1] - prefix[r1] > pieces) pieces = prefix[r1 + 1] - prefix[r1];
        for (int64_t k = 0; k < pieces; k++)
            for (int64_t r = r0; r < r1; r++)
                if (k < prefix[r + 1] - prefix[r]) out[n++] = (sk_att_item){(int32_t)r, (int32_t)k};
    }
    return n;
}

/* Orders of a batch's (row, piece)s wave by wave (rows [w W, (w + 1) W)), into wave_at; the most pieces
 * one wave holds. */
static int64_t plan_waves(const sk_config *g, const sk_batch *b, int sliding, const int64_t *prefix,
                          sk_att_item *order, int64_t *wave_at, int64_t waves) {
    int64_t at = 0, most = 0;
    for (int64_t w = 0; w < waves; w++) {
        const int64_t g0 = w * ATT_WAVE_ROWS, g1 = wave_end(b, w);
        wave_at[w] = at;
        at += plan_order(g, b, sliding, prefix, order + at, g0, g1);
        if (prefix[g1] - prefix[g0] > most) most = prefix[g1] - prefix[g0];
    }
    wave_at[waves] = at;
    return most;
}

/* Work items of a batch's attention: (row, kv head, key chunk), numbered row by row. They run in waves of
 * ATT_WAVE_ROWS rows, each merged before the next starts, so the chunk partials take one wave's rows: a
 * 256-row prompt chunk of Ministral 3 held 8.5 MB of them at once, now 2.1. Each item is computed as
 * alone, so the waves change no result. */
SKC_HIDDEN int skc_plan_attention(sk_ctx *c, const sk_batch *b) {
    const sk_config *g = &c->cfg;
    if (b->n_rows + 1 > c->att_rows_cap) {
        free(c->att_prefix);
        free(c->att_prefix_swa);
        free(c->att_wave_at);
        free(c->att_wave_at_swa);
        const size_t waves_cap = (size_t)(n_waves(b->n_rows) + 1);
        c->att_prefix = malloc(sizeof(int64_t) * (size_t)(b->n_rows + 1));
        c->att_prefix_swa = g->swa_window > 0 ? malloc(sizeof(int64_t) * (size_t)(b->n_rows + 1)) : NULL;
        c->att_wave_at = malloc(sizeof(int64_t) * waves_cap);
        c->att_wave_at_swa = g->swa_window > 0 ? malloc(sizeof(int64_t) * waves_cap) : NULL;
        c->att_rows_cap = c->att_prefix && c->att_wave_at &&
                          (g->swa_window <= 0 || (c->att_prefix_swa && c->att_wave_at_swa)) ? b->n_rows + 1 : 0;
        if (!c->att_rows_cap) return -1;
    }
    int64_t items = plan_spans(g, b, 0, c->att_prefix);
    if (g->swa_window > 0) {
        int64_t items_swa = plan_spans(g, b, 1, c->att_prefix_swa);
        if (items_swa > items) items = items_swa;
    }
    if (items > c->att_order_cap) {
        free(c->att_order);
        free(c->att_order_swa);
        c->att_order = malloc(sizeof(sk_att_item) * (size_t)items);
        c->att_order_swa = g->swa_window > 0 ? malloc(sizeof(sk_att_item) * (size_t)items) : NULL;
        c->att_order_cap = c->att_order && (g->swa_window <= 0 || c->att_order_swa) ? items : 0;
        if (!c->att_order_cap) return -1;
    }
    c->att_waves = n_waves(b->n_rows);
    int64_t wave_items = plan_waves(g, b, 0, c->att_prefix, c->att_order, c->att_wave_at, c->att_waves);
    if (g->swa_window > 0) {
        const int64_t swa_items = plan_waves(g, b, 1, c->att_prefix_swa, c->att_order_swa, c->att_wave_at_swa,
                                             c->att_waves);
        if (swa_items > wave_items) wave_items = swa_items;
    }
    const int64_t hd = c->max_hd > g->head_dim ? c->max_hd : g->head_dim; /* sk_test_attend sets only the latter */
    int64_t need = wave_items * g->n_head * (hd + 2); /* kv heads x their query heads: n_head partials per piece */
    if (need > c->att_parts_cap) {
        free(c->att_parts);
        c->att_parts = xalloc((size_t)need * 4);
        c->att_parts_cap = c->att_parts ? need : 0;
        if (!c->att_parts) return -1;
    }
    return 0;
}

SKC_HIDDEN int skc_ensure_scratch(sk_ctx *c, int64_t m) {
    if (m <= c->cap_rows) return 0;
    skc_free_scratch(c);
    const sk_config *g = &c->cfg;
    /* h: a block's normed input, its attention output projected, ...; not the FFN's activation rows, which
     * replace their gate rows in gu (the quantized activations below still take n_ff) */
    int64_t qd = (int64_t)g->n_head * c->max_hd, wide = g->n_embd > qd ? g->n_embd : qd;
    if ((g->in_proj.data || g->wide_input) && 2 * (int64_t)g->n_embd > wide) wide = 2 * (int64_t)g->n_embd; /* [e; h] */
    if (g->wide_input && g->in_proj.data && g->in_proj.n_cols > wide) wide = g->in_proj.n_cols; /* the encoder's input */
    if (g->ctx_proj.data && g->ctx_proj.n_cols > wide) wide = g->ctx_proj.n_cols; /* the context encoder's input */
    for (int l = 0; l < g->n_layer; l++) /* a delta-net block's ssm_out input */
        if (g->layers[l].dn.out.n_cols > wide) wide = g->layers[l].dn.out.n_cols;
    c->x = malloc((size_t)(m * g->n_embd) * 4);
    c->h = malloc((size_t)(m * wide) * 4);
    /* gu (n_ff 0: every block is MoE; a post-normed FFN's down projection lands here too, n_embd wide) shares
     * one block with qkv and att: an FFN starts after the output projection's closing barrier, when no
     * thread reads a block's q/k/v or attention rows any more, and the next block's q/k/v projection writes
     * after the barrier that closes the FFN. ~40 KB a row less on Ministral 3's widths. Where the gate/up
     * rows are the wider, a long batch's dense FFN runs in passes of ffn_rows rows that fit the block (a
     * row's products do not depend on the rows beside it): Ministral 3's 256-row prompt chunk in two passes,
     * 8 MB less at its peak, and no pass split for a verification's rows. */
    const int64_t gu_w = 2 * g->n_ff > g->n_embd ? 2 * g->n_ff : g->n_embd;
    const int64_t qkv_att_w = c->qkvd + qd;
    int beside = 0; /* Gemma 4's dense half beside the experts runs over all rows at once */
    for (int l = 0; l < g->n_layer; l++) beside |= g->layers[l].moe_pre_norm != 0;
    c->ffn_rows = gu_w > qkv_att_w && !beside ? m * qkv_att_w / gu_w : m;
    if (c->ffn_rows < 1) c->ffn_rows = 1;
    const int64_t block_w = c->ffn_rows * gu_w > m * qkv_att_w ? c->ffn_rows * gu_w : m * qkv_att_w;
    /* the quantized activations: a block's input rows (wide), or one FFN pass's activation rows (n_ff) */
    const int64_t kp_in = sk_round_up(wide, 64), kp_ff = sk_round_up(g->n_ff, 64);
    const int64_t act_rows_kp = m * kp_in > c->ffn_rows * kp_ff ? m * kp_in : c->ffn_rows * kp_ff;
    c->qkv = malloc((size_t)block_w * 4);
    c->att = c->qkv ? c->qkv + m * c->qkvd : NULL;
    c->gu = c->qkv;
    c->rope = malloc((size_t)(m * g->n_rot) * 4);
    c->rope_swa = g->rope_inv_freq_swa ? malloc((size_t)(m * n_rot_swa(g)) * 4) : NULL;
    for (int l = 0; l < g->n_layer; l++)
        if (g->layers[l].moe_pre_norm && !c->beside && !(c->beside = malloc((size_t)(3 * m * g->n_embd) * 4))) {
            skc_free_scratch(c);
            return -1;
        }
    const int64_t ple_w = (int64_t)g->n_layer * g->n_embd_per_layer;
    if (ple_w) {
        c->ple = malloc((size_t)(m * ple_w) * 4);
        c->ple_tmp = malloc((size_t)(m * ple_w) * 4);
        if (!c->ple || !c->ple_tmp) { skc_free_scratch(c); return -1; }
    }
    c->act.q = xalloc((size_t)act_rows_kp);
    c->act.d = xalloc((size_t)(act_rows_kp / 8));
    c->act.s = xalloc((size_t)(act_rows_kp / 8));
    c->act.qs16 = xalloc((size_t)(act_rows_kp / 4));
    if (!c->x || !c->h || !c->qkv || !c->att || !c->gu || !c->rope || !c->act.q || !c->act.d || !c->act.s ||
        !c->act.qs16 || (g->rope_inv_freq_swa && !c->rope_swa)) {
        skc_free_scratch(c);
        return -1;
    }
    c->cap_rows = m;
    return 0;
}
