/* `tree.hybrid_tree`'s merge in C, row by row (`merge`; `merge_rows`, the same merge written straight into a
 * static verify step's input rows; and `observe_verified`'s counting of its verified nodes): the same tree as
 * its batched tensor version, which stays as the reference and the fallback where this extension is not
 * built (tests/test_hybrid_merge.py and tests/test_static_merged_steps.py hold them to a node-by-node
 * reference and to each other).
 *
 * Why C: the batched version is about a hundred small tensor operations a step, over a millisecond of
 * host time a speculative step on the critical path whatever the batch; here a row costs a few
 * microseconds. The rule is hybrid_tree's docstring's:
 *   - a node is a token path from the root: a candidate whose path the learned draft proposed is that
 *     node (its estimate and raw conditional the larger of the two, both sources' bits);
 *   - a node's score is its estimate (raw), or its parent's score plus the log of its calibrated
 *     conditional (calibrated: `NodeCalibration.conditionals` from the counts table);
 *   - the `num_verify - 1` best alive nodes are kept (score, then shallower, then lower number: learned
 *     nodes before the candidates, each in proposal order), parents before children, padding last.
 *
 * Tensors cross as addresses of contiguous CPU tensors of fixed dtypes (the index's candidates as
 * `CandidateRows`' two tensors); tree.py and steps.py check them. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LEARNED = 1, INDEX = 2 };
enum { CLASS_LEARNED = 0, CLASS_INDEX_SHORT = 1, CLASS_INDEX_LONG = 2, CLASS_BOTH = 3 }; /* node_calibration.CLASSES */

typedef struct {
    int64_t tok, par, dep, node, id;
    double est, raw, score; /* estimate of the path's probability (log), raw conditional, score */
    int src, alive;
} Node;

typedef struct {
    const double *counts; /* [class, bucket, (accepted, reached)], NULL: raw scores */
    double prior;
    long buckets, long_match;
} Calibration;

/* The kept order: alive first, then higher score, then shallower, then lower number. */
static int ranked_before(const Node *a, const Node *b) {
    if (a->alive != b->alive) return a->alive;
    if (a->score != b->score) return a->score > b->score;
    if (a->dep != b->dep) return a->dep < b->dep;
    return a->id < b->id;
}

static int cmp_rank(const void *x, const void *y) {
    const Node *a = *(Node *const *)x, *b = *(Node *const *)y;
    return ranked_before(a, b) ? -1 : ranked_before(b, a) ? 1 : 0;
}

typedef struct {
    Node *node;
    int64_t rank; /* position in the ranking: the order within a depth */
} Kept;

static int cmp_depth(const void *x, const void *y) {
    const Kept *a = x, *b = y;
    if (a->node->dep != b->node->dep) return a->node->dep < b->node->dep ? -1 : 1;
    return a->rank < b->rank ? -1 : a->rank > b->rank;
}

/* A node's class id (node_calibration.node_classes): who proposed it and, for the index alone, whether
 * its row's match was long. */
static int node_class(int src, int64_t match, long long_match) {
    if (src & LEARNED) return src & INDEX ? CLASS_BOTH : CLASS_LEARNED;
    return match >= long_match ? CLASS_INDEX_LONG : CLASS_INDEX_SHORT;
}

static double clamp01(double raw) { return raw < 0.0 ? 0.0 : raw > 1.0 ? 1.0 : raw; }

/* The counts of class `cls` and raw estimate `r` (in [0, 1]): NodeCalibration._bucket's bucket. */
static double *counts_of(const double *counts, long buckets, int cls, double r) {
    long bucket = (long)(r * (double)buckets);
    bucket = bucket < 0 ? 0 : bucket > buckets - 1 ? buckets - 1 : bucket;
    return (double *)counts + ((size_t)cls * (size_t)buckets + (size_t)bucket) * 2;
}

static double calibrated(const Calibration *c, int cls, double raw) {
    double r = clamp01(raw);
    const double *n = counts_of(c->counts, c->buckets, cls, r);
    double p = (n[0] + c->prior * r) / (n[1] + c->prior);
    return p < 1e-12 ? 1e-12 : p;
}

