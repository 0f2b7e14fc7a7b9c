/* The suffix trie of fastgrpo/speculation/suffix_index.py in C: the same structure, the same answers.
 *
 * `SuffixTrie` and `TrieWriter` here behave as the Python classes of that module (which stay as the
 * reference and the fallback where this extension is not built): the suffixes of every inserted text
 * cut at `max_depth` tokens, with occurrence counts and suffix links; a writer appends one token to
 * every suffix ending at its text's last token; `match` finds the longest suffix of a context that
 * occurred with a continuation; `continuations` is the best-first search of the most probable paths
 * below a node. A node's children are kept in the order they were added (a removed child and a later
 * re-added one go last), as a Python dict keeps them, so ties between equally probable paths are
 * broken as the Python search breaks them and both return identical candidates.
 *
 * Why C: a writer touches up to `max_depth` nodes per token and a lookup walks a heap of paths; in
 * Python this is about a hundred microseconds of host time per running sequence and step, on the
 * critical path of every speculative step. Nodes are integer ids into flat arrays; ids of removed
 * nodes are reused. A node's children form a list through sibling links (in the order they were
 * added; unlinked in constant time), and an open-addressing table maps (parent, token) to the child,
 * so that a step costs the same whatever a node's fan-out (the root's is every distinct token).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    int32_t max_depth;
    int32_t size, cap; /* node ids in use or free: 0 .. size-1; node 0 is the root */
    int32_t *count, *depth, *link, *token;
    int32_t *first, *last, *next, *prev; /* children lists (-1: none) */
    int32_t *free_ids;
    int32_t n_free, free_cap;
    uint64_t *keys; /* the edge table: (parent << 32 | token) -> child, linear probing */
    int32_t *vals;
    size_t slots, used; /* slots: a power of two */
} Trie;

typedef struct {
    PyObject_HEAD
    Trie *trie;
    PyObject *tokens;  /* list of ints: the text written */
    int32_t *frontier; /* frontier[i]: the node of the text's last i + 1 tokens */
    int32_t *next;     /* the frontier being made by an append */
    int32_t n_frontier;
} Writer;

static PyTypeObject TrieType;
static PyTypeObject WriterType;

/* -- growable arrays ------------------------------------------------------------------------------ */
static int grow_i32(int32_t **a, int32_t *cap, int32_t need) {
    if (need <= *cap) return 0;
    int32_t c = *cap ? *cap : 8;
    while (c < need) c *= 2;
    int32_t *p = realloc(*a, (size_t)c * sizeof(int32_t));
    if (!p) { PyErr_NoMemory(); return -1; }
    *a = p;
    *cap = c;
    return 0;
}

/* -- the edge table ------------------------------------------------------------------------------ */
#define EMPTY UINT64_MAX

static uint64_t edge_key(int32_t parent, int32_t x) { return (uint64_t)(uint32_t)parent << 32 | (uint32_t)x; }

static size_t edge_home(const Trie *t, uint64_t key) {
    key ^= key >> 33; /* the finaliser of MurmurHash3 */
    key *= 0xff51afd7ed558ccdULL;
    key ^= key >> 33;
    key *= 0xc4ceb9fe1a85ec53ULL;
    key ^= key >> 33;
    return (size_t)key & (t->slots - 1);
}

static int32_t kid(const Trie *t, int32_t parent, int32_t x) {
    uint64_t key = edge_key(parent, x);
    for (size_t i = edge_home(t, key);; i = (i + 1) & (t->slots - 1)) {
        if (t->keys[i] == key) return t->vals[i];
        if (t->keys[i] == EMPTY) return -1;
    }
}

static void edge_place(Trie *t, uint64_t key, int32_t child) {
    size_t i = edge_home(t, key);
    while (t->keys[i] != EMPTY) i = (i + 1) & (t->slots - 1);
    t->keys[i] = key;
    t->vals[i] = child;
}

