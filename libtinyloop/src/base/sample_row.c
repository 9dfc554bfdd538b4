/* sample_row.c — a prepared sampling step applied to a row of logits in host memory
 * (tl_sample_row), which every backend's sample op must match token for token, and the
 * distributions speculative sampling compares (docs/sampling.md).
 *
 * Candidates are ordered by their rank key (sample_math.h), a total order, and carry
 * integer weights, so the top-k and top-p sets, the total and the draw are exact:
 * the same seed and logits give the same token whatever the order of summation. */
#include "base/sample_row.h"

#include <math.h>
#include <stdlib.h>

/* ---- a step on host memory ----------------------------------------------------- */

/* The first index of the largest value; a NaN never wins, except at index 0. */
static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Min-heap of keys (the root is the smallest kept). */
static void heap_sift_down(tl_sample_candidate *h, int n, int i) {
    for (;;) {
        int least = i, l = 2 * i + 1, r = l + 1;
        if (l < n && h[l].key < h[least].key) least = l;
        if (r < n && h[r].key < h[least].key) least = r;
        if (least == i) return;
        tl_sample_candidate t = h[i];
        h[i] = h[least];
        h[least] = t;
        i = least;
    }
}

/* The k largest rank keys of the row into cand[0..k) (k < vocab). */
static void select_top_k(tl_sample_candidate *cand, const float *logits, int vocab, int k) {
    for (int i = 0; i < k; i++) cand[i] = (tl_sample_candidate){ tl_sample_rank_key(logits[i], i), 0 };
    for (int i = k / 2 - 1; i >= 0; i--) heap_sift_down(cand, k, i);
    float root_logit = logits[tl_sample_key_id(cand[0].key)];
    for (int i = k; i < vocab; i++) {
        if (logits[i] < root_logit) continue;   /* ranks below the root (false with NaN) */
        uint64_t key = tl_sample_rank_key(logits[i], i);
        if (key > cand[0].key) {
            cand[0].key = key;
            heap_sift_down(cand, k, 0);
            root_logit = logits[tl_sample_key_id(cand[0].key)];
        }
    }
}

static int by_id(const void *pa, const void *pb) {
    int32_t a = tl_sample_key_id(((const tl_sample_candidate *)pa)->key);
    int32_t b = tl_sample_key_id(((const tl_sample_candidate *)pb)->key);
    return (a > b) - (a < b);
}

/* Walking the candidates from the largest key down, the key where the running sum of
 * their weights first reaches need (1 <= need <= their total), found 8 key bits at a
 * time from the top (radix select). Returns a key T such that the candidates of key
 * >= T are exactly those walked, and their weight in *kept. */
static uint64_t select_threshold(const tl_sample_candidate *cand, int n, uint64_t need,
                                 uint64_t *kept) {
    uint64_t prefix = 0, above = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        const uint64_t mask = shift == 56 ? 0 : ~0ull << (shift + 8);
        uint64_t mass[256] = { 0 };
        uint32_t count[256] = { 0 };
        for (int i = 0; i < n; i++) {
            if ((cand[i].key & mask) != prefix) continue;
            int b = (int)(cand[i].key >> shift) & 255;
            mass[b] += cand[i].weight;
            count[b]++;
        }
        for (int b = 255; b >= 0; b--) {
            if (above + mass[b] < need) {
                above += mass[b];
                continue;
            }
            prefix |= (uint64_t)b << shift;
            /* done once the walk ends at this bucket's last candidate */
            if (count[b] == 1 || above + mass[b] == need || shift == 0) {
                *kept = above + mass[b];
                return prefix;
            }
            break;
        }
    }
    *kept = above;   /* not reached when need <= the total */
    return prefix;
}

/* The candidates a prepared step draws from, after the penalty (applied to logits in
 * place), top-k, min-p and top-p: cand[0..n) in id order with their weights, of which
 * those of key >= *lower are kept, *total their weight. Returns the argmax after the
 * penalty; n = 0 when the step is greedy or nothing has weight, and the token is it. */
