/* logprobs.c — see logprobs.h. */
#include "base/logprobs.h"

#include <math.h>

/* Whether token a ranks before token b: the larger logit first, the lower id on ties
 * (NaN ranks last). */
static int ranks_before(const float *x, int32_t a, int32_t b) {
    if (isnan(x[b])) return !isnan(x[a]) || a < b;
    if (isnan(x[a])) return 0;
    return x[a] > x[b] || (x[a] == x[b] && a < b);
}

void tl_top_logprobs(const float *x, int n, double log_sum_exp, int k, int32_t *ids, float *logprobs) {
    if (k > n) k = n;
    if (k <= 0) return;
    int kept = 0;
    /* insertion into the k best seen so far: k is at most TL_MAX_TOP_LOGPROBS, so one
     * pass over the row with a short sorted list beats sorting the vocabulary */
    for (int32_t i = 0; i < n; i++) {
        if (kept == k) {   /* the common case first: not above the k-th best */
            float worst = x[ids[k - 1]];
            if (!isnan(worst) && !(x[i] > worst)) continue;
            if (!ranks_before(x, i, ids[k - 1])) continue;
        }
        int j = kept < k ? kept++ : k - 1;
        while (j > 0 && ranks_before(x, i, ids[j - 1])) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
    for (int j = 0; j < k; j++) logprobs[j] = (float)((double)x[ids[j]] - log_sum_exp);
}