/* The table at `slots` slots (a power of two), every edge placed again. */
static int edge_resize(Trie *t, size_t slots) {
    size_t old_slots = t->slots;
    uint64_t *old_keys = t->keys;
    int32_t *old_vals = t->vals;
    uint64_t *keys = malloc(slots * sizeof(uint64_t));
    int32_t *vals = malloc(slots * sizeof(int32_t));
    if (!keys || !vals) { free(keys), free(vals); PyErr_NoMemory(); return -1; }
    memset(keys, 0xff, slots * sizeof(uint64_t)); /* EMPTY */
    t->keys = keys, t->vals = vals, t->slots = slots;
    for (size_t i = 0; i < old_slots; i++)
        if (old_keys[i] != EMPTY) edge_place(t, old_keys[i], old_vals[i]);
    free(old_keys), free(old_vals);
    return 0;
}

static int edge_add(Trie *t, int32_t parent, int32_t x, int32_t child) {
    if (2 * (t->used + 1) > t->slots && edge_resize(t, 2 * t->slots) < 0) return -1; /* at most half full */
    edge_place(t, edge_key(parent, x), child);
    t->used++;
    return 0;
}

/* Removed by shifting back the entries after it that probed past its slot (no tombstones). */
static void edge_remove(Trie *t, int32_t parent, int32_t x) {
    uint64_t key = edge_key(parent, x);
    size_t mask = t->slots - 1, i = edge_home(t, key);
    while (t->keys[i] != key) i = (i + 1) & mask;
    for (size_t j = (i + 1) & mask; t->keys[j] != EMPTY; j = (j + 1) & mask) {
        size_t home = edge_home(t, t->keys[j]);
        /* j's entry may move to the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) {
            t->keys[i] = t->keys[j], t->vals[i] = t->vals[j];
            i = j;
        }
    }
    t->keys[i] = EMPTY;
    t->used--;
}

/* -- nodes ------------------------------------------------------------------------------------------ */
static int32_t *grow_nodes(int32_t *a, int32_t cap) {
    int32_t *p = realloc(a, (size_t)cap * sizeof(int32_t));
    if (!p) PyErr_NoMemory();
    return p;
}

/* A node of no occurrence yet, the last child of `parent` by token `x` (a removed node's id if one is
 * free). */
static int32_t trie_new(Trie *t, int32_t parent, int32_t x, int32_t depth, int32_t link) {
    int32_t node;
    if (t->n_free) {
        node = t->free_ids[--t->n_free];
    } else {
        if (t->size == t->cap) {
            int32_t c = t->cap ? t->cap * 2 : 64;
            int32_t **arrays[8] = {&t->count, &t->depth, &t->link, &t->token,
                                   &t->first, &t->last, &t->next, &t->prev};
            for (int i = 0; i < 8; i++) {
                int32_t *p = grow_nodes(*arrays[i], c);
                if (!p) return -1;
                *arrays[i] = p;
            }
            t->cap = c;
        }
        node = t->size++;
    }
    t->count[node] = 0, t->depth[node] = depth, t->link[node] = link, t->token[node] = x;
    t->first[node] = t->last[node] = t->next[node] = t->prev[node] = -1;
    if (parent >= 0) {
        if (edge_add(t, parent, x, node) < 0) return -1;
        t->prev[node] = t->last[parent];
        if (t->last[parent] >= 0)
            t->next[t->last[parent]] = node;
        else
            t->first[parent] = node;
        t->last[parent] = node;
    }
    return node;
}

/* `child` leaves its parent's children (its own stay linked to it). */
static void unlink_child(Trie *t, int32_t parent, int32_t child) {
    edge_remove(t, parent, t->token[child]);
    if (t->prev[child] >= 0) t->next[t->prev[child]] = t->next[child]; else t->first[parent] = t->next[child];
    if (t->next[child] >= 0) t->prev[t->next[child]] = t->prev[child]; else t->last[parent] = t->prev[child];
}

static long as_token(PyObject *o) {
    long x = PyLong_AsLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < 0 || x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "a token id must be in [0, 2^31), got %ld", x);
        return -1;
    }
    return x;
}

