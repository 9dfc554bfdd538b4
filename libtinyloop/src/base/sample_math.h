/* sample_math.h — the pieces of token sampling (docs/sampling.md) that every backend
 * must compute bit for bit alike: the repetition penalty, the rank key, the
 * fixed-point weight of a logit, the min-p and top-p bounds and the draw. Past the
 * float steps (the penalty, (max - logit) / temperature) everything is integer
 * arithmetic, so the weights do not depend on how a compiler contracts floating-point
 * expressions or how a math library rounds exp(). sample_row.c and the CUDA backend
 * include it; the rest (top-k and top-p thresholds, the walk of the draw) each
 * backend computes its own way to the same definition. */
#ifndef TL_SAMPLE_MATH_H
#define TL_SAMPLE_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TL_SAMPLE_FN static __host__ __device__ __forceinline__
#else
#define TL_SAMPLE_FN static inline
#endif

/* The weight of the best candidate; weights are integers in [0, 2^40]. */
#define TL_SAMPLE_WEIGHT_ONE (1ull << 40)
/* Vocabularies up to this size keep a row's total weight below 2^63. */
#define TL_SAMPLE_MAX_VOCAB (1 << 23)

/* A token as the host sampler holds it: rank key (which carries the id) and weight. */
typedef struct tl_sample_candidate {
    uint64_t key, weight;
} tl_sample_candidate;

/* One sampling step as prepared on the host (tl_sampler_begin_step): the sampler's
 * settings, this step's random number and the tokens the penalty applies to. */
typedef struct tl_sample_step {
    float temperature;          /* <= 0: greedy, the argmax after the penalty */
    float inv_temperature;      /* 1 / temperature (temperature > 0) */
    int32_t top_k;              /* applies when 0 < top_k < vocab */
    float top_p;                /* applies when < 1 */
    float min_p;                /* 0 = off */
    float repetition_penalty;
    const int32_t *penalized;   /* host: the distinct tokens of the penalty window */
    int32_t n_penalized;
    uint64_t random;            /* this step's output of the generator (temperature > 0) */
    tl_sample_candidate *host_scratch;  /* vocab entries for sampling on the host
                                         * (tl_sample_row); a device ignores it */
} tl_sample_step;

/* Each distinct token of the window once: a positive logit divided, else multiplied. */
TL_SAMPLE_FN float tl_sample_penalize(float logit, float penalty) {
    return logit > 0.0f ? logit / penalty : logit * penalty;
}

/* Candidates rank by logit, larger first, then by token id, smaller first; NaN ranks
 * below everything. The key orders the same way as an unsigned integer: the high
 * half maps the logit's bits to an order-preserving integer (-0 as +0, NaN as 0), the
 * low half is the complement of the id. Keys are unique per token. */
TL_SAMPLE_FN uint64_t tl_sample_rank_key(float logit, int32_t id) {
    uint32_t bits;
    memcpy(&bits, &logit, sizeof bits);
    bits = bits == 0x80000000u ? 0 : bits;                       /* -0 as +0 */
    uint32_t ord = bits ^ ((0u - (bits >> 31)) | 0x80000000u);    /* negative: all bits flipped */
    ord = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0 : ord;          /* NaN */
    return ((uint64_t)ord << 32) | (uint32_t)~(uint32_t)id;
}

/* The token id of a rank key. */
TL_SAMPLE_FN int32_t tl_sample_key_id(uint64_t key) { return (int32_t)~(uint32_t)key; }

/* floor(2^40 * exp(-(max - logit) / temperature)) to about 1e-8 relative, computed in
 * fixed point: m = (max - logit) * inv_temperature in Q27 (truncated), then
 * 2^-(m log2 e) = 2^-n * 2^-(j/64) * e^-a with a table of 2^-(j/64) and a degree-4
 * polynomial for e^-a, a < ln 2 / 64. Exactly 2^40 at logit == max; 0 where m is NaN
 * (a NaN logit, max - logit of two equal infinities) or m >= 32. */
