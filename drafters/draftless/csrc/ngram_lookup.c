/* The n-gram drafters' per-round lookups, in C because they run once per slot per round.
 *
 * In numpy each of these costs tens of microseconds of call overhead whatever the history length;
 * on open-ended text, where the drafters mostly find nothing, that overhead is the whole price of
 * asking them, paid every round beside a forward of a few milliseconds. Here a call costs about a
 * microsecond plus a scan that stops at the latest match.
 *
 * Loaded with ctypes by drafters/draftless/ngram_lookup.py; token arrays are int32, lengths int64.
 */

#include <stdint.h>
#include <string.h>

/* Whether hist[j .. j+n) equals pat[0 .. n), checked from the back (the last token differs most). */
static int same_at(const int32_t *hist, int64_t j, const int32_t *pat, int32_t n) {
    for (int32_t k = n - 1; k >= 0; k--)
        if (hist[j + k] != pat[k]) return 0;
    return 1;
}

/* The largest j in [lo, hi] with hist[j .. j+n) == pat, or -1 when pat occurs there fewer than
 * `need` times. The caller guarantees hi + n <= the history's length. */
int64_t ng_last_match(const int32_t *hist, const int32_t *pat, int32_t n, int64_t lo, int64_t hi, int32_t need) {
    if (lo < 0) lo = 0;
    if (n <= 0 || hi < lo) return -1;
    int64_t latest = -1;
    int32_t count = 0;
    const int32_t last = pat[n - 1];
    for (int64_t j = hi; j >= lo; j--) {
        if (hist[j + n - 1] != last || !same_at(hist, j, pat, n)) continue;
        if (latest < 0) latest = j;
        if (++count >= need) return latest;
    }
    return -1;
}

/* ngram-simple: the pattern is the last n tokens of (hist, last); its latest occurrence at j in
 * [1, len-n-1] gives the min(m, len-j-n) tokens after it, and nothing when that is under n.
 * Writes the draft to out (room for m tokens) and returns its length. */
int32_t ng_simple_draft(const int32_t *hist, int64_t len, int32_t last, int32_t n, int32_t m, int32_t min_hits,
                        int32_t *out) {
    if (n <= 0 || len <= (int64_t)n + m + 1) return 0;
    int32_t pat[1024];
    if (n > 1024) return 0;
    memcpy(pat, hist + len - n + 1, sizeof(int32_t) * (size_t)(n - 1));
    pat[n - 1] = last;
    int64_t j = ng_last_match(hist, pat, n, 1, len - n - 1, min_hits < 1 ? 1 : min_hits);
    if (j < 0) return 0;
    int64_t copy = len - j - n;
    if (copy > m) copy = m;
    if (copy < n) return 0;
    memcpy(out, hist + j + n, sizeof(int32_t) * (size_t)copy);
    return (int32_t)copy;
}

/* ngram-mod's table index of an n-gram: r = r * 6364136223846793005 + t (mod 2^64), low bits
 * under `mask` (the table size is a power of two). */
#define LCG64 6364136223846793005ULL

static uint64_t mod_hash(const int32_t *t, int32_t n) {
    uint64_t r = 0;
    for (int32_t k = 0; k < n; k++) r = r * LCG64 + (uint64_t)(uint32_t)t[k];
    return r;
}

/* entries[idx(hist[i .. i+n))] = hist[i+n] for every i in [lo, hi), in order (the last writer
 * wins). Returns how many entries were empty (`empty`) before. */
int64_t ngm_add_range(int32_t *entries, uint64_t mask, const int32_t *hist, int64_t lo, int64_t hi, int32_t n,
                      int32_t empty) {
    if (hi <= lo || n <= 0) return 0;
    uint64_t lead = 1;  /* LCG64^(n-1): the weight of the token that leaves the window */
    for (int32_t k = 1; k < n; k++) lead *= LCG64;
    uint64_t r = mod_hash(hist + lo, n);
    int64_t filled = 0;
    for (int64_t i = lo; i < hi; i++) {
        if (i > lo) r = (r - (uint64_t)(uint32_t)hist[i - 1] * lead) * LCG64 + (uint64_t)(uint32_t)hist[i + n - 1];
        int32_t *e = &entries[r & mask];
        if (*e == empty) filled++;
        *e = hist[i + n];
    }
    return filled;
}

/* The walk: from the n-gram window[0 .. n), follow the table for up to n_max tokens. A walk that
 * meets an empty entry before n_min tokens is no draft (returns 0). */
int32_t ngm_walk(const int32_t *entries, uint64_t mask, const int32_t *window, int32_t n, int32_t n_min,
                 int32_t n_max, int32_t empty, int32_t *out) {
    if (n <= 0) return 0;
    uint64_t lead = 1;
    for (int32_t k = 1; k < n; k++) lead *= LCG64;
    uint64_t r = mod_hash(window, n);
    int32_t got = 0;
    for (int32_t i = 0; i < n_max; i++) {
        int32_t t = entries[r & mask];
        if (t == empty) {
            if (i < n_min) return 0;
            break;
        }
        out[got++] = t;
        /* the token leaving the window: window[i] while still inside it, else an earlier draft token */
        int32_t leaving = i < n ? window[i] : out[i - n];
        r = (r - (uint64_t)(uint32_t)leaving * lead) * LCG64 + (uint64_t)(uint32_t)t;
    }
    return got;
}