/* -- SuffixTrie --------------------------------------------------------------------------------- */
static int Trie_init(Trie *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_depth", NULL};
    int max_depth;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i", names, &max_depth)) return -1;
    if (max_depth < 2) {
        PyErr_Format(PyExc_ValueError, "max_depth must be >= 2, got %d", max_depth);
        return -1;
    }
    if (self->size) { PyErr_SetString(PyExc_RuntimeError, "SuffixTrie initialised twice"); return -1; }
    self->max_depth = max_depth;
    if (edge_resize(self, 256) < 0) return -1;
    return trie_new(self, -1, -1, 0, 0) < 0 ? -1 : 0;
}

static void Trie_dealloc(Trie *self) {
    free(self->count), free(self->depth), free(self->link), free(self->token), free(self->free_ids);
    free(self->first), free(self->last), free(self->next), free(self->prev), free(self->keys), free(self->vals);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Trie_nodes(Trie *self, void *closure) {
    return PyLong_FromLong(self->size - self->n_free);
}

static PyObject *Trie_max_depth(Trie *self, void *closure) { return PyLong_FromLong(self->max_depth); }

static PyObject *Trie_writer(Trie *self, PyObject *unused);
static int writer_extend(Writer *w, PyObject *tokens);

static PyObject *Trie_insert(Trie *self, PyObject *tokens) {
    Writer *w = (Writer *)Trie_writer(self, NULL);
    if (!w) return NULL;
    if (writer_extend(w, tokens) < 0) { Py_DECREF(w); return NULL; }
    return (PyObject *)w;
}

/* Remove one earlier insertion of `tokens`: every count it added is taken back, and strings that no
 * longer occur leave the trie (the same walk as the Python reference's). */
static PyObject *Trie_remove(Trie *self, PyObject *tokens) {
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int32_t md = self->max_depth;
    int32_t *frontier = malloc((size_t)(md + 1) * sizeof(int32_t));
    int32_t *next = malloc((size_t)(md + 1) * sizeof(int32_t));
    int32_t *freed = NULL, n_freed = 0, freed_cap = 0, nf = 0;
    if (!frontier || !next) goto nomem;
    for (Py_ssize_t i = 0; i < n; i++) {
        long x = as_token(PySequence_Fast_GET_ITEM(seq, i));
        if (x < 0) goto fail;
        /* as a writer's append: next[k] is frontier[k - 1] extended by x, the deepest found by its edge
         * and the others by suffix links (a detached node keeps its link and edges until the walk ends) */
        int32_t top = nf < md - 1 ? nf : md - 1;
        if ((next[top] = kid(self, top ? frontier[top - 1] : 0, (int32_t)x)) < 0) {
            PyErr_SetString(PyExc_KeyError, "remove: the text was not inserted");
            goto fail;
        }
        for (int32_t k = top; k > 0; k--) next[k - 1] = self->link[next[k]];
        for (int32_t k = 0; k <= top; k++) { /* shallowest first, as the Python trie frees them */
            int32_t child = next[k];
            if (--self->count[child] == 0) {
                unlink_child(self, k ? frontier[k - 1] : 0, child); /* still walked for the tokens after it */
                if (grow_i32(&freed, &freed_cap, n_freed + 1) < 0) goto fail;
                freed[n_freed++] = child;
            }
        }
        int32_t *s = frontier;
        frontier = next, next = s, nf = top + 1;
    }
    if (grow_i32(&self->free_ids, &self->free_cap, self->n_free + n_freed) < 0) goto fail;
    for (int32_t i = 0; i < n_freed; i++) /* reusable only now that the walk is done (their children, no
                                             longer occurring either, were unlinked by it) */
        self->free_ids[self->n_free++] = freed[i];
    free(frontier), free(next), free(freed);
    Py_DECREF(seq);
    Py_RETURN_NONE;
nomem:
    PyErr_NoMemory();
fail:
    free(frontier), free(next), free(freed);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *match_result(const Trie *t, int32_t node) {
    while (node != 0 && t->first[node] < 0) node = t->link[node];
    return Py_BuildValue("(ii)", node, t->depth[node]);
}

/* The node of the longest suffix of `tail` (at most `window` tokens) that occurs with a continuation,
 * and its length. */
static PyObject *Trie_match(Trie *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"tail", "window", NULL};
    PyObject *tail;
    int window;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi", names, &tail, &window)) return NULL;
    if (window < 1) return PyErr_Format(PyExc_ValueError, "window must be >= 1, got %d", window);
    PyObject *seq = PySequence_Fast(tail, "tail must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int32_t node = 0;
    for (Py_ssize_t i = n > window ? n - window : 0; i < n; i++) {
        long x = as_token(PySequence_Fast_GET_ITEM(seq, i));
        if (x < 0) { Py_DECREF(seq); return NULL; }
        for (;;) {
            if (self->depth[node] >= window) node = self->link[node];
            int32_t child = kid(self, node, (int32_t)x);
            if (child >= 0) { node = child; break; }
            if (node == 0) break;
            node = self->link[node];
        }
    }
    Py_DECREF(seq);
    return match_result(self, node);
}

typedef struct {
    double neg; /* minus the path's log-probability */
    int64_t tie;
    int32_t child, index, token;
} Entry;

static int before(const Entry *a, const Entry *b) {
    return a->neg < b->neg || (a->neg == b->neg && a->tie < b->tie);
}

typedef struct {
    Entry *a;
    Py_ssize_t n, cap;
} Heap;

static int heap_push(Heap *h, Entry e) {
    if (h->n == h->cap) {
        Py_ssize_t c = h->cap ? h->cap * 2 : 64;
        Entry *p = realloc(h->a, (size_t)c * sizeof(Entry));
        if (!p) { PyErr_NoMemory(); return -1; }
        h->a = p, h->cap = c;
    }
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!before(&e, &h->a[up])) break;
        h->a[i] = h->a[up];
        i = up;
    }
    h->a[i] = e;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->a[0], last = h->a[--h->n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && before(&h->a[c + 1], &h->a[c])) c++;
        if (!before(&h->a[c], &last)) break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n) h->a[i] = last;
    return top;
}

