/* exit_rule.c — the adaptive-depth rules of docs/model.md ("Adaptive depth") on the host:
 * what each rule compares between a row's successive iterations, and when it stops. */
#include "runtime/exit_rule.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

tl_status tl_exit_rule_check(const tl_exit_rule *rule, int has_exit_gate, int has_loop, const char *field) {
    if (!tl_exit_rule_active(rule)) return TL_OK;
    if (rule->kind < TL_EXIT_FIXED || rule->kind > TL_EXIT_GATE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.kind %d is not an exit rule (0..5)", field, (int)rule->kind);
    if (!has_loop)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: the model has no loop (n_core = 0), so no token can exit it early",
                       field);
    if (rule->kind == TL_EXIT_GATE && !has_exit_gate)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: rule gate needs a model with a learned exit gate "
                                           "(loop.exit_gate, e.g. Ouro); this one has none", field);
    if (!isfinite(rule->threshold) || rule->threshold < 0.0f)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.threshold %g must be finite and >= 0", field,
                       (double)rule->threshold);
    if (rule->kind == TL_EXIT_GATE && (rule->threshold <= 0.0f || rule->threshold > 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.threshold %g: the gate's exit CDF threshold lies in (0, 1]",
                       field, (double)rule->threshold);
    if (rule->min_depth < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.min_depth %d must be >= 0 (0 = 1)", field, rule->min_depth);
    if (rule->patience < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.patience %d must be >= 0 (0 = 2)", field, rule->patience);
    return TL_OK;
}

static int min_depth_of(const tl_exit_rule *rule) { return rule->min_depth > 0 ? rule->min_depth : 1; }
static int patience_of(const tl_exit_rule *rule) { return rule->patience > 0 ? rule->patience : 2; }

static const tl_exit_rule *rule_of(const tl_exit_tracker *t, int r) {
    const tl_exit_rule *rule = t->rules ? t->rules[r] : NULL;
    return tl_exit_rule_active(rule) ? rule : NULL;
}

static int probes_distribution(tl_exit_kind kind) {
    return kind == TL_EXIT_KL || kind == TL_EXIT_ENTROPY_DELTA || kind == TL_EXIT_ARGMAX_STABLE;
}

tl_status tl_exit_tracker_init(tl_exit_tracker *t, int n, int d, int vocab, int depth,
                               const tl_exit_rule *const *rules, const int32_t *limits,
                               const int32_t *given) {
    memset(t, 0, sizeof *t);
    t->n = n, t->d = d, t->vocab = vocab, t->depth = depth, t->rules = rules, t->given = given;
    t->limits = limits;
    for (int r = 0; r < n; r++) {
        const tl_exit_rule *rule = rule_of(t, r);
        if (!rule) continue;
        t->wants_states |= rule->kind == TL_EXIT_LATENT_DELTA;
        t->wants_probe |= probes_distribution(rule->kind);
        t->wants_gate |= rule->kind == TL_EXIT_GATE;
    }
    t->ran = calloc((size_t)n, sizeof *t->ran);
    t->running = malloc((size_t)n);
    t->entropy = calloc((size_t)n, sizeof *t->entropy);
    t->top = calloc((size_t)n, sizeof *t->top);
    t->stable = calloc((size_t)n, sizeof *t->stable);
    t->survival = malloc((size_t)n * sizeof *t->survival);
    if (t->wants_states) t->states = malloc((size_t)n * d * sizeof *t->states);
    if (t->wants_probe) t->dist = malloc((size_t)n * vocab * sizeof *t->dist);
    if (!t->ran || !t->running || !t->entropy || !t->top || !t->stable || !t->survival ||
        (t->wants_states && !t->states) || (t->wants_probe && !t->dist)) {
        tl_exit_tracker_free(t);
        return tl_fail(TL_ERR_OUT_OF_MEMORY, "cannot allocate the exit state of %d rows", n);
    }
    memset(t->running, 1, (size_t)n);
    for (int r = 0; r < n; r++) t->survival[r] = 1.0;
    return TL_OK;
}

void tl_exit_tracker_free(tl_exit_tracker *t) {
    free(t->ran);
    free(t->running);
    free(t->states);
    free(t->dist);
    free(t->entropy);
    free(t->top);
    free(t->stable);
    free(t->survival);
    memset(t, 0, sizeof *t);
}

static int limit_of(const tl_exit_tracker *t, int r) { return t->limits ? t->limits[r] : t->depth; }

/* Whether a rule reads row r after iteration it: the iteration before its first possible
 * exit gives the value the first comparison needs. */
static int reads_at(const tl_exit_tracker *t, int r, int it, const tl_exit_rule *rule) {
    return t->running[r] && it < limit_of(t, r) && it >= min_depth_of(rule) - 1;
}

int tl_exit_needs_state(const tl_exit_tracker *t, int r, int it) {
    const tl_exit_rule *rule = rule_of(t, r);
    return rule && rule->kind == TL_EXIT_LATENT_DELTA && reads_at(t, r, it, rule);
}

int tl_exit_needs_probe(const tl_exit_tracker *t, int r, int it) {
    const tl_exit_rule *rule = rule_of(t, r);
    return rule && probes_distribution(rule->kind) && it >= 1 && reads_at(t, r, it, rule);
}

int tl_exit_needs_gate(const tl_exit_tracker *t, int r, int it) {
    const tl_exit_rule *rule = rule_of(t, r);
    return rule && rule->kind == TL_EXIT_GATE && it >= 1 && t->running[r] && it < limit_of(t, r);
}

/* |a - b| / |a| over d floats, in double; 0 when both are 0. */
static double relative_change(const float *a, const float *b, int d) {
    double diff = 0.0, norm = 0.0;
    for (int j = 0; j < d; j++) {
        double x = a[j], y = x - (double)b[j];
        diff += y * y;
        norm += x * x;
    }
    return norm > 0.0 ? sqrt(diff / norm) : (diff > 0.0 ? INFINITY : 0.0);
}

/* softmax(logits) into p (double), its entropy (nats) and its most likely token. */
static double softmax_into(const float *logits, int V, double *p, int32_t *top) {
    float max = -INFINITY;
    int32_t best = 0;
    for (int i = 0; i < V; i++)
        if (logits[i] > max) max = logits[i], best = i;
    double sum = 0.0;
    for (int i = 0; i < V; i++) sum += p[i] = logits[i] > -INFINITY ? exp((double)logits[i] - max) : 0.0;
    double entropy = 0.0;
    for (int i = 0; i < V; i++) {
        p[i] /= sum;
        if (p[i] > 0.0) entropy -= p[i] * log(p[i]);
    }
    *top = best;
    return entropy;
}

/* KL(p || q) in nats; q's zeros under p's mass count as +inf. */
static double kl_divergence(const double *p, const double *q, int V) {
    double kl = 0.0;
    for (int i = 0; i < V; i++) {
        if (p[i] <= 0.0) continue;
        if (q[i] <= 0.0) return INFINITY;
        kl += p[i] * log(p[i] / q[i]);
    }
    return kl;
}

/* Stop row r after iteration it (its loop runs no further). */
static int stop(tl_exit_tracker *t, int r, int it) {
    t->ran[r] = it;
    t->running[r] = 0;
    return 1;
}

int tl_exit_observe(tl_exit_tracker *t, int r, int it, const float *state, const float *logits,
                    float gate_logit) {
    if (!t->running[r]) return 0;
    t->ran[r] = it;
    if (it >= limit_of(t, r)) {   /* the last iteration: the loop ends here anyway */
        t->running[r] = 0;
        return 0;
    }
    if (t->given) return it >= t->given[r] ? stop(t, r, it) : 0;
    const tl_exit_rule *rule = rule_of(t, r);
    if (!rule) return 0;
    int may_stop = it >= min_depth_of(rule);
    int d = t->d, V = t->vocab;
    switch (rule->kind) {
    case TL_EXIT_LATENT_DELTA: {
        if (!state) return 0;
        float *prev = t->states + (size_t)r * d;
        int first = it == min_depth_of(rule) - 1;   /* nothing to compare with yet */
        double change = first ? INFINITY : relative_change(state, prev, d);
        memcpy(prev, state, (size_t)d * sizeof *prev);
        return may_stop && change < rule->threshold ? stop(t, r, it) : 0;
    }
    case TL_EXIT_KL:
    case TL_EXIT_ENTROPY_DELTA:
    case TL_EXIT_ARGMAX_STABLE: {
        if (!logits) return 0;
        double *p = t->dist + (size_t)r * V;
        int first = it <= 1 || it == min_depth_of(rule) - 1;
        int32_t top = 0;
        int done = 0;
        if (rule->kind == TL_EXIT_KL) {
            /* the new distribution beside the old one: the scratch half of a row pair */
            double *q = malloc((size_t)V * sizeof *q);
            if (!q) return 0;   /* out of memory: the row just runs on */
            double entropy = softmax_into(logits, V, q, &top);
            done = !first && kl_divergence(q, p, V) < rule->threshold;
            memcpy(p, q, (size_t)V * sizeof *p);
            free(q);
            t->entropy[r] = entropy;
        } else {
            double entropy = softmax_into(logits, V, p, &top);
            if (rule->kind == TL_EXIT_ENTROPY_DELTA)
                done = !first && fabs(entropy - t->entropy[r]) < rule->threshold;
            t->stable[r] = !first && top == t->top[r] ? t->stable[r] + 1 : 0;
            if (rule->kind == TL_EXIT_ARGMAX_STABLE) done = t->stable[r] + 1 >= patience_of(rule);
            t->entropy[r] = entropy;
        }
        t->top[r] = top;
        return may_stop && done ? stop(t, r, it) : 0;
    }
    case TL_EXIT_GATE: {
        /* Ouro's exit distribution: p_it = lambda_it * prod_{j<it} (1 - lambda_j); the first
         * iteration whose CDF reaches the threshold */
        double lambda = 1.0 / (1.0 + exp(-(double)gate_logit));
        double cdf = 1.0 - t->survival[r] * (1.0 - lambda);
        t->survival[r] *= 1.0 - lambda;
        return may_stop && cdf >= rule->threshold ? stop(t, r, it) : 0;
    }
    case TL_EXIT_FIXED:
        break;
    }
    return 0;
}
