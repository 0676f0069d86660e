/* Sliding-window spans and Gemma-style block pieces: see sk_swa.h. */
#include "sk_swa.h"

#include <math.h>
#include <stdlib.h>

#include "sk.h"

int64_t sk_swa_ring_rows(int64_t n_ctx_pad, int32_t window, int32_t row_cap) {
    const int64_t ring = sk_round_up((int64_t)window + row_cap, SK_ATTN_CHUNK);
    return ring < n_ctx_pad ? ring : n_ctx_pad;
}

/* Where the aligned pieces start: lo itself, or past the generic first piece. */
static int64_t aligned_start(int64_t lo, int64_t hi) {
    const int64_t a = sk_round_up(lo, SK_KEY_BLOCK);
    return a < hi ? a : hi;
}

int64_t sk_span_pieces(int64_t lo, int64_t hi) {
    const int64_t a = aligned_start(lo, hi), head = a > lo;
    return head + (hi > a ? (hi - 1) / SK_ATTN_CHUNK - a / SK_ATTN_CHUNK + 1 : 0);
}

void sk_span_piece(int64_t lo, int64_t hi, int64_t k, int64_t *t0, int64_t *t1) {
    const int64_t a = aligned_start(lo, hi);
    if (a > lo) {
        if (k == 0) {
            *t0 = lo;
            *t1 = a;
            return;
        }
        k--;
    }
    const int64_t first = a / SK_ATTN_CHUNK + k;
    const int64_t s = first * SK_ATTN_CHUNK, e = s + SK_ATTN_CHUNK;
    *t0 = s > a ? s : a;
    *t1 = e < hi ? e : hi;
}

/* Where position t's dimension d lives in a ring's key layout ([t / 16][head_dim][16]). */
static int64_t key_at(int64_t ring, int head_dim, int64_t t, int d) {
    const int64_t r = t % ring;
    return (r / SK_KEY_BLOCK) * head_dim * SK_KEY_BLOCK + (int64_t)d * SK_KEY_BLOCK + r % SK_KEY_BLOCK;
}

static void copy_out(const uint16_t *k, const uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi,
                     uint16_t *dst) {
    uint16_t *dv = dst + (hi - lo) * head_dim;
    for (int64_t t = lo; t < hi; t++)
        for (int d = 0; d < head_dim; d++) {
            dst[(t - lo) * head_dim + d] = k[key_at(ring, head_dim, t, d)];
            dv[(t - lo) * head_dim + d] = v[(t % ring) * head_dim + d];
        }
}

static void copy_in(uint16_t *k, uint16_t *v, int64_t ring, int head_dim, int64_t lo, int64_t hi, const uint16_t *src) {
    const uint16_t *sv = src + (hi - lo) * head_dim;
    for (int64_t t = lo; t < hi; t++)
        for (int d = 0; d < head_dim; d++) {
            k[key_at(ring, head_dim, t, d)] = src[(t - lo) * head_dim + d];
            v[(t % ring) * head_dim + d] = sv[(t - lo) * head_dim + d];
        }
}

#define SK_SWA_SNAPS 2 /* snapshots kept per sequence, as the recurrent state keeps */

typedef struct {
    int64_t len, stamp; /* the length whose window it holds; higher stamps are newer */
    int held;           /* 0: no snapshot here */
    uint16_t *data;     /* the window's copy; NULL while the rings still hold it (sk_swa_hold copies it) */
} snap;

struct sk_swa {
    int n_seq_max;
    int32_t window;
    int64_t ring, stamp;
    int64_t *floor; /* [n_seq_max] */
    snap *snaps;    /* [n_seq_max][SK_SWA_SNAPS] */
};

sk_swa *sk_swa_new(int n_seq_max, int32_t window, int64_t ring) {
    sk_swa *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    *s = (sk_swa){n_seq_max, window, ring, 0, calloc((size_t)n_seq_max, sizeof(int64_t)),
                  calloc((size_t)n_seq_max * SK_SWA_SNAPS, sizeof(snap))};
    if (!s->floor || !s->snaps) { sk_swa_free(s); return NULL; }
    return s;
}

void sk_swa_free(sk_swa *s) {
    if (!s) return;
    for (int64_t i = 0; s->snaps && i < (int64_t)s->n_seq_max * SK_SWA_SNAPS; i++) free(s->snaps[i].data);
    free(s->snaps);
    free(s->floor);
    free(s);
}

static int bad_slot(const sk_swa *s, int slot) { return slot < 0 || slot >= s->n_seq_max; }

int64_t sk_swa_floor_of(const sk_swa *s, int slot) { return bad_slot(s, slot) ? -2 : s->floor[slot]; }

/* The window before length n: positions [max(0, n - window + 1), n). */
static int64_t window_start(const sk_swa *s, int64_t n) { return n - s->window + 1 > 0 ? n - s->window + 1 : 0; }

