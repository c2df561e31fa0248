/* The gateway's weighted combine in C: out[toks[i]] (= or +=) wts[i] * y[rows[i] - row0]:
 * written (a segment of first slots), added, or written where the token has no contribution
 * yet and added where it has (a chunked round's sum, which is never zeroed: ChunkSum).
 *
 * gateway/dispatch.py's numpy path does the same in three passes per segment (np.take
 * into a temporary, a multiply, a fancy-indexed add that gathers, adds and scatters again),
 * each over the whole segment: memory traffic and fresh temporaries several times what one
 * pass costs that reads each reply row once and adds it into its token's row (see
 * docs/design.md#the-gateways-loops-in-c). Same operations in the same order, each
 * rounded the same way (a float32 product, then a float32 sum; no fused multiply-add: see
 * setup.py's -ffp-contract=off), so the two paths give the same bits.
 *
 * Replies in bf16 (the bits as uint16) are widened to float32 as each row is read, exactly
 * (the 16 bits become a float32's high half), so the sum is the float32 one numpy's path
 * makes after widening a whole segment into a temporary. And the sum is rounded back to
 * bf16 (to_bf16) in one pass: numpy's round-to-nearest-even takes six passes and a scratch
 * array. Or, with each
 * token's count of contributions still to come, scatter rounds a token's sum into the bf16
 * output as its last contribution is added: a chunked round then has only its last chunk's
 * tokens left to round, not the whole sum.
 *
 * Every index is checked against the array it points into before anything is written,
 * and the loop runs without the GIL.
 *
 * And the gather that fills a send slot, out[i] = x[idx[i]]: numpy's take writes with
 * ordinary stores, and each line written is first read into the cache (and evicts what
 * was there). A gather of a megabyte or more writes with non-temporal stores instead,
 * which is faster a row, and the worker reads the slot from memory either way at that
 * size. Smaller gathers copy row by row (memcpy): the worker
 * may still find them in the cache.
 *
 * And the plan's sort: every routed (token, slot) ordered by (worker, expert, token), as
 * a counting sort over the worker x expert cells. numpy needs a stable argsort, a divmod,
 * four gathers, a searchsorted, a bincount and a diff per worker for the same arrays: most
 * of the plan in a running gateway, where it runs with the caches cold (a worker's product
 * has just evicted them), and the first chunk cannot go before it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* a gather of at least this many bytes writes with non-temporal stores */
#define NT_MIN ((size_t)1 << 20)

/* a C-contiguous 2-D float32 array, or (bf16 set) one of float32 or of uint16 bf16 bits:
 * *bf16 then says which */
static int get2d(PyObject *obj, Py_buffer *v, int writable, const char *what, int *bf16) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, v, flags) < 0)
        return -1;
    int f32 = v->itemsize == 4 && v->format != NULL && strcmp(v->format, "f") == 0;
    int b16 = bf16 != NULL && v->itemsize == 2 && v->format != NULL && strcmp(v->format, "H") == 0;
    if (v->ndim != 2 || !(f32 || b16)) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous 2-D float32 array%s", what,
                     bf16 != NULL ? " (or uint16: bf16 bits)" : "");
        PyBuffer_Release(v);
        return -1;
    }
    if (bf16 != NULL)
        *bf16 = b16;
    return 0;
}

