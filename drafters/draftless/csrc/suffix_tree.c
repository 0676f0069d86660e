/* A depth-bounded suffix tree with occurrence counts, for the suffix drafter (drafters/draftless/suffix.py).
 *
 * The tree holds every substring of at most `max_depth` tokens of the sequences added to it; a
 * node's count is how many times its substring occurs in them. Sequences grow one token at a
 * time (each new token extends the up-to-max_depth suffixes that end before it, so an append
 * costs O(max_depth)), and a whole sequence can be removed again, which is how the caller bounds
 * memory: it evicts its oldest sequences when the node count passes a cap.
 *
 * Nodes live in flat arrays with sibling lists for their children; edges (parent, token) ->
 * child are found through one open-addressing hash table with backward-shift deletion. Node 0 is
 * the root. All sizes are int32: a tree is refused more than 2^30 nodes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NONE (-1)

typedef struct st_tree {
    int32_t max_depth;
    /* nodes */
    int32_t n_nodes, cap_nodes, n_live;
    int32_t *count, *depth, *parent, *token, *first_child, *next_sib, *prev_sib;
    int32_t free_head; /* free list through next_sib */
    /* edges: keys (parent << 32 | token) + 1, 0 = empty slot */
    uint64_t *keys;
    int32_t *vals;
    int64_t cap_edges, n_edges;
    /* sequences: tokens and the nodes of the suffixes that can still grow */
    int32_t n_seqs, cap_seqs;
    struct seq {
        int32_t live;
        int32_t *toks;
        int64_t n, cap;
        int32_t *active; /* nodes of suffixes ending at the last token, depth < max_depth */
        int32_t n_active;
    } *seqs;
} st_tree;

static uint64_t edge_key(int32_t parent, int32_t tok) {
    return (((uint64_t)(uint32_t)parent << 32) | (uint32_t)tok) + 1;
}