int sk_swa_rows_fit(const sk_swa *s, int64_t n_rows, const int32_t *pos, const int32_t *seq) {
    for (int64_t r0 = 0, r1; r0 < n_rows; r0 = r1) {
        for (r1 = r0 + 1; r1 < n_rows && seq[r1] == seq[r0]; r1++) {}
        const int64_t lo = window_start(s, pos[r0]);
        /* keys before the run from the floor on; none the run's last row overwrites */
        if ((lo < pos[r0] && lo < s->floor[seq[r0]]) || lo < (int64_t)pos[r1 - 1] - s->ring + 1) return 0;
    }
    return 1;
}

void sk_swa_rows_written(sk_swa *s, int64_t n_rows, const int32_t *pos, const int32_t *seq) {
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t gone = (int64_t)pos[r] - s->ring + 1;
        if (gone > s->floor[seq[r]]) s->floor[seq[r]] = gone;
    }
}

void sk_swa_cut(sk_swa *s, int slot, int64_t n) {
    if (bad_slot(s, slot)) return;
    if (s->floor[slot] > n) s->floor[slot] = n;
    for (int i = 0; i < SK_SWA_SNAPS; i++) {
        snap *sn = &s->snaps[slot * SK_SWA_SNAPS + i];
        if (sn->held && sn->len > n) { free(sn->data); *sn = (snap){0}; }
    }
}

void sk_swa_reset(sk_swa *s, int slot, int64_t floor) {
    if (bad_slot(s, slot)) return;
    s->floor[slot] = floor;
    for (int i = 0; i < SK_SWA_SNAPS; i++) {
        snap *sn = &s->snaps[slot * SK_SWA_SNAPS + i];
        free(sn->data);
        *sn = (snap){0};
    }
}

int sk_swa_keep(sk_swa *s, int slot, int64_t n) {
    const int64_t lo = window_start(s, n);
    if (bad_slot(s, slot) || lo < s->floor[slot]) return -2;
    snap *sn = &s->snaps[slot * SK_SWA_SNAPS], *use = sn;
    for (int i = 0; i < SK_SWA_SNAPS; i++) {
        if (sn[i].held && sn[i].len == n) return 0;
        if (!sn[i].held || (use->held && sn[i].stamp < use->stamp)) use = &sn[i];
    }
    free(use->data);
    *use = (snap){n, ++s->stamp, 1, NULL};
    return 0;
}

/* The window of snapshot sn copied out of the rings (which hold it: floor <= its start). */
static int copy_window(const sk_swa *s, snap *sn, uint16_t *const *heads, int n_heads, int head_dim) {
    const int64_t lo = window_start(s, sn->len), per_head = 2 * (sn->len - lo) * head_dim;
    uint16_t *data = malloc(sizeof(uint16_t) * (size_t)(per_head * n_heads / 2 + 1));
    if (!data) return -1;
    for (int h = 0; h + 1 < n_heads; h += 2) copy_out(heads[h], heads[h + 1], s->ring, head_dim, lo, sn->len, data + h / 2 * per_head);
    sn->data = data;
    return 0;
}

int sk_swa_hold(sk_swa *s, int slot, int64_t last_pos, uint16_t *const *heads, int n_heads, int head_dim) {
    const int64_t gone = last_pos - s->ring + 1; /* the floor once a row at last_pos is written */
    for (int i = 0; !bad_slot(s, slot) && i < SK_SWA_SNAPS; i++) {
        snap *sn = &s->snaps[slot * SK_SWA_SNAPS + i];
        if (sn->held && !sn->data && window_start(s, sn->len) < gone && copy_window(s, sn, heads, n_heads, head_dim) != 0)
            return -1;
    }
    return 0;
}

int64_t sk_swa_kept_below(const sk_swa *s, int slot, int64_t n) {
    int64_t best = -1;
    for (int i = 0; !bad_slot(s, slot) && i < SK_SWA_SNAPS; i++) {
        const snap *sn = &s->snaps[slot * SK_SWA_SNAPS + i];
        if (sn->held && sn->len <= n && sn->len > best) best = sn->len;
    }
    return best;
}

int sk_swa_bring_back(sk_swa *s, int slot, int64_t n, uint16_t *const *heads, int n_heads, int head_dim) {
    for (int i = 0; !bad_slot(s, slot) && i < SK_SWA_SNAPS; i++) {
        const snap *sn = &s->snaps[slot * SK_SWA_SNAPS + i];
        if (!sn->held || sn->len != n) continue;
        if (!sn->data) { /* not copied yet: the rings still hold the window */
            sk_swa_cut(s, slot, n);
            return 0;
        }
        const int64_t lo = window_start(s, n), per_head = 2 * (n - lo) * head_dim;
        for (int h = 0; h + 1 < n_heads; h += 2) copy_in(heads[h], heads[h + 1], s->ring, head_dim, lo, n, sn->data + h / 2 * per_head);
        sk_swa_cut(s, slot, n);
        s->floor[slot] = lo; /* the window is back; what the ring held below it is not known to be */
        return 0;
    }
    return -2;
}

/* tanh-approximated GELU as llama.cpp's graph and transformers' gelu_pytorch_tanh compute it, in float
 * with tanhf: one scalar sequence per value, the same wherever the row sits. */
void sk_geglu(const float *g, const float *u, int64_t n, float *y) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        y[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * u[i];
    }
}
