/* sampling.c — token selection for generation (order documented in sampling.h and
 * docs/api.md). Candidates are ordered by value, then by token id, so every step is
 * a total order and a seed reproduces its tokens exactly. */
#include "sampling.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

typedef struct tl_candidate {
    float v;      /* logit, then unnormalised probability */
    int32_t id;
} tl_candidate;

/* ---- seeded generator (xoshiro256**, seeded through splitmix64) ---------------- */

static uint64_t splitmix_next(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* uniform in [0, 1) */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

/* ---- setup ------------------------------------------------------------------------ */

tl_status tl_sampler_init(tl_sampler *s, const tl_generate_options *o, int vocab) {
    memset(s, 0, sizeof *s);
    if (!(o->temperature >= 0.0f) || !isfinite(o->temperature))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "temperature %g must be a finite value >= 0",
                       (double)o->temperature);
    if (o->top_k < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k %d is negative (0 = off)", o->top_k);
    if (!(o->top_p > 0.0f && o->top_p <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_p %g is out of range (0, 1] (1 = off)",
                       (double)o->top_p);
    if (!(o->min_p >= 0.0f && o->min_p < 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_p %g is out of range [0, 1) (0 = off)",
                       (double)o->min_p);
    if (!(o->repetition_penalty > 0.0f) || !isfinite(o->repetition_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "repetition_penalty %g must be a finite value > 0 (1 = off)",
                       (double)o->repetition_penalty);
    if (o->repetition_window < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "repetition_window %d is negative (0 = all)",
                       o->repetition_window);

    s->vocab = vocab;
    s->temperature = o->temperature;
    s->top_k = o->top_k;
    s->top_p = o->top_p;
    s->min_p = o->min_p;
    s->repetition_penalty = o->repetition_penalty;
    s->repetition_window = o->repetition_window;
    uint64_t x = o->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix_next(&x);

    if (s->temperature > 0.0f) s->cand = malloc((size_t)vocab * sizeof *s->cand);
    if (s->repetition_penalty != 1.0f) s->seen = calloc((size_t)vocab, sizeof *s->seen);
    if ((s->temperature > 0.0f && !s->cand) || (s->repetition_penalty != 1.0f && !s->seen)) {
        tl_sampler_free(s);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate sampling scratch for %d tokens",
                       vocab);
    }
    return TL_OK;
}

void tl_sampler_free(tl_sampler *s) {
    free(s->cand);
    free(s->seen);
    s->cand = NULL;
    s->seen = NULL;
}

/* ---- steps ----------------------------------------------------------------------- */

/* Each distinct token of the window once: positive logits divided, negative multiplied. */
static void apply_repetition_penalty(tl_sampler *s, float *logits, const int32_t *hist,
                                     size_t n) {
    if (s->repetition_penalty == 1.0f || n == 0) return;
    size_t start = s->repetition_window > 0 && n > (size_t)s->repetition_window
                       ? n - (size_t)s->repetition_window : 0;
    if (++s->stamp == 0) {   /* stamps wrapped: forget old marks */
        memset(s->seen, 0, (size_t)s->vocab * sizeof *s->seen);
        s->stamp = 1;
    }
    float pen = s->repetition_penalty;
    for (size_t i = start; i < n; i++) {
        int32_t t = hist[i];
        if (t < 0 || t >= s->vocab || s->seen[t] == s->stamp) continue;
        s->seen[t] = s->stamp;
        logits[t] = logits[t] > 0.0f ? logits[t] / pen : logits[t] * pen;
    }
}

static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* a ranks before b: larger value first, then smaller id */
static int ranks_before(const tl_candidate *a, const tl_candidate *b) {
    return a->v > b->v || (a->v == b->v && a->id < b->id);
}

static int cmp_rank(const void *pa, const void *pb) {
    const tl_candidate *a = pa, *b = pb;
    if (ranks_before(a, b)) return -1;
    if (ranks_before(b, a)) return 1;
    return 0;
}

/* Min-heap on rank (root = the worst kept candidate). */
static void heap_sift_down(tl_candidate *h, int n, int i) {
    for (;;) {
        int worst = i, l = 2 * i + 1, r = l + 1;
        if (l < n && ranks_before(&h[worst], &h[l])) worst = l;
        if (r < n && ranks_before(&h[worst], &h[r])) worst = r;
        if (worst == i) return;
        tl_candidate t = h[i];
        h[i] = h[worst];
        h[worst] = t;
        i = worst;
    }
}

/* The k best logits into cand[0..k), sorted best first. */
static int select_top_k(tl_candidate *cand, const float *logits, int vocab, int k) {
    for (int i = 0; i < k; i++) cand[i] = (tl_candidate){ logits[i], i };
    for (int i = k / 2 - 1; i >= 0; i--) heap_sift_down(cand, k, i);
    for (int i = k; i < vocab; i++) {
        tl_candidate c = { logits[i], i };
        if (ranks_before(&c, &cand[0])) {
            cand[0] = c;
            heap_sift_down(cand, k, 0);
        }
    }
    qsort(cand, (size_t)k, sizeof *cand, cmp_rank);
    return k;
}

int32_t tl_sampler_sample(tl_sampler *s, float *logits, const int32_t *history,
                          size_t n_history) {
    apply_repetition_penalty(s, logits, history, n_history);
    if (s->temperature <= 0.0f) return argmax(logits, s->vocab);

    /* top-k (0 = all tokens, unsorted) */
    tl_candidate *cand = s->cand;
    int n, sorted = 0;
    if (s->top_k > 0 && s->top_k < s->vocab) {
        n = select_top_k(cand, logits, s->vocab, s->top_k);
        sorted = 1;
    } else {
        n = s->vocab;
        for (int i = 0; i < n; i++) cand[i] = (tl_candidate){ logits[i], i };
    }
    float max = sorted ? cand[0].v : logits[argmax(logits, s->vocab)];

    /* temperature, softmax weights relative to the best (best = 1), and min-p: keep
     * tokens at least min_p times as likely as the best */
    float inv_t = 1.0f / s->temperature;
    int kept = 0;
    for (int i = 0; i < n; i++) {
        float w = expf((cand[i].v - max) * inv_t);
        if (w >= s->min_p && w > 0.0f) cand[kept++] = (tl_candidate){ w, cand[i].id };
    }
    if (kept == 0) return argmax(logits, s->vocab);
    n = kept;

    /* top-p: the smallest best-first prefix holding top_p of the mass */
    double total = 0.0;
    for (int i = 0; i < n; i++) total += cand[i].v;
    if (s->top_p < 1.0f) {
        if (!sorted) qsort(cand, (size_t)n, sizeof *cand, cmp_rank);
        double cum = 0.0, target = (double)s->top_p * total;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += cand[i].v;
            if (cum >= target) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        total = cum;
    }

    double u = rng_uniform(s->rng) * total, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += cand[i].v;
        if (u < acc) return cand[i].id;
    }
    return cand[n - 1].id;
}