static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static int edges_grow(st_tree *t) {
    int64_t old_cap = t->cap_edges, cap = old_cap ? old_cap * 2 : 1024;
    uint64_t *keys = calloc((size_t)cap, sizeof *keys);
    int32_t *vals = malloc((size_t)cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    for (int64_t i = 0; i < old_cap; i++) {
        if (!t->keys[i]) continue;
        int64_t j = (int64_t)(mix(t->keys[i]) & (uint64_t)(cap - 1));
        while (keys[j]) j = (j + 1) & (cap - 1);
        keys[j] = t->keys[i];
        vals[j] = t->vals[i];
    }
    free(t->keys);
    free(t->vals);
    t->keys = keys;
    t->vals = vals;
    t->cap_edges = cap;
    return 0;
}

static int32_t edge_get(const st_tree *t, int32_t parent, int32_t tok) {
    uint64_t k = edge_key(parent, tok);
    int64_t mask = t->cap_edges - 1, j = (int64_t)(mix(k) & (uint64_t)mask);
    while (t->keys[j]) {
        if (t->keys[j] == k) return t->vals[j];
        j = (j + 1) & mask;
    }
    return NONE;
}

static int edge_put(st_tree *t, int32_t parent, int32_t tok, int32_t child) {
    if ((t->n_edges + 1) * 10 > t->cap_edges * 7 && edges_grow(t) != 0) return -1;
    uint64_t k = edge_key(parent, tok);
    int64_t mask = t->cap_edges - 1, j = (int64_t)(mix(k) & (uint64_t)mask);
    while (t->keys[j]) j = (j + 1) & mask;
    t->keys[j] = k;
    t->vals[j] = child;
    t->n_edges++;
    return 0;
}

static void edge_del(st_tree *t, int32_t parent, int32_t tok) {
    uint64_t k = edge_key(parent, tok);
    int64_t mask = t->cap_edges - 1, j = (int64_t)(mix(k) & (uint64_t)mask);
    while (t->keys[j] && t->keys[j] != k) j = (j + 1) & mask;
    if (!t->keys[j]) return;
    /* backward-shift deletion keeps every probe sequence unbroken */
    int64_t hole = j;
    for (int64_t i = (j + 1) & mask; t->keys[i]; i = (i + 1) & mask) {
        int64_t home = (int64_t)(mix(t->keys[i]) & (uint64_t)mask);
        if (((i - home) & mask) >= ((i - hole) & mask)) {
            t->keys[hole] = t->keys[i];
            t->vals[hole] = t->vals[i];
            hole = i;
        }
    }
    t->keys[hole] = 0;
    t->n_edges--;
}

static int nodes_grow(st_tree *t) {
    int32_t cap = t->cap_nodes ? t->cap_nodes * 2 : 1024;
    if (cap > (1 << 30)) return -1;
    int32_t **arrays[] = {&t->count, &t->depth, &t->parent, &t->token, &t->first_child, &t->next_sib, &t->prev_sib};
    for (size_t a = 0; a < sizeof arrays / sizeof *arrays; a++) {
        int32_t *p = realloc(*arrays[a], (size_t)cap * sizeof(int32_t));
        if (!p) return -1;
        *arrays[a] = p;
    }
    t->cap_nodes = cap;
    return 0;
}

static int32_t node_new(st_tree *t, int32_t parent, int32_t tok) {
    int32_t n;
    if (t->free_head != NONE) {
        n = t->free_head;
        t->free_head = t->next_sib[n];
    } else {
        if (t->n_nodes == t->cap_nodes && nodes_grow(t) != 0) return NONE;
        n = t->n_nodes++;
    }
    if (edge_put(t, parent, tok, n) != 0) {
        t->next_sib[n] = t->free_head;
        t->free_head = n;
        return NONE;
    }
    t->count[n] = 0;
    t->depth[n] = t->depth[parent] + 1;
    t->parent[n] = parent;
    t->token[n] = tok;
    t->first_child[n] = NONE;
    t->prev_sib[n] = NONE;
    t->next_sib[n] = t->first_child[parent];
    if (t->first_child[parent] != NONE) t->prev_sib[t->first_child[parent]] = n;
    t->first_child[parent] = n;
    t->n_live++;
    return n;
}

static void node_free(st_tree *t, int32_t n) {
    int32_t p = t->parent[n];
    edge_del(t, p, t->token[n]);
    if (t->prev_sib[n] != NONE) t->next_sib[t->prev_sib[n]] = t->next_sib[n];
    else t->first_child[p] = t->next_sib[n];
    if (t->next_sib[n] != NONE) t->prev_sib[t->next_sib[n]] = t->prev_sib[n];
    t->next_sib[n] = t->free_head;
    t->free_head = n;
    t->n_live--;
}

void st_free(st_tree *t);

st_tree *st_new(int32_t max_depth) {
    if (max_depth < 1 || max_depth > 1024) return NULL;
    st_tree *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->max_depth = max_depth;
    t->free_head = NONE;
    if (nodes_grow(t) != 0 || edges_grow(t) != 0) {
        st_free(t);
        return NULL;
    }
    t->n_nodes = 1;
    t->n_live = 1;
    t->count[0] = 0;
    t->depth[0] = 0;
    t->parent[0] = NONE;
    t->token[0] = NONE;
    t->first_child[0] = t->next_sib[0] = t->prev_sib[0] = NONE;
    return t;
}

void st_free(st_tree *t) {
    if (!t) return;
    free(t->count);
    free(t->depth);
    free(t->parent);
    free(t->token);
    free(t->first_child);
    free(t->next_sib);
    free(t->prev_sib);
    free(t->keys);
    free(t->vals);
    for (int32_t i = 0; i < t->n_seqs; i++) {
        free(t->seqs[i].toks);
        free(t->seqs[i].active);
    }
    free(t->seqs);
    free(t);
}

int64_t st_nodes(const st_tree *t) { return t->n_live; }

/* A new, empty sequence; its handle, or -1 when out of memory. Handles of removed sequences are reused. */
int32_t st_seq_new(st_tree *t) {
    int32_t h = NONE;
    for (int32_t i = 0; i < t->n_seqs; i++)
        if (!t->seqs[i].live) {
            h = i;
            break;
        }
    if (h == NONE) {
        if (t->n_seqs == t->cap_seqs) {
            int32_t cap = t->cap_seqs ? t->cap_seqs * 2 : 16;
            struct seq *s = realloc(t->seqs, (size_t)cap * sizeof *s);
            if (!s) return NONE;
            t->seqs = s;
            t->cap_seqs = cap;
        }
        h = t->n_seqs++;
        memset(&t->seqs[h], 0, sizeof t->seqs[h]);
    }
    struct seq *s = &t->seqs[h];
    if (!s->active) s->active = malloc((size_t)t->max_depth * sizeof(int32_t));
    if (!s->active) return NONE;
    s->live = 1;
    s->n = 0;
    s->n_active = 0;
    return h;
}

/* Append tokens to a sequence: 0, or -1 when out of memory (the tokens before the failing one stay). */
int st_seq_append(st_tree *t, int32_t h, const int32_t *toks, int64_t n) {
    if (h < 0 || h >= t->n_seqs || !t->seqs[h].live) return -1;
    struct seq *s = &t->seqs[h];
    if (s->n + n > s->cap) {
        int64_t cap = s->cap ? s->cap : 256;
        while (cap < s->n + n) cap *= 2;
        int32_t *p = realloc(s->toks, (size_t)cap * sizeof *p);
        if (!p) return -1;
        s->toks = p;
        s->cap = cap;
    }
    int32_t *next = malloc((size_t)t->max_depth * sizeof *next);
    if (!next) return -1;
    for (int64_t i = 0; i < n; i++) {
        int32_t tok = toks[i], n_next = 0;
        /* extend the suffixes ending before this token, then the one that starts with it */
        for (int32_t a = -1; a < s->n_active; a++) {
            int32_t from = a < 0 ? 0 : s->active[a];
            int32_t child = edge_get(t, from, tok);
            if (child == NONE) child = node_new(t, from, tok);
            if (child == NONE) {
                free(next);
                return -1;
            }
            t->count[child]++;
            if (t->depth[child] < t->max_depth) next[n_next++] = child;
        }
        memcpy(s->active, next, (size_t)n_next * sizeof *next);
        s->n_active = n_next;
        s->toks[s->n++] = tok;
    }
    free(next);
    return 0;
}

/* Remove a sequence: every count it added goes back, and nodes no sequence uses any more are freed. */
void st_seq_remove(st_tree *t, int32_t h) {
    if (h < 0 || h >= t->n_seqs || !t->seqs[h].live) return;
    struct seq *s = &t->seqs[h];
    int32_t *path = malloc((size_t)t->max_depth * sizeof *path);
    for (int64_t i = 0; path && i < s->n; i++) {
        int32_t node = 0, len = 0;
        for (int64_t j = i; j < s->n && j - i < t->max_depth; j++) {
            node = edge_get(t, node, s->toks[j]);
            if (node == NONE) break; /* cannot happen for a sequence that was fully appended */
            t->count[node]--;
            path[len++] = node;
        }
        for (int32_t k = len - 1; k >= 0; k--) /* deepest first: a freed node has no children left */
            if (t->count[path[k]] <= 0) node_free(t, path[k]);
    }
    free(path);
    s->live = 0;
    s->n = 0;
    s->n_active = 0;
}

int64_t st_seq_len(const st_tree *t, int32_t h) {
    return (h >= 0 && h < t->n_seqs && t->seqs[h].live) ? t->seqs[h].n : -1;
}

/* A sequence's tokens (its length in *n), or NULL for a handle that is not live. */
const int32_t *st_seq_tokens(const st_tree *t, int32_t h, int64_t *n) {
    if (h < 0 || h >= t->n_seqs || !t->seqs[h].live) return NULL;
    *n = t->seqs[h].n;
    return t->seqs[h].toks;
}

/* The node of ctx[0..n) (walked from the root), or NONE. */
static int32_t walk(const st_tree *t, const int32_t *ctx, int32_t n) {
    int32_t node = 0;
    for (int32_t i = 0; i < n && node != NONE; i++) node = edge_get(t, node, ctx[i]);
    return node;
}

/* The most promising continuation of the context `ctx[0..n_ctx)`.
 *
 * For every match length m (1 .. max_depth - 1, at least `min_match`) whose last-m-token suffix is in
 * the tree, follow the most frequent child from its node while the probability that the whole
 * continuation so far is right (the product of count(child) / count(parent)) stays >= min_prob,
 * for at most floor(m * factor) and `max_spec` tokens. `self_count` is subtracted from the matched
 * node's count (1 when ctx itself was added to this tree: its own occurrence has no continuation).
 * The continuation with the largest expected number of correct tokens (the sum of those
 * probabilities) wins; ties go to the longer match. Returns its length; `out_tokens`/`out_probs`
 * get the tokens and cumulative probabilities, `out_match` the match length. */
int32_t st_speculate(const st_tree *t, const int32_t *ctx, int32_t n_ctx, int32_t max_spec, float factor,
                     float min_prob, int32_t min_match, int32_t self_count, int32_t *out_tokens,
                     float *out_probs, float *out_score, int32_t *out_match) {
    float best_score = 0.0f;
    int32_t best_len = 0, best_match = 0;
    int32_t *toks = malloc((size_t)(max_spec > 0 ? max_spec : 1) * sizeof *toks);
    float *probs = malloc((size_t)(max_spec > 0 ? max_spec : 1) * sizeof *probs);
    if (!toks || !probs || max_spec <= 0) goto done;
    int32_t longest = n_ctx < t->max_depth - 1 ? n_ctx : t->max_depth - 1;
    /* A suffix of the context occurs at most as often as every shorter one (each occurrence of it ends
     * with an occurrence of the shorter), so the longest one occurring more than self_count times is
     * found by bisection. Longer ones have no continuation to give, and walking them all cost most
     * of a call on open-ended text, where the context's own occurrence makes every suffix present. */
    int32_t lo = 0, hi = longest;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        int32_t node = walk(t, ctx + n_ctx - mid, mid);
        if (node != NONE && t->count[node] > self_count) lo = mid;
        else hi = mid - 1;
    }
    longest = lo;
    for (int32_t m = longest; m >= (min_match > 1 ? min_match : 1); m--) {
        int32_t node = walk(t, ctx + n_ctx - m, m);
        if (node == NONE) continue;
        int32_t limit = (int32_t)((float)m * factor);
        if (limit > max_spec) limit = max_spec;
        if (limit < 1) limit = 1;
        float p = 1.0f, score = 0.0f;
        int32_t len = 0, first = 1;
        while (len < limit && t->depth[node] < t->max_depth) {
            int32_t total = t->count[node] - (first ? self_count : 0), best = NONE;
            for (int32_t c = t->first_child[node]; c != NONE; c = t->next_sib[c])
                if (best == NONE || t->count[c] > t->count[best] ||
                    (t->count[c] == t->count[best] && t->token[c] < t->token[best]))
                    best = c;
            if (best == NONE || total <= 0) break;
            float q = (float)t->count[best] / (float)total;
            if (q > 1.0f) q = 1.0f;
            if (p * q < min_prob) break;
            p *= q;
            toks[len] = t->token[best];
            probs[len] = p;
            score += p;
            len++;
            node = best;
            first = 0;
        }
        if (len > 0 && score > best_score) {
            best_score = score;
            best_len = len;
            best_match = m;
            memcpy(out_tokens, toks, (size_t)len * sizeof *toks);
            memcpy(out_probs, probs, (size_t)len * sizeof *probs);
        }
    }
done:
    free(toks);
    free(probs);
    *out_score = best_score;
    *out_match = best_match;
    return best_len;
}

/* How often tokens[0..n) occurs in the tree's sequences (0 when absent or longer than max_depth). */
int64_t st_count(const st_tree *t, const int32_t *tokens, int32_t n) {
    if (n <= 0) return 0;
    int32_t node = walk(t, tokens, n);
    return node == NONE ? 0 : t->count[node];
}