/* bf16 bits -> float32, exactly */
static inline float widen(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bf16 bits, to nearest with ties to even; NaN stays a quiet NaN with its sign
 * and high payload bits (rounding could carry it to infinity) */
static inline uint16_t round_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return (x & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((x >> 16) | 0x0040u)
                                            : (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* whether v holds fmt's items: "f" (float32) or "q" (int64, which numpy's intp on LP64
 * spells "l") */
static int is_fmt(const Py_buffer *v, const char *fmt) {
    return v->format != NULL && v->itemsize == (Py_ssize_t)(fmt[0] == 'f' ? 4 : 8)
           && (strcmp(v->format, fmt) == 0 || (fmt[0] == 'q' && strcmp(v->format, "l") == 0));
}

static int get1d(PyObject *obj, Py_buffer *v, const char *fmt, Py_ssize_t size, const char *what) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (!is_fmt(v, fmt) || (size >= 0 && v->len / v->itemsize != size)) {
        PyErr_Format(PyExc_ValueError, "%s must be contiguous %s, as many as rows", what,
                     fmt[0] == 'f' ? "float32 values" : "int64 indices");
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(scatter_doc,
"scatter(out, y, rows, toks, wts, row0, first)\n--\n\n"
"out[toks[i]] = wts[i] * y[rows[i] - row0] (first true) or += it (first false), for every i.\n"
"first may also be a writable uint8 array, one flag per token of out: a token flagged 0 is\n"
"written and flagged 1, one flagged 1 is added to.\n"
"out (T, d): C-contiguous float32; y (n, d): C-contiguous float32, or uint16 holding bf16\n"
"bits (widened exactly as each row is read); rows and toks: int64; wts: float32, one\n"
"per row. ValueError, with nothing written, if any index is outside its array.\n\n"
"scatter(out, y, rows, toks, wts, row0, first, left, fin) also finishes tokens: left (uint8,\n"
"one per token of out, each below 128) counts the contributions each token still awaits, and\n"
"fin (uint16, out's element count) takes the bf16 bits of a token's sum, rounded to nearest\n"
"even as to_bf16 rounds it, when its last contribution is added: that token's row of out is\n"
"then left as it was. A token may then appear once per call, and only while it awaits one.");

static PyObject *scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "scatter() takes 7 or 9 arguments");
        return NULL;
    }
    long long row0 = PyLong_AsLongLong(args[5]);
    if (row0 == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer out, y, rows, toks, wts, seen = {0}, lb = {0}, fb = {0};
    int assign = 0;
    unsigned char *flags = NULL;
    if (!PyBool_Check(args[6]) && !PyLong_Check(args[6]) && PyObject_CheckBuffer(args[6])) {
        if (PyObject_GetBuffer(args[6], &seen, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            return NULL;
        flags = seen.buf;
    } else if ((assign = PyObject_IsTrue(args[6])) < 0) {
        return NULL;
    }
    int y16 = 0;
    if (get2d(args[0], &out, 1, "out", NULL) < 0)
        goto fail_seen;
    if (get2d(args[1], &y, 0, "y", &y16) < 0)
        goto fail_out;
    Py_ssize_t T = out.shape[0], d = out.shape[1], n = y.shape[0];
    if (flags != NULL && seen.len != T) {
        PyErr_Format(PyExc_ValueError, "first holds %zd flags for %zd tokens", seen.len, T);
        goto fail_y;
    }
    if (y.shape[1] != d) {
        PyErr_Format(PyExc_ValueError, "y has %zd columns, out %zd", y.shape[1], d);
        goto fail_y;
    }
    if (get1d(args[2], &rows, "q", -1, "rows") < 0)
        goto fail_y;
    Py_ssize_t count = rows.len / rows.itemsize;
    if (get1d(args[3], &toks, "q", count, "toks") < 0)
        goto fail_rows;
    if (get1d(args[4], &wts, "f", count, "wts") < 0)
        goto fail_toks;
    unsigned char *left = NULL;
    uint16_t *fin = NULL;
    if (nargs == 9) {
        if (PyObject_GetBuffer(args[7], &lb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            goto fail;
        if (PyObject_GetBuffer(args[8], &fb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
            goto fail_left;
        if (lb.len != T || fb.itemsize != 2 || fb.format == NULL || strcmp(fb.format, "H") != 0
                || fb.len / 2 != T * d) {
            PyErr_Format(PyExc_ValueError, "left must hold %zd counts and fin %zd uint16 bf16 bits", T, T * d);
            goto fail_fin;
        }
        left = lb.buf;
        fin = fb.buf;
    }
    const int64_t *r = rows.buf, *t = toks.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (t[i] < 0 || t[i] >= T || r[i] < row0 || r[i] - row0 >= n) {
            PyErr_Format(PyExc_ValueError, "entry %zd: token %lld of %zd, row %lld of [%lld, %lld)",
                         i, (long long)t[i], T, (long long)r[i], row0, row0 + (long long)n);
            goto fail_fin;
        }
    }
    /* a token awaiting nothing, or named twice: refused with the counts as they were. Each
     * count is taken now and marked (bit 7) until the loop below takes the mark off. */
    for (Py_ssize_t i = 0; left != NULL && i < count; i++) {
        if (left[t[i]] == 0 || left[t[i]] & 0x80) {
            PyErr_Format(PyExc_ValueError, "entry %zd: token %lld %s", i, (long long)t[i],
                         left[t[i]] & 0x80 ? "appears twice (or counts 128 or more)" : "awaits no contribution");
            while (i-- > 0)
                left[t[i]] = (unsigned char)((left[t[i]] & 0x7F) + 1);
            goto fail_fin;
        }
        left[t[i]] = (unsigned char)((left[t[i]] - 1) | 0x80);
    }
    float *o = out.buf;
    const float *src = y.buf, *w = wts.buf;
    const uint16_t *src16 = y.buf;
    /* A whole part's combine (no flags), after its last reply, writes first contributions
     * past the cache as the gather does. Not a chunked round's sums (flags): they run while
     * the worker computes, and streamed there they slow its compute (see
     * docs/design.md#the-gateways-loops-in-c). */
    int nt = 0;
#ifdef __SSE2__
    nt = flags == NULL && (size_t)count * (size_t)d * 4 >= NT_MIN && d % 4 == 0 && (uintptr_t)o % 16 == 0;
#endif
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        const float *s = src + (r[i] - row0) * d;
        float *dst = o + t[i] * d;
        const float wi = w[i];
        int write = assign;
        if (flags != NULL) {
            write = !flags[t[i]];
            flags[t[i]] = 1;
        }
        if (left != NULL && (left[t[i]] &= 0x7F) == 0) {  /* its last: rounded into fin, out untouched */
            uint16_t *f = fin + t[i] * d;
            const uint16_t *s16 = src16 + (r[i] - row0) * d;
            if (y16 && write)
                for (Py_ssize_t j = 0; j < d; j++)
                    f[j] = round_bf16(wi * widen(s16[j]));
            else if (y16)
                for (Py_ssize_t j = 0; j < d; j++)
                    f[j] = round_bf16(dst[j] + wi * widen(s16[j]));
            else if (write)
                for (Py_ssize_t j = 0; j < d; j++)
                    f[j] = round_bf16(wi * s[j]);
            else
                for (Py_ssize_t j = 0; j < d; j++)
                    f[j] = round_bf16(dst[j] + wi * s[j]);
            continue;
        }
        if (y16) {
            const uint16_t *s16 = src16 + (r[i] - row0) * d;
#ifdef __SSE2__
            if (write && nt) {  /* 4 bf16 -> the high halves of 4 float32 lanes */
                const __m128 wv = _mm_set1_ps(wi);
                for (Py_ssize_t j = 0; j < d; j += 4) {
                    __m128i b = _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(s16 + j)));
                    _mm_stream_ps(dst + j, _mm_mul_ps(wv, _mm_castsi128_ps(b)));
                }
                continue;
            }
#endif
            if (write)
                for (Py_ssize_t j = 0; j < d; j++)
                    dst[j] = wi * widen(s16[j]);
            else
                for (Py_ssize_t j = 0; j < d; j++)
                    dst[j] += wi * widen(s16[j]);
            continue;
        }
#ifdef __SSE2__
        if (write && nt) {
            const __m128 wv = _mm_set1_ps(wi);
            for (Py_ssize_t j = 0; j < d; j += 4)
                _mm_stream_ps(dst + j, _mm_mul_ps(wv, _mm_loadu_ps(s + j)));
            continue;
        }
#endif
        if (write)
            for (Py_ssize_t j = 0; j < d; j++)
                dst[j] = wi * s[j];
        else
            for (Py_ssize_t j = 0; j < d; j++)
                dst[j] += wi * s[j];
    }
#ifdef __SSE2__
    if (nt)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    if (left != NULL) {
        PyBuffer_Release(&fb);
        PyBuffer_Release(&lb);
    }
    PyBuffer_Release(&wts);
    PyBuffer_Release(&toks);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&y);
    PyBuffer_Release(&out);
    if (flags != NULL)
        PyBuffer_Release(&seen);
    Py_RETURN_NONE;
fail_fin:
    if (fb.obj != NULL)
        PyBuffer_Release(&fb);
fail_left:
    if (lb.obj != NULL)
        PyBuffer_Release(&lb);
fail:
    PyBuffer_Release(&wts);
fail_toks:
    PyBuffer_Release(&toks);
fail_rows:
    PyBuffer_Release(&rows);
fail_y:
    PyBuffer_Release(&y);
fail_out:
    PyBuffer_Release(&out);
fail_seen:
    if (flags != NULL)
        PyBuffer_Release(&seen);
    return NULL;
}

PyDoc_STRVAR(gather_doc,
"gather(out, x, idx)\n--\n\n"
"out[i] = x[idx[i]] for every i: rows of x (T, d) copied into out (len(idx), d), both\n"
"C-contiguous 2-D arrays of one item type; idx: int64. A gather of 1 MiB or more uses\n"
"non-temporal stores where the rows allow (16-byte multiples, out 16-byte aligned).\n"
"ValueError, with nothing written, if any index is outside x.");

static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "gather() takes 3 arguments");
        return NULL;
    }
    Py_buffer out, x, idx;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &x, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto fail_out;
    if (out.ndim != 2 || x.ndim != 2 || out.itemsize != x.itemsize || out.shape[1] != x.shape[1]
            || strcmp(out.format ? out.format : "B", x.format ? x.format : "B") != 0) {
        PyErr_SetString(PyExc_ValueError, "out and x must be C-contiguous 2-D arrays of one item type and width");
        goto fail_x;
    }
    Py_ssize_t n = out.shape[0], T = x.shape[0];
    if (get1d(args[2], &idx, "q", n, "idx") < 0)
        goto fail_x;
    const int64_t *ix = idx.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ix[i] < 0 || ix[i] >= T) {
            PyErr_Format(PyExc_ValueError, "entry %zd: row %lld of %zd", i, (long long)ix[i], T);
            PyBuffer_Release(&idx);
            goto fail_x;
        }
    }
    const size_t rb = (size_t)out.shape[1] * (size_t)out.itemsize;
    char *o = out.buf;
    const char *src = x.buf;
    int nt = 0;