static void *address(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (!p && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null tensor address");
    return p;
}

/* Scratch space of one merge call, grown to the largest row's node count. */
typedef struct {
    Node *nodes;
    Node **order;
    Kept *kept;
    int64_t *position;
    Py_ssize_t cap;
} Work;

static void work_free(Work *w) { free(w->nodes), free(w->order), free(w->kept), free(w->position); }

static int work_reserve(Work *w, Py_ssize_t U) {
    if (U <= w->cap) return 0;
    Node *n = realloc(w->nodes, (size_t)U * sizeof(Node));
    if (n) w->nodes = n;
    Node **o = n ? realloc(w->order, (size_t)U * sizeof(Node *)) : NULL;
    if (o) w->order = o;
    Kept *k = o ? realloc(w->kept, (size_t)U * sizeof(Kept)) : NULL;
    if (k) w->kept = k;
    int64_t *p = k ? realloc(w->position, (size_t)U * sizeof(int64_t)) : NULL;
    if (p) w->position = p, w->cap = U;
    if (!p) PyErr_NoMemory();
    return p ? 0 : -1;
}

/* One row's merged tree, N nodes each (score may be NULL). */
typedef struct {
    int64_t *tok, *par, *dep;
    float *score, *raw;
    int8_t *src;
} Row;

/* One row's candidates from the index (`CandidateRows`' columns): M of them. */
typedef struct {
    const int64_t *tok, *par, *dep;
    const double *logp;
    Py_ssize_t M;
    int64_t match;
} Cands;

/* The candidate rows `CandidateRows` holds: B rows of `width` columns. Its ints: int64 [4 B width + 2 B],
 * tokens, parents, depths and counts [B, width], then n and match [B]; its logp: float64 [B, width]. */
typedef struct {
    const int64_t *tok, *par, *dep, *n, *match;
    const double *logp;
    Py_ssize_t width;
} CandRows;

static int cand_rows(PyObject *a_ints, PyObject *a_logp, Py_ssize_t width, Py_ssize_t B, CandRows *c) {
    Py_ssize_t cells = B * width;
    const int64_t *ints = address(a_ints);
    c->logp = cells ? address(a_logp) : NULL, c->width = width; /* (an empty tensor's address is null) */
    if (PyErr_Occurred()) return -1;
    c->tok = ints, c->par = ints + cells, c->dep = ints + 2 * cells, c->n = ints + 4 * cells, c->match = c->n + B;
    for (Py_ssize_t b = 0; b < B; b++)
        if (c->n[b] < 0 || c->n[b] > width) {
            PyErr_Format(PyExc_ValueError, "row %zd: %lld candidates in %zd columns", b, (long long)c->n[b], width);
            return -1;
        }
    return 0;
}

static Cands cand_row(const CandRows *c, Py_ssize_t b) {
    Py_ssize_t o = b * c->width;
    Cands r = {c->tok + o, c->par + o, c->dep + o, c->logp + o, (Py_ssize_t)c->n[b], c->match[b]};
    return r;
}

/* Merge one row: the learned tree's L nodes (rt, rp, rd, rs; L = 1: the root alone) and the row's index
 * candidates `c`, keeping the N - 1 best alive nodes no deeper than `max_depth`, written to `o` (the root
 * first, padding last: token 0 at depth 1 under the root). Returns the nodes kept (K; nodes K + 1..N - 1
 * are padding), or -1 with an exception set; *deepest: raised to the deepest kept node's depth. */
static Py_ssize_t merge_row(Work *w, const int64_t *rt, const int64_t *rp, const int64_t *rd, const float *rs,
                            Py_ssize_t L, int64_t root, const Cands *c, Py_ssize_t N, const Calibration *cal,
                            int64_t max_depth, int64_t *deepest, const Row *o) {
    Py_ssize_t M = c->M, U = L + M, K = 0;
    if (work_reserve(w, U) < 0) return -1;
    Node *nodes = w->nodes;
    for (Py_ssize_t u = 0; u < L; u++) {
        Node *n = &nodes[u];
        n->tok = rt[u], n->par = rp[u], n->dep = rd[u], n->node = u, n->id = u;
        n->est = (double)rs[u];
        n->src = u > 0 ? LEARNED : 0, n->alive = u > 0 && n->dep <= max_depth;
    }
    for (Py_ssize_t u = 0; u < L; u++) nodes[u].raw = exp(nodes[u].est - nodes[nodes[u].par].est);
    for (Py_ssize_t i = 0; i < M; i++) {
        Node *n = &nodes[L + i];
        int64_t p = c->par[i];
        if (p >= i || p < -1) {
            PyErr_Format(PyExc_ValueError, "a candidate's parent (%lld) must come before it (%zd)", (long long)p, i);
            return -1;
        }
        n->tok = c->tok[i], n->dep = c->dep[i], n->est = c->logp[i];
        n->par = p >= 0 ? L + p : 0;
        n->raw = exp(n->est - nodes[n->par].est);
        n->node = n->id = L + i, n->src = INDEX, n->alive = n->dep <= max_depth;
        /* a path the learned draft proposed is its node: its parent's node has a learned child of this
         * token (parents come first, so the parent's node is known) */
        int64_t parent_node = nodes[n->par].node;
        if (L > 1 && parent_node < L)
            for (Py_ssize_t v = 1; v < L; v++)
                if (rp[v] == parent_node && rt[v] == n->tok) {
                    Node *m = &nodes[v];
                    n->node = v, n->alive = 0;
                    if (n->est > m->est) m->est = n->est;
                    if (n->raw > m->raw) m->raw = n->raw;
                    m->src |= INDEX;
                    break;
                }
    }

    for (Py_ssize_t u = 0; u < U; u++) nodes[u].par = nodes[nodes[u].par].node; /* onto merged nodes */
    if (!cal->counts) {
        for (Py_ssize_t u = 0; u < U; u++) nodes[u].score = nodes[u].est;
    } else { /* parents first: a path's score is its parent's plus its own node's */
        int64_t levels = 0;
        for (Py_ssize_t u = 0; u < U; u++) {
            Node *n = &nodes[u];
            int cls = node_class(n->src, c->match, cal->long_match);
            n->score = log(calibrated(cal, cls, n->raw)); /* its own node's, until the paths are summed */
            if (n->dep > levels) levels = n->dep;
        }
        nodes[0].score = 0.0; /* the root */
        for (int64_t d = 1; d <= levels; d++)
            for (Py_ssize_t u = 0; u < U; u++)
                if (nodes[u].dep == d) nodes[u].score += nodes[nodes[u].par].score;
    }

    Node **order = w->order;
    Kept *kept = w->kept;
    for (Py_ssize_t u = 0; u < U; u++) order[u] = &nodes[u];
    qsort(order, (size_t)U, sizeof(Node *), cmp_rank);
    for (Py_ssize_t r = 0; r < U && K < N - 1 && order[r]->alive; r++) kept[K].node = order[r], kept[K].rank = r, K++;
    qsort(kept, (size_t)K, sizeof(Kept), cmp_depth);
    for (Py_ssize_t u = 0; u < U; u++) w->position[u] = 0; /* the root, and nodes not kept */
    for (Py_ssize_t j = 0; j < K; j++) w->position[kept[j].node->id] = j + 1;

    o->tok[0] = root, o->par[0] = 0, o->dep[0] = 0, o->src[0] = 0, o->raw[0] = 0.0f;
    if (o->score) o->score[0] = 0.0f;
    for (Py_ssize_t j = 1; j < N; j++) {
        if (j <= K) {
            const Node *n = kept[j - 1].node;
            o->tok[j] = n->tok, o->par[j] = w->position[n->par], o->dep[j] = n->dep;
            o->src[j] = (int8_t)n->src, o->raw[j] = (float)n->raw;
            if (o->score) o->score[j] = (float)n->score;
            if (n->dep > *deepest) *deepest = n->dep;
        } else { /* padding: token 0 at depth 1 under the root, never verified */
            o->tok[j] = 0, o->par[j] = 0, o->dep[j] = 1, o->src[j] = 0, o->raw[j] = 0.0f;
            if (o->score) o->score[j] = -INFINITY;
        }
    }
    return K;
}

/* merge(learned (tokens, parents, depth, score) addresses, B, L, root_tokens address, candidate rows (ints,
 *       logp) addresses, their width, num_verify, counts address or None, prior,
 *       buckets, long_match, max_depth, out (tokens, parents, depth, score, source, raw, kept, mask)
 *       addresses) -> all kept (bool)
 * learned: int64 [B, L] x 3 and float32 [B, L]; root_tokens int64 [B]; candidate rows: `CandidateRows`;
 * out: int64 [B, N] x 3, float32 [B, N], int8 [B, N], float32 [B, N], bool [B, N - 1], bool [B, N, N]. */
static PyObject *merge(PyObject *self, PyObject *args) {
    PyObject *a_ltok, *a_lpar, *a_ldep, *a_lscore, *a_root, *a_ints, *a_logp, *a_counts;
    PyObject *a_out[8];
    Py_ssize_t B, L, width, N;
    long long max_depth;
    Calibration cal;
    if (!PyArg_ParseTuple(args, "OOOOnnOOOnnOdllLOOOOOOOO", &a_ltok, &a_lpar, &a_ldep, &a_lscore, &B, &L, &a_root,
                          &a_ints, &a_logp, &width, &N, &a_counts, &cal.prior, &cal.buckets, &cal.long_match, &max_depth, &a_out[0], &a_out[1],
                          &a_out[2], &a_out[3], &a_out[4], &a_out[5], &a_out[6], &a_out[7]))
        return NULL;
    if (B < 0 || L < 1 || N < 1 || width < 0 || cal.buckets < 1) return PyErr_Format(PyExc_ValueError, "bad shapes");
    CandRows cands;
    if (cand_rows(a_ints, a_logp, width, B, &cands) < 0) return NULL;
    const int64_t *ltok = address(a_ltok), *lpar = address(a_lpar), *ldep = address(a_ldep);
    const float *lscore = address(a_lscore);
    const int64_t *root = address(a_root);
    cal.counts = a_counts == Py_None ? NULL : address(a_counts);
    int64_t *otok = address(a_out[0]), *opar = address(a_out[1]), *odep = address(a_out[2]);
    float *oscore = address(a_out[3]);
    int8_t *osrc = address(a_out[4]);
    float *oraw = address(a_out[5]);
    uint8_t *okept = address(a_out[6]), *omask = address(a_out[7]);
    if (PyErr_Occurred()) return NULL;
    Work w = {0};
    int all_kept = 1;
    for (Py_ssize_t b = 0; b < B; b++) {
        Row o = {otok + b * N, opar + b * N, odep + b * N, oscore + b * N, oraw + b * N, osrc + b * N};
        Cands c = cand_row(&cands, b);
        int64_t deepest = 0;
        Py_ssize_t K = merge_row(&w, ltok + b * L, lpar + b * L, ldep + b * L, lscore + b * L, L, root[b], &c, N,
                                 &cal, max_depth, &deepest, &o);
        if (K < 0) {
            work_free(&w);
            return NULL;
        }
        uint8_t *k = okept + b * (N - 1), *mask = omask + b * N * N;
        for (Py_ssize_t j = 1; j < N; j++) k[j - 1] = j <= K;
        if (K < N - 1) all_kept = 0;
        memset(mask, 0, (size_t)(N * N));
        for (Py_ssize_t j = 0; j < N; j++) { /* a node, then its ancestors up to the root */
            mask[j * N + j] = 1;
            for (int64_t a = j; a != 0;) {
                a = o.par[a];
                mask[j * N + a] = 1;
            }
        }
    }
    work_free(&w);
    return PyBool_FromLong(all_kept);
}

/* merge_rows(packed address or None, L, B, rows, root_tokens address, candidate rows (ints, logp) addresses,
 *            their width, num_verify, counts address or None, prior, buckets,
 *            long_match, max_depth, out (tokens, parents, depth, source, raw, valid, verify rows)
 *            addresses) -> (deepest, finite)
 * `merge` of the learned trees a static step packed (`StaticSteps.propose`: float64 [B, 4 L + 1], each
 * row's tokens, parents, depths, scores and whether its draft was finite; None: the index alone), whose
 * tree goes straight into the verify step's input (`steps.tree_rows`): verify rows int64 [rows, 4 N],
 * each row's tokens, parents, depths and whether verified; rows B.. a root alone. If any row's draft was
 * not finite, every row merges the index's candidates alone (finite: False). The merged tree itself, for
 * the calibration: tokens, parents, depth int64 [B, N], source int8 [B, N], raw float32 [B, N], valid bool
 * [B, N]. deepest: the deepest kept node's depth (0: none). */
static PyObject *merge_rows(PyObject *self, PyObject *args) {
    PyObject *a_packed, *a_root, *a_ints, *a_logp, *a_counts, *a_out[7];
    Py_ssize_t L, B, R, width, N;
    long long max_depth;
    Calibration cal;
    if (!PyArg_ParseTuple(args, "OnnnOOOnnOdllLOOOOOOO", &a_packed, &L, &B, &R, &a_root, &a_ints, &a_logp, &width,
                          &N, &a_counts, &cal.prior,
                          &cal.buckets, &cal.long_match, &max_depth, &a_out[0], &a_out[1], &a_out[2], &a_out[3],
                          &a_out[4], &a_out[5], &a_out[6]))
        return NULL;
    if (B < 0 || R < B || L < 1 || N < 1 || width < 0 || cal.buckets < 1)
        return PyErr_Format(PyExc_ValueError, "bad shapes");
    CandRows cands;
    if (cand_rows(a_ints, a_logp, width, B, &cands) < 0) return NULL;
    const double *packed = a_packed == Py_None ? NULL : address(a_packed);
    const int64_t *root = address(a_root);
    cal.counts = a_counts == Py_None ? NULL : address(a_counts);
    int64_t *otok = address(a_out[0]), *opar = address(a_out[1]), *odep = address(a_out[2]);
    int8_t *osrc = address(a_out[3]);
    float *oraw = address(a_out[4]);
    uint8_t *ovalid = address(a_out[5]);
    int64_t *out = address(a_out[6]);
    if (PyErr_Occurred()) return NULL;
    int finite = 1;
    for (Py_ssize_t b = 0; packed && b < B; b++) finite &= packed[b * (4 * L + 1) + 4 * L] > 0;
    Py_ssize_t Lrow = packed && finite ? L : 1; /* the learned nodes merged: the root alone without them */
    int64_t *learned = malloc((size_t)(3 * Lrow) * sizeof(int64_t));
    float *score = malloc((size_t)Lrow * sizeof(float));
    if (!learned || !score) {
        free(learned), free(score);
        return PyErr_NoMemory();
    }
    Work w = {0};
    int64_t deepest = 0;
    int failed = 0;
    for (Py_ssize_t b = 0; b < B && !failed; b++) {
        int64_t *t = out + b * 4 * N;
        if (Lrow > 1) {
            const double *row = packed + b * (4 * L + 1);
            for (Py_ssize_t u = 0; u < L; u++) {
                learned[u] = (int64_t)row[u], learned[L + u] = (int64_t)row[L + u];
                learned[2 * L + u] = (int64_t)row[2 * L + u], score[u] = (float)row[3 * L + u];
            }
        } else {
            learned[0] = root[b], learned[1] = learned[2] = 0, score[0] = 0.0f;
        }
        Row o = {otok + b * N, opar + b * N, odep + b * N, NULL, oraw + b * N, osrc + b * N};
        Cands c = cand_row(&cands, b);
        Py_ssize_t K = merge_row(&w, learned, learned + Lrow, learned + 2 * Lrow, score, Lrow, root[b], &c, N, &cal,
                                 max_depth, &deepest, &o);
        failed = K < 0;
        for (Py_ssize_t j = 0; j < N && !failed; j++) {
            ovalid[b * N + j] = j <= K;
            t[j] = o.tok[j], t[N + j] = o.par[j], t[2 * N + j] = o.dep[j], t[3 * N + j] = j <= K;
        }
    }
    for (Py_ssize_t b = B; b < R && !failed; b++) { /* padded rows: a root alone (token 0), never verified nodes */
        int64_t *t = out + b * 4 * N;
        memset(t, 0, (size_t)(4 * N) * sizeof(int64_t));
        for (Py_ssize_t j = 1; j < N; j++) t[2 * N + j] = 1;
        t[3 * N] = 1;
    }
    work_free(&w);
    free(learned), free(score);
    if (failed) return NULL;
    return Py_BuildValue("(LO)", (long long)deepest, finite ? Py_True : Py_False);
}

/* observe(parents, source, raw, valid or None, match, path, accepted addresses, B, N, D, counts address or
 *         None, buckets, long_match) -> index-accepted: `calibration_outcomes` and `NodeCalibration.observe`
 * of a verified merged tree in one pass: every verified non-root node whose parent was reached (the root,
 * or a node on the accepted path) counts once in its class and raw bucket as reached, and as accepted if
 * it is on the path (counts None: nothing counted). Returns the accepted nodes the index proposed.
 * parents int64 [B, N], source int8 [B, N], raw float32 [B, N], valid bool [B, N], match int64 [B],
 * path int64 [B, D], accepted int64 [B]; counts float64 [class, bucket, (accepted, reached)]. */
static PyObject *observe(PyObject *self, PyObject *args) {
    PyObject *a[8];
    Py_ssize_t B, N, D;
    long buckets, long_match;
    if (!PyArg_ParseTuple(args, "OOOOOOOnnnOll", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &B, &N, &D, &a[7],
                          &buckets, &long_match))
        return NULL;
    if (B < 0 || N < 1 || D < 0 || buckets < 1) return PyErr_Format(PyExc_ValueError, "bad shapes");
    const int64_t *parents = address(a[0]);
    const int8_t *source = address(a[1]);
    const float *raw = address(a[2]);
    const uint8_t *valid = a[3] == Py_None ? NULL : address(a[3]);
    const int64_t *match = address(a[4]), *path = D ? address(a[5]) : NULL, *accepted = address(a[6]);
    double *counts = a[7] == Py_None ? NULL : address(a[7]);
    if (PyErr_Occurred()) return NULL;
    uint8_t *on_path = malloc((size_t)N);
    if (!on_path) return PyErr_NoMemory();
    long long from_index = 0;
    for (Py_ssize_t b = 0; b < B; b++) {
        memset(on_path, 0, (size_t)N);
        for (int64_t k = 0; k < accepted[b] && k < D; k++) {
            int64_t node = path[b * D + k];
            if (node < 0 || node >= N) {
                free(on_path);
                return PyErr_Format(PyExc_ValueError, "an accepted node (%lld) outside the tree", (long long)node);
            }
            on_path[node] = 1;
            from_index += (source[b * N + node] & INDEX) != 0;
        }
        for (Py_ssize_t n = 1; counts && n < N; n++) {
            int64_t parent = parents[b * N + n];
            if ((valid && !valid[b * N + n]) || parent < 0 || parent >= N || !(parent == 0 || on_path[parent])) continue;
            int cls = node_class(source[b * N + n], match[b], long_match);
            double *c = counts_of(counts, buckets, cls, clamp01((double)raw[b * N + n]));
            c[0] += on_path[n];
            c[1] += 1.0;
        }
    }
    free(on_path);
    return PyLong_FromLongLong(from_index);
}

static PyMethodDef methods[] = {
    {"merge", merge, METH_VARARGS, "hybrid_tree's merge, row by row (tree.py calls it)."},
    {"merge_rows", merge_rows, METH_VARARGS, "merge of a static step's packed learned trees into the verify's input."},
    {"observe", observe, METH_VARARGS, "A verified merged tree's calibration counts (tree.py calls it)."},
    {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree_merge",
                                    "hybrid_tree's merge in C (tree.py holds the batched reference).", -1, methods};

PyMODINIT_FUNC PyInit__tree_merge(void) { return PyModule_Create(&module); }