TL_SAMPLE_FN uint64_t tl_sample_weight(float logit, float max, float inv_temperature) {
    static const uint32_t exp2_neg_q31[64] = {   /* round(2^(31 - j/64)) */
        2147483648u, 2124350982u, 2101467502u, 2078830522u, 2056437387u, 2034285470u,
        2012372174u, 1990694927u, 1969251188u, 1948038440u, 1927054196u, 1906295993u,
        1885761398u, 1865448001u, 1845353420u, 1825475297u, 1805811301u, 1786359126u,
        1767116489u, 1748081133u, 1729250827u, 1710623359u, 1692196547u, 1673968228u,
        1655936265u, 1638098541u, 1620452965u, 1602997467u, 1585730000u, 1568648537u,
        1551751076u, 1535035634u, 1518500250u, 1502142985u, 1485961921u, 1469955159u,
        1454120821u, 1438457051u, 1422962010u, 1407633882u, 1392470869u, 1377471191u,
        1362633090u, 1347954824u, 1333434672u, 1319070932u, 1304861917u, 1290805962u,
        1276901417u, 1263146652u, 1249540052u, 1236080024u, 1222764986u, 1209593378u,
        1196563654u, 1183674286u, 1170923762u, 1158310587u, 1145833280u, 1133490379u,
        1121280436u, 1109202018u, 1097253708u, 1085434106u,
    };
    const uint64_t log2e_q31 = 3098164009u, ln2_q32 = 2977044472u;
    const uint64_t sixth_q32 = 715827883u, twenty_fourth_q32 = 178956971u;
    float m = (max - logit) * inv_temperature;
    if (!(m >= 0.0f && m < 32.0f)) return 0;
    uint64_t z = (uint64_t)(uint32_t)(m * 134217728.0f) * log2e_q31;   /* Q58 of m log2 e */
    int n = (int)(z >> 58);
    uint32_t f = (uint32_t)(z >> 26);           /* its fraction, Q32 */
    uint32_t j = f >> 26, r = f & 0x3FFFFFFu;   /* f = j/64 + r */
    uint64_t a = ((uint64_t)r * ln2_q32) >> 32; /* Q32, r ln 2 */
    uint64_t a2 = (a * a) >> 32, a3 = (a2 * a) >> 32, a4 = (a3 * a) >> 32;
    uint64_t e = (1ull << 32) - a + (a2 >> 1) - ((a3 * sixth_q32) >> 32) +
                 ((a4 * twenty_fourth_q32) >> 32);                     /* Q32, e^-a */
    uint64_t p = (uint64_t)exp2_neg_q31[j] * (e >> 1);                /* Q62 */
    int shift = 22 + n;
    return shift < 64 ? p >> shift : 0;
}

/* The smallest weight min-p keeps: ceil(min_p * 2^40), at least 1. */
TL_SAMPLE_FN uint64_t tl_sample_min_weight(float min_p) {
    double q = ceil((double)min_p * (double)TL_SAMPLE_WEIGHT_ONE);
    return q < 1.0 ? 1 : (uint64_t)q;
}

/* The mass top-p must keep of a total weight: ceil(top_p * total) in double, at most
 * total and at least 1. */
TL_SAMPLE_FN uint64_t tl_sample_top_p_need(uint64_t total, float top_p) {
    double need = ceil((double)top_p * (double)total);
    if (need >= (double)total) return total;
    return need < 1.0 ? 1 : (uint64_t)need;
}

/* The high 64 bits of a * b. */
TL_SAMPLE_FN uint64_t tl_sample_mul_hi(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
    return __umul64hi(a, b);
#else
    uint64_t a_lo = (uint32_t)a, a_hi = a >> 32, b_lo = (uint32_t)b, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi;
    uint64_t mid = (lo_lo >> 32) + (uint32_t)hi_lo + (uint32_t)lo_hi;
    return a_hi * b_hi + (hi_lo >> 32) + (lo_hi >> 32) + (mid >> 32);
#endif
}

/* The point of the draw in [0, total): floor(u * total) for the 53-bit uniform
 * u = (random >> 11) / 2^53 of sampling.c's generator, in exact integer arithmetic. */
TL_SAMPLE_FN uint64_t tl_sample_draw(uint64_t random, uint64_t total) {
    uint64_t u = random >> 11;
    uint64_t hi = tl_sample_mul_hi(u, total), lo = u * total;
    return (hi << 11) | (lo >> 53);
}

#endif