#ifdef __SSE2__
    nt = (size_t)n * rb >= NT_MIN && rb % 16 == 0 && (uintptr_t)o % 16 == 0;
#endif
    Py_BEGIN_ALLOW_THREADS
    if (nt) {
#ifdef __SSE2__
        for (Py_ssize_t i = 0; i < n; i++) {
            const __m128i *s = (const __m128i *)(src + (size_t)ix[i] * rb);
            __m128i *dst = (__m128i *)(o + (size_t)i * rb);
            for (size_t j = 0; j < rb / 16; j++)
                _mm_stream_si128(dst + j, _mm_loadu_si128(s + j));
        }
        _mm_sfence();  /* the stores are visible before the slot is handed to the worker */
#endif
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(o + (size_t)i * rb, src + (size_t)ix[i] * rb, rb);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&idx);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
fail_x:
    PyBuffer_Release(&x);
fail_out:
    PyBuffer_Release(&out);
    return NULL;
}

PyDoc_STRVAR(sort_plan_doc,
"sort_plan(idx, assign, wts, k, n_workers, n_experts, tokens, slots, weights, counts) -> n\n--\n\n"
"Order the routed entries of idx (T*k flat, int64; -1: dropped) by (worker, expert, token):\n"
"entry i = token * k + slot goes to worker assign[i] (int64) with weight wts[i] (float32).\n"
"Writes the first n places of tokens, slots (int64) and weights (float32), each at least as\n"
"long as idx, and counts (n_workers * n_experts int64): the entries per (worker, expert)\n"
"cell, which place each entry's expert and worker. Returns n, the entries not dropped.\n"
"ValueError, with nothing written, for an expert or worker outside its range.");

