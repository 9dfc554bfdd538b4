/* sampling.c — token selection for generation, as docs/sampling.md defines it: the
 * host's generator and penalty bookkeeping, which prepare each step; the step itself
 * runs on the host in base/sample_row.c or in a backend's sample op. */
#include "decode/sampling.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

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
    if (vocab < 1 || vocab > TL_SAMPLE_MAX_VOCAB)
        return tl_fail(TL_ERR_UNSUPPORTED, "sampling supports vocabularies of 1 to %d tokens, not %d",
                       TL_SAMPLE_MAX_VOCAB, vocab);

    s->vocab = vocab;
    s->temperature = o->temperature;
    s->top_k = o->top_k;
    s->top_p = o->top_p;
    s->min_p = o->min_p;
    s->repetition_penalty = o->repetition_penalty;
    s->repetition_window = o->repetition_window;
    uint64_t x = o->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix_next(&x);

    int penalty = s->repetition_penalty != 1.0f, sampled = s->temperature > 0.0f;
    if (penalty) {
        s->seen = calloc((size_t)vocab, sizeof *s->seen);
        s->penalized = malloc((size_t)vocab * sizeof *s->penalized);
    }
    if (sampled) s->cand = malloc((size_t)vocab * sizeof *s->cand);
    if ((penalty && (!s->seen || !s->penalized)) || (sampled && !s->cand)) {
        tl_sampler_free(s);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate sampling scratch for %d tokens", vocab);
    }
    return TL_OK;
}

void tl_sampler_free(tl_sampler *s) {
    free(s->seen);
    free(s->penalized);
    free(s->cand);
    s->seen = NULL;
    s->penalized = NULL;
    s->cand = NULL;
}

/* ---- preparing a step ----------------------------------------------------------- */

/* The distinct tokens of the window over past followed by next, into s->penalized. */
static int32_t collect_penalized(tl_sampler *s, const int32_t *past, size_t n_past,
                                 const int32_t *next, size_t n_next) {
    size_t n = n_past + n_next;
    if (s->repetition_penalty == 1.0f || n == 0) return 0;
    size_t start = s->repetition_window > 0 && n > (size_t)s->repetition_window
                       ? n - (size_t)s->repetition_window : 0;
    if (++s->stamp == 0) {   /* stamps wrapped: forget old marks */
        memset(s->seen, 0, (size_t)s->vocab * sizeof *s->seen);
        s->stamp = 1;
    }
    int32_t count = 0;
    for (size_t i = start; i < n; i++) {
        int32_t t = i < n_past ? past[i] : next[i - n_past];
        if (t < 0 || t >= s->vocab || s->seen[t] == s->stamp) continue;
        s->seen[t] = s->stamp;
        s->penalized[count++] = t;
    }
    return count;
}

void tl_sampler_begin_step(tl_sampler *s, const int32_t *past, size_t n_past, const int32_t *next,
                           size_t n_next, tl_sample_step *step) {
    memset(step, 0, sizeof *step);
    step->temperature = s->temperature;
    step->inv_temperature = s->temperature > 0.0f ? 1.0f / s->temperature : 0.0f;
    step->top_k = s->top_k;
    step->top_p = s->top_p;
    step->min_p = s->min_p;
    step->repetition_penalty = s->repetition_penalty;
    step->penalized = s->penalized;
    step->n_penalized = collect_penalized(s, past, n_past, next, n_next);
    if (s->temperature > 0.0f) step->random = rng_next(s->rng);
    step->host_scratch = s->cand;
}

uint64_t tl_sampler_random(tl_sampler *s) { return rng_next(s->rng); }

double tl_sampler_uniform(tl_sampler *s) { return (double)(rng_next(s->rng) >> 11) * 0x1p-53; }

int32_t tl_sampler_sample(tl_sampler *s, float *logits, const int32_t *history, size_t n_history) {
    tl_sample_step step;
    tl_sampler_begin_step(s, history, n_history, NULL, 0, &step);
    return tl_sample_row(logits, s->vocab, &step);
}