static int push_children(const Trie *t, Heap *h, int64_t *tie, int32_t parent, double logp, int32_t index,
                         double prior, double floor) {
    int64_t total = 0;
    for (int32_t child = t->first[parent]; child >= 0; child = t->next[child]) total += t->count[child];
    double denominator = (double)total + prior;
    for (int32_t child = t->first[parent]; child >= 0; child = t->next[child]) {
        double lp = logp + log((double)t->count[child] / denominator);
        if (lp >= floor) {
            Entry e = {-lp, (*tie)++, child, index, t->token[child]};
            if (heap_push(h, e) < 0) return -1;
        }
    }
    return 0;
}

/* One row of continuations (flat arrays of `budget` entries each; counts may be NULL). */
typedef struct {
    int64_t *tokens, *parents, *depth, *counts;
    double *logp;
} Found;

/* The `budget` most probable continuation paths below `node`, at most `depth` tokens deep, best first,
 * written to `out` (parents: the index of the node's parent among them, -1 under `node`). Returns how
 * many, or -1 with an exception set. */
static Py_ssize_t continue_into(const Trie *t, int32_t node, Py_ssize_t budget, int32_t depth, double prior,
                                double min_prob, const Found *out) {
    double floor = min_prob > 0 ? log(min_prob) : -INFINITY;
    Heap h = {0};
    int64_t tie = 0;
    Py_ssize_t n = 0;
    if (push_children(t, &h, &tie, node, 0.0, -1, prior, floor) < 0) n = -1;
    while (n >= 0 && h.n && n < budget) {
        Entry e = heap_pop(&h);
        int64_t d = e.index < 0 ? 1 : out->depth[e.index] + 1;
        out->tokens[n] = e.token, out->parents[n] = e.index, out->depth[n] = d, out->logp[n] = -e.neg;
        if (out->counts) out->counts[n] = t->count[e.child];
        if (d < depth && push_children(t, &h, &tie, e.child, -e.neg, (int32_t)n, prior, floor) < 0) n = -1;
        else n++;
    }
    free(h.a);
    return n;
}