static PyObject *sort_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "sort_plan() takes 10 arguments");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[3]), W = PyLong_AsSsize_t(args[4]), E = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (k < 1 || W < 1 || E < 0 || (E && W > PY_SSIZE_T_MAX / 8 / E)) {
        PyErr_SetString(PyExc_ValueError, "k and n_workers must be >= 1, n_experts >= 0");
        return NULL;
    }
    Py_buffer b[7];
    int got = 0;
    static const char *fmt[7] = {"q", "q", "f", "q", "q", "f", "q"};
    static const char *what[7] = {"idx", "assign", "wts", "tokens", "slots", "weights", "counts"};
    Py_ssize_t n = -1;
    for (; got < 7; got++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got >= 3 ? PyBUF_WRITABLE : 0);
        Py_buffer *v = &b[got];
        if (PyObject_GetBuffer(args[got < 3 ? got : got + 3], v, flags) < 0)
            goto done;
        int ok = is_fmt(v, fmt[got]);
        Py_ssize_t len = ok ? v->len / v->itemsize : 0;
        if (ok && got == 6)
            ok = len == W * E;
        else if (ok && got > 0)
            ok = got < 3 ? len == b[0].len / 8 : len >= b[0].len / 8;
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "%s must be contiguous %s, %s", what[got],
                         fmt[got][0] == 'f' ? "float32" : "int64",
                         got == 6 ? "n_workers * n_experts of them" : "as many as idx");
            PyBuffer_Release(v);
            goto done;
        }
    }
    const Py_ssize_t N = b[0].len / 8;
    if (N % k) {
        PyErr_Format(PyExc_ValueError, "idx holds %zd entries, not a multiple of k=%zd", N, k);
        goto done;
    }
    const int64_t *ix = b[0].buf, *as = b[1].buf;
    const float *wt = b[2].buf;
    int64_t *cnt = b[6].buf;
    for (Py_ssize_t i = 0; i < N; i++) {  /* everything checked before anything is written */
        if (ix[i] < -1 || ix[i] >= E || (ix[i] >= 0 && (as[i] < 0 || as[i] >= W))) {
            PyErr_Format(PyExc_ValueError, "entry %zd: expert %lld on worker %lld, out of range (%zd experts, "
                         "%zd workers)", i, (long long)ix[i], (long long)as[i], E, W);
            goto done;
        }
    }
    int64_t *at = PyMem_Malloc((size_t)(W * E + 1) * sizeof(int64_t));
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *tok = b[3].buf, *slot = b[4].buf;
    float *wo = b[5].buf;
    Py_BEGIN_ALLOW_THREADS
    memset(cnt, 0, (size_t)(W * E) * sizeof(int64_t));
    for (Py_ssize_t i = 0; i < N; i++)
        if (ix[i] >= 0)
            cnt[as[i] * E + ix[i]]++;
    int64_t sum = 0;
    for (Py_ssize_t c = 0; c < W * E; c++) {
        at[c] = sum;
        sum += cnt[c];
    }
    for (Py_ssize_t t = 0, i = 0; i < N; t++) {  /* in entry order: each cell keeps its tokens ascending */
        for (Py_ssize_t s = 0; s < k; s++, i++) {
            if (ix[i] < 0)
                continue;
            int64_t p = at[as[i] * E + ix[i]]++;
            tok[p] = t;
            slot[p] = s;
            wo[p] = wt[i];
        }
    }
    n = (Py_ssize_t)sum;
    Py_END_ALLOW_THREADS
    PyMem_Free(at);