static int32_t kept_candidates(float *logits, int vocab, const tl_sample_step *step, int *n_out,
                               uint64_t *lower_out, uint64_t *total_out) {
    *n_out = 0;
    *lower_out = *total_out = 0;
    for (int32_t i = 0; i < step->n_penalized; i++) {
        int32_t t = step->penalized[i];
        if (t >= 0 && t < vocab) logits[t] = tl_sample_penalize(logits[t], step->repetition_penalty);
    }
    int32_t best = argmax(logits, vocab);
    tl_sample_candidate *cand = step->host_scratch;
    if (!(step->temperature > 0.0f) || !cand) return best;   /* samplers always give scratch */

    float max = logits[best];   /* the largest non-NaN logit: best's, unless index 0 is NaN */
    if (isnan(max)) {
        max = -INFINITY;
        for (int i = 1; i < vocab; i++)
            if (logits[i] > max) max = logits[i];
    }

    /* candidates in id order with their weights; min-p drops the light ones */
    const uint64_t min_weight = tl_sample_min_weight(step->min_p);
    uint64_t total = 0;
    int n = 0;
    if (step->top_k > 0 && step->top_k < vocab) {
        select_top_k(cand, logits, vocab, step->top_k);
        qsort(cand, (size_t)step->top_k, sizeof *cand, by_id);
        for (int i = 0; i < step->top_k; i++) {
            int32_t id = tl_sample_key_id(cand[i].key);
            uint64_t w = tl_sample_weight(logits[id], max, step->inv_temperature);
            if (w < min_weight) continue;
            cand[n++] = (tl_sample_candidate){ cand[i].key, w };
            total += w;
        }
    } else {
        for (int i = 0; i < vocab; i++) {
            uint64_t w = tl_sample_weight(logits[i], max, step->inv_temperature);
            if (w < min_weight) continue;
            cand[n++] = (tl_sample_candidate){ tl_sample_rank_key(logits[i], i), w };
            total += w;
        }
    }
    if (total == 0) return best;   /* nothing has weight (infinities, NaN, tiny temperature) */
    uint64_t lower = 0;   /* kept: candidates of key >= lower */
    if (step->top_p < 1.0f)
        lower = select_threshold(cand, n, tl_sample_top_p_need(total, step->top_p), &total);
    *n_out = n;
    *lower_out = lower;
    *total_out = total;
    return best;
}

int32_t tl_sample_row(float *logits, int vocab, const tl_sample_step *step) {
    int n;
    uint64_t lower, total;
    int32_t best = kept_candidates(logits, vocab, step, &n, &lower, &total);
    const tl_sample_candidate *cand = step->host_scratch;
    /* the draw walks the kept candidates in id order */
    uint64_t r = n ? tl_sample_draw(step->random, total) : 0, acc = 0;
    for (int i = 0; i < n; i++) {
        if (cand[i].key < lower) continue;
        acc += cand[i].weight;
        if (r < acc) return tl_sample_key_id(cand[i].key);
    }
    return best;   /* greedy, nothing with weight; else not reached: r < total */
}

int tl_sample_distribution(float *logits, int vocab, const tl_sample_step *step, int32_t *ids,
                           double *probs) {
    int n;
    uint64_t lower, total;
    int32_t best = kept_candidates(logits, vocab, step, &n, &lower, &total);
    const tl_sample_candidate *cand = step->host_scratch;
    int m = 0;
    for (int i = 0; i < n; i++)   /* candidates come in id order */
        if (cand[i].key >= lower) {
            ids[m] = tl_sample_key_id(cand[i].key);
            probs[m++] = (double)cand[i].weight / (double)total;
        }
    if (m == 0) {
        ids[0] = best;
        probs[0] = 1.0;
        m = 1;
    }
    return m;
}

double tl_sample_probability(const int32_t *ids, const double *probs, int n, int32_t id) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (ids[mid] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && ids[lo] == id ? probs[lo] : 0.0;
}

int32_t tl_sample_from(const int32_t *ids, const double *weights, int n, double total, uint64_t random) {
    double r = (double)(random >> 11) * 0x1p-53 * total, acc = 0.0;
    int32_t last = -1;
    for (int i = 0; i < n; i++) {
        if (!(weights[i] > 0.0)) continue;
        acc += weights[i];
        last = ids[i];
        if (r < acc) return ids[i];
    }
    return last;   /* r rounded up to the sum: the last token with weight */
}

double tl_sample_residual(double *p, const int32_t *p_ids, int n_p, const double *q, const int32_t *q_ids,
                          int n_q) {
    double total = 0.0;
    int j = 0;
    for (int i = 0; i < n_p; i++) {
        while (j < n_q && q_ids[j] < p_ids[i]) j++;
        double qi = j < n_q && q_ids[j] == p_ids[i] ? q[j] : 0.0;
        p[i] = p[i] > qi ? p[i] - qi : 0.0;
        total += p[i];
    }
    return total;
}