/* The `budget` most probable continuation paths below `node`, at most `depth` tokens deep, best first:
 * (tokens, parents, depths, log-probabilities, counts), lists as `Candidates` holds them. */
static PyObject *Trie_continuations(Trie *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"node", "budget", "depth", "prior", "min_prob", NULL};
    int node, budget, depth;
    double prior = 1.0, min_prob = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iii|dd", names, &node, &budget, &depth, &prior, &min_prob))
        return NULL;
    if (node < 0 || node >= self->size) return PyErr_Format(PyExc_IndexError, "no node %d", node);
    Py_ssize_t cap = budget > 0 ? budget : 0;
    int64_t *ints = malloc((size_t)(4 * cap + 1) * sizeof(int64_t));
    double *logp = malloc((size_t)(cap + 1) * sizeof(double));
    if (!ints || !logp) {
        free(ints), free(logp);
        return PyErr_NoMemory();
    }
    Found f = {ints, ints + cap, ints + 2 * cap, ints + 3 * cap, logp};
    Py_ssize_t n = continue_into(self, node, cap, depth, prior, min_prob, &f);
    PyObject *lists[5] = {NULL};
    if (n >= 0) {
        for (int i = 0; i < 5; i++) lists[i] = PyList_New(n);
        for (Py_ssize_t j = 0; j < n && lists[4]; j++) {
            PyList_SET_ITEM(lists[0], j, PyLong_FromLongLong(f.tokens[j]));
            PyList_SET_ITEM(lists[1], j, PyLong_FromLongLong(f.parents[j]));
            PyList_SET_ITEM(lists[2], j, PyLong_FromLongLong(f.depth[j]));
            PyList_SET_ITEM(lists[3], j, PyFloat_FromDouble(f.logp[j]));
            PyList_SET_ITEM(lists[4], j, PyLong_FromLongLong(f.counts[j]));
        }
    }
    free(ints), free(logp);
    if (n < 0 || !lists[0] || !lists[1] || !lists[2] || !lists[3] || !lists[4] || PyErr_Occurred()) {
        for (int i = 0; i < 5; i++) Py_XDECREF(lists[i]);
        return NULL;
    }
    return Py_BuildValue("(NNNNN)", lists[0], lists[1], lists[2], lists[3], lists[4]);
}