done:
    while (got-- > 0)
        PyBuffer_Release(&b[got]);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(to_bf16_doc,
"to_bf16(out, a)\n--\n\n"
"out = a rounded to bf16, to nearest with ties to even, as bits: a float32, out uint16, both\n"
"C-contiguous and of one element count. NaN stays a quiet NaN with its sign and high\n"
"payload bits (workers/bf16.py's from_float32 gives the same bits).");

static PyObject *to_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "to_bf16() takes 2 arguments");
        return NULL;
    }
    Py_buffer out, a;
    if (PyObject_GetBuffer(args[0], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &a, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (out.itemsize != 2 || out.format == NULL || strcmp(out.format, "H") != 0 || !is_fmt(&a, "f")
            || out.len / 2 != a.len / 4) {
        PyErr_SetString(PyExc_ValueError, "to_bf16 needs a uint16 out and a float32 a of one element count");
        PyBuffer_Release(&a);
        PyBuffer_Release(&out);
        return NULL;
    }
    const float *u = a.buf;
    uint16_t *o = out.buf;
    const Py_ssize_t n = a.len / 4;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        o[i] = round_bf16(u[i]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"to_bf16", (PyCFunction)(void (*)(void))to_bf16, METH_FASTCALL, to_bf16_doc},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL, scatter_doc},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, gather_doc},
    {"sort_plan", (PyCFunction)(void (*)(void))sort_plan, METH_FASTCALL, sort_plan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gateway._combine",
                                    "The gateway's gather and weighted combine in C (see gateway/dispatch.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__combine(void) { return PyModule_Create(&module); }