/* -- TrieWriter --------------------------------------------------------------------------------- */
static PyObject *Trie_writer(Trie *self, PyObject *unused) {
    Writer *w = PyObject_New(Writer, &WriterType);
    if (!w) return NULL;
    Py_INCREF(self);
    w->trie = self;
    w->n_frontier = 0;
    w->tokens = PyList_New(0);
    w->frontier = malloc((size_t)self->max_depth * sizeof(int32_t));
    w->next = malloc((size_t)self->max_depth * sizeof(int32_t));
    if (!w->tokens || !w->frontier || !w->next) {
        if (w->tokens) PyErr_NoMemory();
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

static void Writer_dealloc(Writer *self) {
    Py_XDECREF(self->tokens);
    Py_XDECREF(self->trie);
    free(self->frontier);
    free(self->next);
    PyObject_Free(self);
}

/* One token appended: each suffix that ended at the text's last token, extended by it, occurs once more
 * (frontier[i], i + 1 tokens deep, gets a child i + 2 deep, whose suffix link is the child made just
 * before it; none past the cut). */
static int writer_append(Writer *w, int32_t x) {
    Trie *t = w->trie;
    int32_t *f = w->frontier, *g = w->next;
    int32_t top = w->n_frontier < t->max_depth - 1 ? w->n_frontier : t->max_depth - 1; /* g[top]: the deepest */
    /* g[k] = f[k - 1] extended by x (g[0]: the root's child). The strings that occur are closed under
     * suffixes, so the deepest that already occurs and its suffix links give every shallower one: one
     * lookup a token where the text repeats earlier text, instead of one a level. */
    int32_t found = top;
    while (found >= 0 && (g[found] = kid(t, found ? f[found - 1] : 0, x)) < 0) found--;
    for (int32_t k = found; k > 0; k--) g[k - 1] = t->link[g[k]];
    for (int32_t k = found + 1; k <= top; k++) /* the new strings, shallowest first */
        if ((g[k] = trie_new(t, k ? f[k - 1] : 0, x, k + 1, k ? g[k - 1] : 0)) < 0) return -1;
    for (int32_t k = 0; k <= top; k++) t->count[g[k]]++;
    w->frontier = g, w->next = f, w->n_frontier = top + 1;
    return 0;
}

static int writer_extend(Writer *w, PyObject *tokens) {
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        long x = as_token(o);
        if (x < 0 || writer_append(w, (int32_t)x) < 0 || PyList_Append(w->tokens, o) < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *Writer_append(Writer *self, PyObject *token) {
    long x = as_token(token);
    if (x < 0 || writer_append(self, (int32_t)x) < 0 || PyList_Append(self->tokens, token) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Writer_extend(Writer *self, PyObject *tokens) {
    if (writer_extend(self, tokens) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The longest suffix of this text (at most `window` tokens) that has occurred with a continuation, read
 * off the frontier. */
static PyObject *Writer_match(Writer *self, PyObject *arg) {
    long window = PyLong_AsLong(arg);
    if (window == -1 && PyErr_Occurred()) return NULL;
    const Trie *t = self->trie;
    for (long length = window < self->n_frontier ? window : self->n_frontier; length > 0; length--) {
        int32_t node = self->frontier[length - 1];
        if (t->first[node] >= 0) return Py_BuildValue("(il)", node, length);
    }
    return Py_BuildValue("(ii)", 0, 0);
}

static PyObject *Writer_tokens(Writer *self, void *closure) { return Py_NewRef(self->tokens); }
static PyObject *Writer_trie(Writer *self, void *closure) { return Py_NewRef((PyObject *)self->trie); }

/* lookup_rows(writers, window, budget, depth, prior, min_prob, ints address, logp address) -> rows matched:
 * `SuffixIndex.lookup` of each writer's text from its own trie, every row into flat arrays (`CandidateRows`:
 * B = len(writers) rows of `budget` columns; ints int64 [4 B budget + 2 B]: tokens, parents, depths, counts,
 * then n [B] and match [B], the match length, 0 where nothing was found; logp float64 [B, budget]), without a
 * Python object a candidate: a continuation's prior is `prior` over the row's match length, as the index's
 * lookup sets it. The columns past a row's n are left as they were. */
static PyObject *lookup_rows(PyObject *module, PyObject *args) {
    PyObject *writers, *a_ints, *a_logp;
    int window, budget, depth;
    double prior, min_prob;
    if (!PyArg_ParseTuple(args, "OiiiddOO", &writers, &window, &budget, &depth, &prior, &min_prob, &a_ints, &a_logp))
        return NULL;
    if (window < 1 || budget < 0) return PyErr_Format(PyExc_ValueError, "window must be >= 1 and budget >= 0");
    int64_t *ints = PyLong_AsVoidPtr(a_ints);
    double *logp = PyLong_AsVoidPtr(a_logp);
    if (PyErr_Occurred()) return NULL;
    PyObject *rows = PySequence_Fast(writers, "writers must be a sequence of TrieWriter");
    if (!rows) return NULL;
    Py_ssize_t B = PySequence_Fast_GET_SIZE(rows), cells = B * budget, matched = 0;
    if ((B && !ints) || (cells && !logp)) { /* (an empty tensor's address is null) */
        Py_DECREF(rows);
        return PyErr_Format(PyExc_ValueError, "a null array address");
    }
    int64_t *n = ints + 4 * cells, *match = n + B;
    for (Py_ssize_t b = 0; b < B; b++) {
        PyObject *o = PySequence_Fast_GET_ITEM(rows, b);
        if (!PyObject_TypeCheck(o, &WriterType)) {
            Py_DECREF(rows);
            return PyErr_Format(PyExc_TypeError, "row %zd: a TrieWriter, not %s", b, Py_TYPE(o)->tp_name);
        }
        const Writer *w = (const Writer *)o;
        const Trie *t = w->trie;
        int32_t node = 0, length = window < w->n_frontier ? window : w->n_frontier;
        for (; length > 0; length--)
            if (t->first[node = w->frontier[length - 1]] >= 0) break;
        Py_ssize_t at = b * budget;
        Found f = {ints + at, ints + cells + at, ints + 2 * cells + at, ints + 3 * cells + at, logp + at};
        Py_ssize_t found = length ? continue_into(t, node, budget, depth, prior / length, min_prob, &f) : 0;
        if (found < 0) {
            Py_DECREF(rows);
            return NULL;
        }
        n[b] = found, match[b] = found ? length : 0;
        matched += found > 0;
    }
    Py_DECREF(rows);
    return PyLong_FromSsize_t(matched);
}

static PyMethodDef module_methods[] = {
    {"lookup_rows", lookup_rows, METH_VARARGS, "Each writer's candidates into flat arrays (suffix_index.py calls it)."},
    {NULL}};

/* -- the types ---------------------------------------------------------------------------------- */
static PyMethodDef Trie_methods[] = {
    {"writer", (PyCFunction)Trie_writer, METH_NOARGS, "A text inserted token by token."},
    {"insert", (PyCFunction)Trie_insert, METH_O, "Insert a text; returns its writer."},
    {"remove", (PyCFunction)Trie_remove, METH_O, "Remove one earlier insertion of a text."},
    {"match", (PyCFunction)(void (*)(void))Trie_match, METH_VARARGS | METH_KEYWORDS,
     "match(tail, window) -> (node, length)"},
    {"continuations", (PyCFunction)(void (*)(void))Trie_continuations, METH_VARARGS | METH_KEYWORDS,
     "continuations(node, budget, depth, prior=1.0, min_prob=0.0) -> (tokens, parents, depth, logp, counts)"},
    {NULL}};

static PyGetSetDef Trie_getset[] = {
    {"nodes", (getter)Trie_nodes, NULL, "Nodes in the trie, the root included.", NULL},
    {"max_depth", (getter)Trie_max_depth, NULL, "Deepest node.", NULL},
    {NULL}};

static PyTypeObject TrieType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastgrpo.speculation._suffix_trie.SuffixTrie",
    .tp_basicsize = sizeof(Trie),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The suffixes of every inserted text, cut at max_depth tokens, with occurrence counts.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Trie_init,
    .tp_dealloc = (destructor)Trie_dealloc,
    .tp_methods = Trie_methods,
    .tp_getset = Trie_getset,
};

static PyMethodDef Writer_methods[] = {
    {"append", (PyCFunction)Writer_append, METH_O, "Append one token."},
    {"extend", (PyCFunction)Writer_extend, METH_O, "Append tokens."},
    {"match", (PyCFunction)Writer_match, METH_O, "match(window) -> (node, length)"},
    {NULL}};

static PyGetSetDef Writer_getset[] = {
    {"tokens", (getter)Writer_tokens, NULL, "The text written (a list, appended to in place).", NULL},
    {"trie", (getter)Writer_trie, NULL, "The trie written into.", NULL},
    {NULL}};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastgrpo.speculation._suffix_trie.TrieWriter",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One text being inserted (SuffixTrie.writer()).",
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_suffix_trie",
                                    "fastgrpo's suffix trie in C (suffix_index.py holds the reference).", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__suffix_trie(void) {
    if (PyType_Ready(&TrieType) < 0 || PyType_Ready(&WriterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "SuffixTrie", (PyObject *)&TrieType) < 0 ||
        PyModule_AddObjectRef(m, "TrieWriter", (PyObject *)&WriterType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
