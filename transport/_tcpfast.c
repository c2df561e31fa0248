/* tcp://'s compiled fast path: the common message -- one slot of ours, a header that fits a
 * small buffer -- allocated, sent, received and released in one call each.
 *
 * transport/stream.py stays the whole protocol: this module does, for the one message shape
 * it recognises, what stream.py's Python path does, byte for byte, on the same state (the
 * StreamConnection attributes in its __slots__, which both paths read and write). Anything
 * else it hands over untouched: a send it does not take (several buffers, no credits, bytes
 * still pending, an error or a full socket) goes to ``_send_py`` with nothing written; a frame
 * the kernel took only part of goes to ``_sent_part`` to finish; a receive with bytes of ours
 * pending, a partial frame in the read buffer or an odd timeout goes to ``_recv_py``. Of what
 * a read brought it parses complete one-buffer DATA frames and CREDIT frames, and starts a
 * one-buffer DATA frame whose payload has not all arrived (its slot taken, what came copied,
 * the rest read straight into the slot: at once for a caller that waits, by later calls
 * otherwise, as _want/_cur); the rest of the read buffer -- a partial header, anything else,
 * anything malformed -- goes to ``_parse_rest``. So it never raises a protocol error itself,
 * never reads past what the kernel wrote into the read buffer, and never allocates from a
 * size the peer announced (a payload goes into a slot of the receive pool once it is checked
 * against the slot size).
 */
#include "_fastpath.h"
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

#define PREFIX_SIZE 16
#define MAX_FAST_FRAME 1024        /* prefix + header built on the stack; larger: the Python path */
#define UNLOCK_MIN (64 * 1024)     /* sends of at least this many bytes release the GIL */
#define MAX_CREDITS (1ULL << 40)   /* a credit count past this (no peer has so many slots) goes to Python */

static FastPath fp;
static PyTypeObject *conn_type;
static PyObject *packer, *unpackb, *kw_strict, *transport_error, *timeout_error;
static long broken_state;
static uint32_t tag_data, tag_credit;
static long long pad_min;  /* framing.PAD_MIN */
/* StreamConnection's __slots__ members */
static PyMemberDef *m_state, *m_credits, *m_owed, *m_rpos, *m_rend, *m_want, *m_out, *m_inbox, *m_rcvtimeo,
    *m_rsize, *m_link;
static PyObject *s_alloc_py, *s_send_py, *s_recv_py, *s_sent_part, *s_parse_rest, *s_to_peer_gone,
    *s_send_control, *s_release_message, *s_release_failed, *s_popleft, *s_default_timeout, *s_cur, *s_timeout;

typedef struct {
    PyObject_HEAD
    int open;
    int fd;
    Py_buffer rbuf;                                   /* the connection's read buffer */
    PyObject *rpool, *rfree, *rin_use, *rslots, *rmem; /* the receive pool, its lists and memory */
    Py_buffer rmembuf;
    Py_ssize_t rstride;
    PyObject *spool, *sfree, *sin_use, *sslots;        /* the send pool */
    Py_buffer smembuf;
    Py_ssize_t sstride;
    long long max_message, max_payload, max_header, owe_flush, idle_read, read_ahead, big;
    /* messages through this path, folded into ConnectionStats by CompiledPath.stats */
    unsigned long long msgs_in, bytes_in, msgs_out, bytes_out;
} Link;

static PyTypeObject LinkType;

static inline void
put_le(unsigned char *p, uint64_t v, int n)
{
    for (int k = 0; k < n; k++)
        p[k] = (unsigned char)(v >> (8 * k));
}

static inline uint64_t
get_le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

/* -- the connection's state ---------------------------------------------------------- */

/* ``conn.<m>`` as a long long: 0, 1 if it is not an exact int in range (the caller
 * declines), -1 with an error set */
static int
get_ll(PyObject *conn, PyMemberDef *m, long long *out)
{
    PyObject *v = PyMember_GetOne((char *)conn, m);
    if (v == NULL)
        return -1;
    int r = 1;
    if (PyLong_CheckExact(v)) {
        int overflow;
        *out = PyLong_AsLongLongAndOverflow(v, &overflow);
        r = (*out == -1 && PyErr_Occurred()) ? -1 : overflow ? 1 : 0;
    }
    Py_DECREF(v);
    return r;
}

static int
set_ll(PyObject *conn, PyMemberDef *m, long long v)
{
    PyObject *o = PyLong_FromLongLong(v);
    int r = o ? PyMember_SetOne((char *)conn, m, o) : -1;
    Py_XDECREF(o);
    return r;
}

/* whether ``conn.<m>`` is None: 1, 0, -1 error */
static int
is_none(PyObject *conn, PyMemberDef *m)
{
    PyObject *v = PyMember_GetOne((char *)conn, m);
    if (v == NULL)
        return -1;
    Py_DECREF(v);
    return v == Py_None;
}

/* conn's Link if it is open (borrowed: the connection keeps it), else NULL */
static Link *
link_of(PyObject *conn)
{
    PyObject *l = PyMember_GetOne((char *)conn, m_link);
    if (l == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(l);
    return Py_IS_TYPE(l, &LinkType) && ((Link *)l)->open ? (Link *)l : NULL;
}

/* 1 if the connection is OPEN, 0 if not (or its state is not an int), -1 error */
static int
conn_open(PyObject *conn)
{
    long long st_;
    int r = get_ll(conn, m_state, &st_);
    return r < 0 ? -1 : (r == 0 && st_ == 0);
}

static double
monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* the clock time.monotonic() reads */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* BufferPool.put of one of the pool's own slots, by index: idempotent, as in Python */
static int
pool_put(PyObject *free, PyObject *in_use, Py_ssize_t i)
{
    if (i < 0 || i >= PyList_GET_SIZE(in_use) || PyList_GET_ITEM(in_use, i) != Py_True)
        return 0;
    PyObject *id = PyLong_FromSsize_t(i);
    PyObject *r = id ? PyObject_CallMethodOneArg(free, fp.s_append, id) : NULL;
    Py_XDECREF(id);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    PyList_SetItem(in_use, i, Py_NewRef(Py_False));
    return 0;
}

/* a slot's index and nbytes, both exact ints in range: 0, 1 if not, -1 error */
static int
slot_fields(PyObject *slot, Py_ssize_t nslots, long long limit, Py_ssize_t *index, long long *nbytes)
{
    PyObject *i = PyMember_GetOne((char *)slot, fp.index), *n = i ? PyMember_GetOne((char *)slot, fp.nbytes) : NULL;
    int r = -1;
    if (n != NULL) {
        r = 1;
        if (PyLong_CheckExact(i) && PyLong_CheckExact(n)) {
            *index = PyLong_AsSsize_t(i);
            *nbytes = PyLong_AsLongLong(n);
            if (PyErr_Occurred())
                PyErr_Clear();
            else if (*index >= 0 && *index < nslots && *nbytes >= 0 && *nbytes <= limit)
                r = 0;
        }
    }
    Py_XDECREF(i);
    Py_XDECREF(n);
    return r;
}

/* -- msgpack: the fixed parts of a DATA header ------------------------------------------ */

/* msgpack's smallest encoding of the unsigned ``v`` (as msgpack-python packs it) */
static size_t
put_uint(unsigned char *p, unsigned long long v)
{
    if (v < 0x80) {
        p[0] = (unsigned char)v;
        return 1;
    }
    int w = v < 0x100 ? 1 : v < 0x10000 ? 2 : v <= 0xffffffffULL ? 4 : 8;
    p[0] = w == 1 ? 0xcc : w == 2 ? 0xcd : w == 4 ? 0xce : 0xcf;
    for (int k = 0; k < w; k++)
        p[1 + k] = (unsigned char)(v >> (8 * (w - 1 - k)));
    return 1 + (size_t)w;
}

/* an unsigned int at ``p`` (any width msgpack allows), within ``end``: its length, or 0 */
static size_t
get_uint(const unsigned char *p, const unsigned char *end, unsigned long long *v)
{
    if (p >= end)
        return 0;
    if (p[0] < 0x80) {
        *v = p[0];
        return 1;
    }
    int w = p[0] == 0xcc ? 1 : p[0] == 0xcd ? 2 : p[0] == 0xce ? 4 : p[0] == 0xcf ? 8 : 0;
    if (w == 0 || end - p < 1 + w)
        return 0;
    unsigned long long x = 0;
    for (int k = 0; k < w; k++)
        x = x << 8 | p[1 + k];
    *v = x;
    return 1 + (size_t)w;
}

/* The header [{}, [plen], extra] with extra nil or an unsigned int, exactly filling
 * ``h[0:hlen]``: 1 with the credits it carries, 0 if it is anything else */
static int
empty_header(const unsigned char *h, size_t hlen, unsigned long long plen, unsigned long long *credits)
{
    const unsigned char *end = h + hlen;
    unsigned long long n;
    if (hlen < 5 || h[0] != 0x93 || h[1] != 0x80 || h[2] != 0x91)
        return 0;
    size_t k = get_uint(h + 3, end, &n);
    if (k == 0 || n != plen)
        return 0;
    const unsigned char *p = h + 3 + k;
    if (p + 1 == end && *p == 0xc0) {
        *credits = 0;
        return 1;
    }
    k = get_uint(p, end, &n);
    if (k == 0 || p + k != end || n > MAX_CREDITS)
        return 0;
    *credits = n;
    return 1;
}

/* -- Link ---------------------------------------------------------------------------- */

static int
pool_lists(PyObject *pool, PyObject **free, PyObject **in_use, PyObject **slots, PyObject **mem,
           Py_ssize_t *stride)
{
    *free = PyObject_GetAttrString(pool, "_free");
    *in_use = *free ? PyObject_GetAttrString(pool, "_in_use") : NULL;
    *slots = *in_use ? PyObject_GetAttrString(pool, "_slots") : NULL;
    *mem = *slots ? PyObject_GetAttrString(pool, "memory") : NULL;
    PyObject *s = *mem ? PyObject_GetAttrString(pool, "stride") : NULL;
    *stride = s ? PyLong_AsSsize_t(s) : -1;
    Py_XDECREF(s);
    if (*stride < 0 || !PyList_CheckExact(*in_use) || !PyList_CheckExact(*slots)
        || PyList_GET_SIZE(*in_use) != PyList_GET_SIZE(*slots)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "not a transport.pool.BufferPool");
        Py_CLEAR(*free);
        Py_CLEAR(*in_use);
        Py_CLEAR(*slots);
        Py_CLEAR(*mem);
        return -1;
    }
    return 0;
}

static void
release_all(Link *self)
{
    if (self->open) {
        self->open = 0;
        PyBuffer_Release(&self->rbuf);
        PyBuffer_Release(&self->rmembuf);
        PyBuffer_Release(&self->smembuf);
    }
    Py_CLEAR(self->rpool);
    Py_CLEAR(self->rfree);
    Py_CLEAR(self->rin_use);
    Py_CLEAR(self->rslots);
    Py_CLEAR(self->rmem);
    Py_CLEAR(self->spool);
    Py_CLEAR(self->sfree);
    Py_CLEAR(self->sin_use);
    Py_CLEAR(self->sslots);
}

static int
Link_init(Link *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"fd", "rbuf", "recv_pool", "send_pool", "max_message", "max_payload", "max_header",
                         "owe_flush", "idle_read", "read_ahead", "big", NULL};
    int fd;
    PyObject *rbuf, *rpool, *spool, *smem = NULL;
    long long max_message, max_payload, max_header, owe_flush, idle_read, read_ahead, big;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Link is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOLLLLLLL", kw, &fd, &rbuf, &rpool, &spool, &max_message,
                                     &max_payload, &max_header, &owe_flush, &idle_read, &read_ahead, &big))
        return -1;
    if (fp.msg_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() the message class first");
        return -1;
    }
    if (fd < 0 || max_message < 0 || max_payload < 0 || max_header <= 0 || owe_flush <= 0 || read_ahead <= 0
        || idle_read < read_ahead) {
        PyErr_SetString(PyExc_ValueError, "bad fd, limits or read sizes");
        return -1;
    }
    if (pool_lists(rpool, &self->rfree, &self->rin_use, &self->rslots, &self->rmem, &self->rstride) < 0)
        return -1;
    if (pool_lists(spool, &self->sfree, &self->sin_use, &self->sslots, &smem, &self->sstride) < 0) {
        release_all(self);
        return -1;
    }
    if (PyObject_GetBuffer(rbuf, &self->rbuf, PyBUF_WRITABLE) < 0) {
        Py_DECREF(smem);
        release_all(self);
        return -1;
    }
    if (PyObject_GetBuffer(self->rmem, &self->rmembuf, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&self->rbuf);
        Py_DECREF(smem);
        release_all(self);
        return -1;
    }
    int r = PyObject_GetBuffer(smem, &self->smembuf, PyBUF_SIMPLE);
    Py_DECREF(smem);
    if (r < 0) {
        PyBuffer_Release(&self->rbuf);
        PyBuffer_Release(&self->rmembuf);
        release_all(self);
        return -1;
    }
    Py_ssize_t rn = PyList_GET_SIZE(self->rslots), sn = PyList_GET_SIZE(self->sslots);
    if (self->rbuf.len < idle_read || self->rstride < max_payload || self->rmembuf.len < rn * self->rstride
        || self->sstride < max_message || self->smembuf.len < sn * self->sstride) {
        PyBuffer_Release(&self->rbuf);
        PyBuffer_Release(&self->rmembuf);
        PyBuffer_Release(&self->smembuf);
        release_all(self);
        PyErr_SetString(PyExc_ValueError, "the read buffer or a pool is smaller than its limits");
        return -1;
    }
    self->rpool = Py_NewRef(rpool);
    self->spool = Py_NewRef(spool);
    self->fd = fd;
    self->max_message = max_message;
    self->max_payload = max_payload;
    self->max_header = max_header;
    self->owe_flush = owe_flush;
    self->idle_read = idle_read;
    self->read_ahead = read_ahead;
    self->big = big;
    self->open = 1;
    return 0;
}

static void
Link_dealloc(Link *self)
{
    release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(close_doc, "close()\n--\n\nRelease the buffers; every later call takes the Python path.");

static PyObject *
Link_close(Link *self, PyObject *unused)
{
    release_all(self);
    Py_RETURN_NONE;
}

/* -- send ------------------------------------------------------------------------------ */

/* StreamSender._send_py for one slot of our send pool: 1 sent (or handed to _sent_part), 0
 * declined with nothing written and nothing changed, -1 error */
static int
fast_send(Link *link, PyObject *conn, PyObject *header, PyObject *buffers, PyObject *timeout)
{
    PyObject *b;
    if (PyList_CheckExact(buffers) && PyList_GET_SIZE(buffers) == 1)
        b = PyList_GET_ITEM(buffers, 0);
    else if (PyTuple_CheckExact(buffers) && PyTuple_GET_SIZE(buffers) == 1)
        b = PyTuple_GET_ITEM(buffers, 0);
    else
        return 0;
    if (Py_TYPE(b) != fp.slot_type)
        return 0;
    PyObject *bpool = PyMember_GetOne((char *)b, fp.pool);
    if (bpool == NULL)
        return -1;
    Py_DECREF(bpool);
    if (bpool != link->spool)
        return 0;
    int r = conn_open(conn);
    if (r <= 0)
        return r;
    r = is_none(conn, m_out);  /* bytes pending go first: the Python path */
    if (r <= 0)
        return r;
    long long credits, owed, nbytes = 0;
    Py_ssize_t index = 0;
    if ((r = get_ll(conn, m_credits, &credits)) != 0 || (r = get_ll(conn, m_owed, &owed)) != 0)
        return r < 0 ? -1 : 0;
    if (credits <= 0 || owed < 0)
        return 0;
    if ((r = slot_fields(b, PyList_GET_SIZE(link->sin_use), link->max_message, &index, &nbytes)) != 0)
        return r < 0 ? -1 : 0;
    PyObject *raw = NULL;
    const char *user = "\x80";  /* {} */
    Py_ssize_t ulen = 1;
    if (!(PyDict_CheckExact(header) && PyDict_GET_SIZE(header) == 0)) {
        raw = PyObject_CallOneArg(packer, header);
        if (raw == NULL || !PyBytes_CheckExact(raw)) {  /* not serialisable: the Python path says */
            if (raw == NULL && !PyErr_ExceptionMatches(PyExc_Exception))
                return -1;  /* KeyboardInterrupt, MemoryError...: not ours to hide */
            PyErr_Clear();
            Py_XDECREF(raw);
            return 0;
        }
        user = PyBytes_AS_STRING(raw);
        ulen = PyBytes_GET_SIZE(raw);
    }
    unsigned char frame[MAX_FAST_FRAME];
    Py_ssize_t hlen = 1 + ulen + 1 + 9 + 2 + 127;  /* at most */
    if (hlen > link->max_header || 2 * PREFIX_SIZE + hlen > MAX_FAST_FRAME) {
        Py_XDECREF(raw);
        return 0;
    }
    const char *src = (char *)link->smembuf.buf + index * link->sstride;
    int padded = nbytes >= pad_min;
    size_t lead = padded && owed ? 2 * PREFIX_SIZE : PREFIX_SIZE;  /* a CREDIT frame first */
    unsigned char *h = frame + lead, *p = h;
    *p++ = 0x93;
    memcpy(p, user, (size_t)ulen);
    p += ulen;
    Py_XDECREF(raw);
    *p++ = 0x91;
    p += put_uint(p, (unsigned long long)nbytes);
    if (padded) {  /* framing.padded_frame_head */
        size_t base = lead + (size_t)(p - h) + 1, r = (uintptr_t)src % 4096;
        size_t off = base + (r - base % 64 + 64) % 64;
        if ((off - r) % 4096 == 0)
            off += 64;
        size_t d = off - base;
        if (d == 0) {
            *p++ = 0xc0;
        } else {
            *p++ = 0xc4;
            *p++ = (unsigned char)(d - 1);
            memset(p, 0, d - 1);
            p += d - 1;
        }
        if (owed) {
            put_le(frame, tag_credit, 4);
            put_le(frame + 4, 0, 4);
            put_le(frame + 8, (uint64_t)owed, 8);
        }
    } else if (owed) {
        p += put_uint(p, (unsigned long long)owed);
    } else {
        *p++ = 0xc0;
    }
    uint32_t hl = (uint32_t)(p - h);
    uint64_t total = (uint64_t)nbytes;
    unsigned char *pre = frame + lead - PREFIX_SIZE;
    put_le(pre, tag_data, 4);  /* little-endian, as framing.PREFIX packs */
    put_le(pre + 4, hl, 4);
    put_le(pre + 8, total, 8);
    struct iovec iov[2] = {{frame, lead + hl}, {(char *)src, (size_t)nbytes}};
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = nbytes ? 2 : 1;
    size_t size = lead + hl + (size_t)nbytes;
    ssize_t n;
    if (nbytes >= UNLOCK_MIN) {
        Py_BEGIN_ALLOW_THREADS
        n = sendmsg(link->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
    } else {
        n = sendmsg(link->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (n < 0) {  /* nothing written: the Python path writes it, waits or reports the error */
        if (errno == EINTR && PyErr_CheckSignals() < 0)
            return -1;
        return 0;
    }
    if (set_ll(conn, m_owed, 0) < 0)
        return -1;
    if ((size_t)n == size) {
        if (set_ll(conn, m_credits, credits - 1) < 0 || pool_put(link->sfree, link->sin_use, index) < 0)
            return -1;
        link->msgs_out += 1;
        link->bytes_out += (unsigned long long)nbytes;
        return 1;
    }
    PyObject *prefix = PyBytes_FromStringAndSize((const char *)frame, (Py_ssize_t)lead);
    PyObject *head = prefix ? PyBytes_FromStringAndSize((const char *)h, hl) : NULL;
    PyObject *sent = head ? PyLong_FromSsize_t(n) : NULL;
    PyObject *ow = sent ? PyLong_FromLongLong(owed) : NULL;
    PyObject *res = NULL;
    if (ow != NULL) {
        PyObject *a[7] = {conn, prefix, head, b, sent, ow, timeout};
        res = PyObject_VectorcallMethod(s_sent_part, a, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    Py_XDECREF(prefix);
    Py_XDECREF(head);
    Py_XDECREF(sent);
    Py_XDECREF(ow);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 1;
}

/* -- receive --------------------------------------------------------------------------- */

/* One DATA frame's header ``h[0:hlen]`` for a payload of ``plen``: 1 with the user header
 * (new reference) and credits, 0 for anything but [user, [plen], None or an int >= 0]
 * (the Python path decodes it and says what is wrong), -1 error */
static int
parse_header(const unsigned char *h, size_t hlen, unsigned long long plen, PyObject **user,
             unsigned long long *credits)
{
    if (empty_header(h, hlen, plen, credits)) {
        *user = PyDict_New();
        return *user ? 1 : -1;
    }
    PyObject *view = PyMemoryView_FromMemory((char *)h, (Py_ssize_t)hlen, PyBUF_READ);
    if (view == NULL)
        return -1;
    PyObject *a[2] = {view, Py_False};
    PyObject *obj = PyObject_Vectorcall(unpackb, a, 1, kw_strict);
    Py_DECREF(view);
    if (obj == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int ok = 0;
    if (PyList_CheckExact(obj) && PyList_GET_SIZE(obj) == 3) {
        PyObject *lens = PyList_GET_ITEM(obj, 1), *extra = PyList_GET_ITEM(obj, 2);
        if (PyList_CheckExact(lens) && PyList_GET_SIZE(lens) == 1 && PyLong_CheckExact(PyList_GET_ITEM(lens, 0))) {
            unsigned long long n = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(lens, 0));
            ok = !PyErr_Occurred() && n == plen;
            PyErr_Clear();
        }
        *credits = 0;
        if (ok && PyLong_CheckExact(extra)) {  /* credits piggybacked; anything else is ignored */
            int overflow;
            long long c = PyLong_AsLongLongAndOverflow(extra, &overflow);
            if (overflow || (c == -1 && PyErr_Occurred()) || c > (long long)MAX_CREDITS)
                ok = 0;  /* an absurd count: the Python path adds it */
            else if (c > 0)
                *credits = (unsigned long long)c;
            PyErr_Clear();
        }
    }
    if (ok)
        *user = Py_NewRef(PyList_GET_ITEM(obj, 0));
    Py_DECREF(obj);
    return ok;
}

/* A free slot of the receive pool sized to ``plen`` (as BufferPool.try_alloc) and its
 * offset in the pool's memory: 1; 0 when none is free (a peer past its credits: the Python
 * path says so); -1 error */
static int
take_slot(Link *link, unsigned long long plen, PyObject **slot, unsigned long long *base)
{
    PyObject *n = PyLong_FromUnsignedLongLong(plen);
    if (n == NULL)
        return -1;
    *slot = fp_pool_pop(&fp, link->rfree, link->rin_use, link->rslots, n);
    Py_DECREF(n);
    if (*slot == NULL || *slot == Py_None) {
        int r = *slot == NULL ? -1 : 0;
        Py_CLEAR(*slot);
        return r;
    }
    PyObject *idx = PyMember_GetOne((char *)*slot, fp.index);
    Py_ssize_t i = idx ? PyLong_AsSsize_t(idx) : -1;
    Py_XDECREF(idx);
    if (i < 0 || i >= PyList_GET_SIZE(link->rslots)) {
        Py_CLEAR(*slot);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "a receive slot outside its pool");
        return -1;
    }
    *base = (unsigned long long)i * (unsigned long long)link->rstride;
    return 1;
}

/* the message of ``slot``'s first ``plen`` bytes (steals nothing) */
static PyObject *
slot_message(Link *link, PyObject *conn, PyObject *user, PyObject *slot, unsigned long long base,
             unsigned long long plen)
{
    PyObject *view = fp_slice(link->rmem, base, base + plen);
    PyObject *msg = view ? fp_message(&fp, user, view, conn, slot) : NULL;
    Py_XDECREF(view);
    if (msg != NULL) {
        link->msgs_in += 1;
        link->bytes_in += plen;
    }
    return msg;
}

/* A message for the DATA frame whose payload is ``rbuf[pstart:pstart + plen]`` (all here):
 * the payload copied into a slot of the receive pool. NULL with an error; Py_None
 * (borrowed) when no slot is free. */
static PyObject *
deliver(Link *link, PyObject *conn, PyObject *user, size_t pstart, unsigned long long plen)
{
    PyObject *slot;
    unsigned long long base;
    int r = take_slot(link, plen, &slot, &base);
    if (r <= 0)
        return r < 0 ? NULL : Py_None;
    memcpy((char *)link->rmembuf.buf + base, (char *)link->rbuf.buf + pstart, (size_t)plen);
    PyObject *msg = slot_message(link, conn, user, slot, base, plen);
    Py_DECREF(slot);
    return msg;
}

/* The DATA frame at ``rbuf[pstart:n]`` whose payload of ``plen`` has not all arrived: what
 * did arrive copied into a slot, and for a caller that waits (``wait``) the rest read
 * straight into it with one MSG_WAITALL read (SO_RCVTIMEO is the caller's timeout). NULL
 * with an error; Py_None (borrowed) when no slot is free, or when the payload is not all
 * here (no wait; or the read stopped short: the timeout, a signal, the peer gone) -- then
 * it is left in progress as the Python path keeps one (_want, _cur) and the connection's
 * state says what happened; else the message. */
static PyObject *
read_rest(Link *link, PyObject *conn, PyObject *user, size_t pstart, size_t n, unsigned long long plen, int wait)
{
    PyObject *slot;
    unsigned long long base;
    int r = take_slot(link, plen, &slot, &base);
    if (r <= 0)
        return r < 0 ? NULL : Py_None;
    char *dst = (char *)link->rmembuf.buf + base;
    size_t have = n - pstart, want = (size_t)plen - have;
    memcpy(dst, (char *)link->rbuf.buf + pstart, have);
    /* while messages are this large, idle reads take little more than a prefix and header */
    if (plen > (unsigned long long)link->big && set_ll(conn, m_rsize, link->read_ahead) < 0) {
        Py_DECREF(slot);  /* (taken, not given back: the connection is failing anyway) */
        return NULL;
    }
    ssize_t got = 0;
    int err = 0;
    if (wait) {
        Py_BEGIN_ALLOW_THREADS
        got = recv(link->fd, dst + have, want, MSG_WAITALL);
        Py_END_ALLOW_THREADS
        err = errno;
    }
    if (got == (ssize_t)want) {
        PyObject *msg = slot_message(link, conn, user, slot, base, plen);
        Py_DECREF(slot);
        return msg;
    }
    size_t done = have + (got > 0 ? (size_t)got : 0);
    PyObject *view = fp_slice(link->rmem, base, base + plen);
    PyObject *rest = view ? fp_slice(link->rmem, base + done, base + plen) : NULL;
    PyObject *bufs = rest ? PyList_New(1) : NULL;
    if (bufs != NULL)
        PyList_SET_ITEM(bufs, 0, Py_NewRef(view));
    PyObject *cur = bufs ? PyTuple_Pack(3, user, bufs, slot) : NULL;
    int e = cur == NULL || PyMember_SetOne((char *)conn, m_want, rest) < 0 || PyObject_SetAttr(conn, s_cur, cur) < 0;
    Py_XDECREF(view);
    Py_XDECREF(rest);
    Py_XDECREF(bufs);
    Py_XDECREF(cur);
    Py_DECREF(slot);
    if (e || PyErr_CheckSignals() < 0)
        return NULL;
    if (got < 0 && err != EAGAIN && err != EWOULDBLOCK && err != EINTR) {
        /* reset: said now (the Python path's next read would only see the end of the stream) */
        PyObject *why = PyUnicode_FromFormat("connection reset (%s)", strerror(err));
        PyObject *ret = why ? PyObject_CallMethodOneArg(conn, s_to_peer_gone, why) : NULL;
        Py_XDECREF(why);
        if (ret == NULL)
            return NULL;
        Py_DECREF(ret);
    }
    return Py_None;
}

/* Parse ``rbuf[0:n]`` (a read into an empty buffer): the messages of its complete one-buffer
 * DATA frames in order (the first in ``*first``, the others appended to the inbox), its
 * CREDIT frames, and a one-buffer DATA frame that began arriving (read_rest: read whole for
 * a caller that waits, ``wait``); what follows -- anything else -- handed to _parse_rest.
 * 0, or -1 with an error set. */
static int
parse_read(Link *link, PyObject *conn, PyObject *inbox, size_t n, int wait, long long rsize, PyObject **first)
{
    const unsigned char *buf = (const unsigned char *)link->rbuf.buf;
    size_t pos = 0;
    unsigned long long credits = 0;
    while (n - pos >= PREFIX_SIZE) {
        uint32_t tag = (uint32_t)get_le(buf + pos, 4), hlen = (uint32_t)get_le(buf + pos + 4, 4);
        uint64_t plen = get_le(buf + pos + 8, 8);
        if (tag == tag_credit && hlen == 0 && plen <= MAX_CREDITS) {
            credits += plen;
            pos += PREFIX_SIZE;
            continue;
        }
        if (tag != tag_data || hlen == 0 || (long long)hlen > link->max_header || plen == 0
            || plen > (uint64_t)link->max_payload)
            break;
        size_t pstart = pos + PREFIX_SIZE + hlen;
        if (pstart > n)
            break;  /* the header is not all here: the Python path keeps the frame's start */
        int whole = plen <= n - pstart;
        PyObject *user;
        unsigned long long c;
        int r = parse_header(buf + pos + PREFIX_SIZE, hlen, plen, &user, &c);
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        PyObject *msg = whole ? deliver(link, conn, user, pstart, plen)
                              : read_rest(link, conn, user, pstart, n, plen, wait);
        Py_DECREF(user);
        if (msg == NULL)
            return -1;
        if (msg == Py_None) {  /* no slot free; or a payload in progress (_want), all that was read */
            if (!whole && (r = is_none(conn, m_want)) <= 0) {
                if (r < 0)
                    return -1;
                credits += c;
                pos = n;
            }
            break;
        }
        credits += c;
        if (whole && plen < (unsigned long long)link->read_ahead && rsize != link->idle_read) {
            rsize = link->idle_read;  /* small messages (again): read many at once */
            if (set_ll(conn, m_rsize, rsize) < 0)
                return -1;
        }
        if (*first == NULL) {
            *first = msg;
        } else {
            PyObject *res = PyObject_CallMethodOneArg(inbox, fp.s_append, msg);
            Py_DECREF(msg);
            if (res == NULL)
                return -1;
            Py_DECREF(res);
        }
        if (!whole) {
            pos = n;
            break;
        }
        pos = pstart + plen;
    }
    if (credits) {
        long long have;
        if (get_ll(conn, m_credits, &have) != 0 || set_ll(conn, m_credits, have + (long long)credits) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "StreamConnection._credits is not an int");
            return -1;
        }
    }
    if (pos < n) {
        if (set_ll(conn, m_rpos, (long long)pos) < 0 || set_ll(conn, m_rend, (long long)n) < 0)
            return -1;
        PyObject *res = PyObject_CallMethodNoArgs(conn, s_parse_rest);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

/* Whether a receive can take the common case: nothing queued or pending, the read buffer
 * empty, a finite timeout; a payload in progress (``*want``, a new reference) or none.
 * 1 with the wait ``*t``, the credits owed, the read size and SO_RCVTIMEO as they are; 0 to
 * decline; -1 error. */
static int
recv_ready(Link *link, PyObject *conn, PyObject *timeout, double *t, long long *owed, long long *rsize,
           double *rcvtimeo, PyObject **want)
{
    long long rend;
    int r = conn_open(conn);
    if (r > 0)
        r = is_none(conn, m_out);
    if (r <= 0)
        return r;
    int g;
    if ((g = get_ll(conn, m_rend, &rend)) != 0 || (g = get_ll(conn, m_owed, owed)) != 0
        || (g = get_ll(conn, m_rsize, rsize)) != 0)
        return g < 0 ? -1 : 0;
    if (rend != 0 || *owed < 0)
        return 0;
    PyObject *tv = timeout == Py_None ? PyObject_GetAttr(conn, s_default_timeout) : Py_NewRef(timeout);
    if (tv == NULL)
        return -1;
    *t = PyFloat_AsDouble(tv);
    Py_DECREF(tv);
    if (*t == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        PyErr_Clear();  /* not a number: the Python path raises what it raises */
        return 0;
    }
    if (!(*t == *t) || *t >= 1e9)  /* NaN, or "forever": the Python path */
        return 0;
    PyObject *rt = PyMember_GetOne((char *)conn, m_rcvtimeo);
    if (rt == NULL)
        return -1;
    *rcvtimeo = PyFloat_Check(rt) ? PyFloat_AS_DOUBLE(rt) : -1.0;
    Py_DECREF(rt);
    if (*rsize <= 0 || *rsize > link->idle_read)
        *rsize = link->idle_read;
    *want = PyMember_GetOne((char *)conn, m_want);
    if (*want == NULL)
        return -1;
    if (*want == Py_None)
        Py_CLEAR(*want);
    else if (!PyMemoryView_Check(*want)) {
        Py_CLEAR(*want);
        return 0;
    }
    return 1;
}

/* SO_RCVTIMEO to ``t`` (at least 1 us), remembered in _rcvtimeo: 0, 1 if the kernel refused, -1 error */
static int
set_rcvtimeo(Link *link, PyObject *conn, double t)
{
    struct timeval tv = {(time_t)t, (suseconds_t)((t - (double)(time_t)t) * 1e6)};
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1;
    if (setsockopt(link->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0)
        return 1;
    PyObject *v = PyFloat_FromDouble((double)tv.tv_sec + (double)tv.tv_usec * 1e-6);
    int e = v ? PyMember_SetOne((char *)conn, m_rcvtimeo, v) : -1;
    Py_XDECREF(v);
    return e;
}

/* After a read that brought nothing: a signal's handler run, the state for a peer that is
 * gone (the Python path then delivers what had arrived and says so); 0, or -1 error */
static int
read_failed(PyObject *conn, ssize_t n, int err)
{
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK))
        return 0;
    if (n < 0 && err == EINTR)
        return PyErr_CheckSignals();
    PyObject *why = n == 0 ? PyUnicode_FromString("peer closed the connection")
                           : PyUnicode_FromFormat("connection reset (%s)", strerror(err));
    PyObject *ret = why ? PyObject_CallMethodOneArg(conn, s_to_peer_gone, why) : NULL;
    Py_XDECREF(why);
    if (ret == NULL)
        return -1;
    Py_DECREF(ret);
    return 0;
}

/* A read that brought no message: Timeout for a caller that does not wait, as the Python
 * path raises it (a connection no longer OPEN goes there, to say why); else Py_None with
 * the time left for the Python path to wait */
static PyObject *
no_message(PyObject *conn, double t, double end, double *left)
{
    *left = end - monotonic();
    if (*left < 0)
        *left = 0;
    if (t <= 0) {
        int open = conn_open(conn);
        if (open <= 0)
            return open < 0 ? NULL : Py_NewRef(Py_None);
        PyErr_SetString(timeout_error, "timed out waiting for a message");
        return NULL;
    }
    return Py_NewRef(Py_None);
}

/* A message whose members are set directly, its buffers the list ``bufs`` (steals nothing) */
static PyObject *
message_of(PyObject *user, PyObject *bufs, PyObject *conn, PyObject *token)
{
    PyObject *msg = fp.msg_type->tp_alloc(fp.msg_type, 0);
    if (msg == NULL || PyMember_SetOne((char *)msg, fp.header, user) < 0
        || PyMember_SetOne((char *)msg, fp.buffers, bufs) < 0 || PyMember_SetOne((char *)msg, fp.released, Py_False) < 0
        || PyMember_SetOne((char *)msg, fp.conn, conn) < 0 || PyMember_SetOne((char *)msg, fp.token, token) < 0)
        Py_CLEAR(msg);
    return msg;
}

/* The payload in progress finished (``_cur``, what _parse_frames left): its message, _want and
 * _cur cleared. NULL with an error; Py_None (borrowed) if _cur is not what it should be. */
static PyObject *
finish_payload(Link *link, PyObject *conn)
{
    PyObject *cur = PyObject_GetAttr(conn, s_cur);
    if (cur == NULL)
        return NULL;
    PyObject *msg = Py_None;
    if (PyTuple_CheckExact(cur) && PyTuple_GET_SIZE(cur) == 3 && PyList_CheckExact(PyTuple_GET_ITEM(cur, 1))) {
        PyObject *slot = PyTuple_GET_ITEM(cur, 2);
        PyObject *nb = Py_IS_TYPE(slot, fp.slot_type) ? PyMember_GetOne((char *)slot, fp.nbytes) : NULL;
        unsigned long long k = nb ? PyLong_AsUnsignedLongLong(nb) : 0;
        Py_XDECREF(nb);
        if (PyErr_Occurred())
            PyErr_Clear();
        else if (nb != NULL)
            msg = message_of(PyTuple_GET_ITEM(cur, 0), PyTuple_GET_ITEM(cur, 1), conn, slot);
        if (msg != NULL && msg != Py_None) {
            if (PyMember_SetOne((char *)conn, m_want, Py_None) < 0 || PyObject_SetAttr(conn, s_cur, Py_None) < 0) {
                Py_DECREF(msg);
                msg = NULL;
            } else {
                link->msgs_in += 1;
                link->bytes_in += k;
            }
        }
    }
    Py_DECREF(cur);
    return msg;
}

/* One read of a payload in progress (the view ``want`` of its slot): a caller that waits
 * reads all of it with MSG_WAITALL, one that does not reads what is there, with the next
 * frames' start behind it into the read buffer. A message; Py_None (a new reference) for
 * none; NULL with an error set. */
static PyObject *
read_want(Link *link, PyObject *conn, PyObject *inbox, PyObject *want, int wait)
{
    Py_buffer wb;
    if (PyObject_GetBuffer(want, &wb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;  /* (a slice of a slot: cannot happen) */
    size_t k = (size_t)wb.len;
    ssize_t n;
    if (wait) {
        Py_BEGIN_ALLOW_THREADS
        n = recv(link->fd, wb.buf, k, MSG_WAITALL);
        Py_END_ALLOW_THREADS
    } else {
        struct iovec iov[2] = {{wb.buf, k}, {link->rbuf.buf, (size_t)link->read_ahead}};
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = 2;
        n = recvmsg(link->fd, &mh, MSG_DONTWAIT);
    }
    int err = errno;
    PyBuffer_Release(&wb);
    if (n <= 0)
        return read_failed(conn, n, err) < 0 ? NULL : Py_NewRef(Py_None);
    if ((size_t)n < k) {  /* more to come */
        PyObject *rest = fp_slice(want, (unsigned long long)n, k);
        int e = rest == NULL || PyMember_SetOne((char *)conn, m_want, rest) < 0;
        Py_XDECREF(rest);
        return e ? NULL : Py_NewRef(Py_None);
    }
    PyObject *msg = finish_payload(link, conn);
    if (msg == NULL || msg == Py_None) {
        if (msg == Py_None)
            PyErr_SetString(PyExc_RuntimeError, "a payload in progress without its message (_cur)");
        return NULL;
    }
    PyObject *first = msg;
    if ((size_t)n > k && parse_read(link, conn, inbox, (size_t)n - k, 0, link->read_ahead, &first) < 0) {
        Py_DECREF(msg);
        return NULL;
    }
    return msg;
}

/* One read into the empty read buffer (blocking up to SO_RCVTIMEO for a caller that waits)
 * and what it brought parsed. As read_want returns. */
static PyObject *
read_fresh(Link *link, PyObject *conn, PyObject *inbox, int wait, long long rsize)
{
    ssize_t n;
    if (!wait) {
        n = recv(link->fd, link->rbuf.buf, (size_t)rsize, MSG_DONTWAIT);
    } else {
        Py_BEGIN_ALLOW_THREADS
        n = recv(link->fd, link->rbuf.buf, (size_t)rsize, 0);
        Py_END_ALLOW_THREADS
    }
    if (n <= 0)
        return read_failed(conn, n, errno) < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *first = NULL;
    if (parse_read(link, conn, inbox, (size_t)n, wait, rsize, &first) < 0) {
        Py_XDECREF(first);
        return NULL;
    }
    if (first == NULL && PyObject_Size(inbox) > 0)
        first = PyObject_CallMethodNoArgs(inbox, s_popleft);
    return first != NULL || PyErr_Occurred() ? first : Py_NewRef(Py_None);
}

/* The read of a caller that waits but owed credits: they go first (what the Python path
 * does before it waits; the kernel takes a CREDIT frame at once unless the peer stopped
 * reading, and then the Python path waits for that too), then the wait, until ``end``. */
static PyObject *
credits_then_wait(Link *link, PyObject *conn, PyObject *inbox, double end)
{
    PyObject *r = PyObject_CallMethodNoArgs(conn, s_send_control);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    double t = 0, rcvtimeo = -1;
    long long owed = 0, rsize = 0;
    PyObject *want = NULL;
    int ok = recv_ready(link, conn, Py_None, &t, &owed, &rsize, &rcvtimeo, &want);
    t = end - monotonic();
    if (ok > 0 && (owed != 0 || t <= 0))
        ok = 0;
    if (ok > 0 && !(t * 0.5 <= rcvtimeo && rcvtimeo <= t))
        ok = set_rcvtimeo(link, conn, t) == 0 ? 1 : PyErr_Occurred() ? -1 : 0;
    PyObject *m = ok < 0 ? NULL : ok == 0 ? Py_NewRef(Py_None)
                                          : want ? read_want(link, conn, inbox, want, 1) : read_fresh(link, conn, inbox, 1, rsize);
    Py_XDECREF(want);
    return m;
}

/* StreamConnection._recv_py's common case: one read into the empty read buffer, or into the
 * payload in progress. A message; Py_None (a new reference) when it hands over -- the
 * Python path goes on with the caller's timeout (``*left`` < 0: nothing was waited for) or
 * ``*left`` seconds of it; NULL with an error set (Timeout included). */
static PyObject *
fast_recv(Link *link, PyObject *conn, PyObject *timeout, double *left)
{
    *left = -1.0;
    PyObject *inbox = PyMember_GetOne((char *)conn, m_inbox);
    if (inbox == NULL)
        return NULL;
    Py_ssize_t queued = PyObject_Size(inbox);
    if (queued != 0) {
        PyObject *m = queued > 0 ? PyObject_CallMethodNoArgs(inbox, s_popleft) : NULL;
        Py_DECREF(inbox);
        return m;
    }
    double t = 0, rcvtimeo = -1;
    long long owed = 0, rsize = 0;
    PyObject *want = NULL;
    int r = recv_ready(link, conn, timeout, &t, &owed, &rsize, &rcvtimeo, &want);
    int wait = r > 0 && t > 0 && owed == 0;  /* owed credits: sent before waiting, below */
    if (wait && !(t * 0.5 <= rcvtimeo && rcvtimeo <= t))
        r = set_rcvtimeo(link, conn, t) == 0 ? 1 : PyErr_Occurred() ? -1 : 0;
    if (r <= 0) {
        Py_XDECREF(want);
        Py_DECREF(inbox);
        return r < 0 ? NULL : Py_NewRef(Py_None);
    }
    double end = monotonic() + t;
    PyObject *m = want ? read_want(link, conn, inbox, want, wait) : read_fresh(link, conn, inbox, wait, rsize);
    Py_XDECREF(want);
    if (m == Py_None && !wait && t > 0) {  /* nothing yet, and credits owed */
        int open = conn_open(conn);
        Py_DECREF(m);
        m = open < 0 ? NULL : open ? credits_then_wait(link, conn, inbox, end) : Py_NewRef(Py_None);
    }
    Py_DECREF(inbox);
    if (m != Py_None)
        return m;
    Py_DECREF(m);
    return no_message(conn, t, end, left);
}

/* -- the connection's methods ------------------------------------------------------------ */

/* The ``timeout`` of a call whose other arguments are its first ``npos`` positional ones
 * (borrowed; None when not given); NULL (no error set) for any other form of call */
static PyObject *
timeout_arg(PyObject *const *args, size_t nargsf, PyObject *kwnames, Py_ssize_t npos)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL)
        return n == npos ? Py_None : n == npos + 1 ? args[npos] : NULL;
    if (n != npos || PyTuple_GET_SIZE(kwnames) != 1)
        return NULL;
    PyObject *name = PyTuple_GET_ITEM(kwnames, 0);
    return name == s_timeout || PyUnicode_Compare(name, s_timeout) == 0 ? args[n] : NULL;
}

static PyObject *
conn_alloc(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *timeout = timeout_arg(args, nargsf, kwnames, 1);
    Link *link = timeout != NULL && PyLong_CheckExact(args[0]) ? link_of(conn) : NULL;
    if (link != NULL) {
        int open = conn_open(conn);
        if (open < 0)
            return NULL;
        long long nbytes = open ? PyLong_AsLongLong(args[0]) : -1;
        if (nbytes == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (open && nbytes >= 0 && nbytes <= link->max_message) {
            PyObject *slot = fp_pool_pop(&fp, link->sfree, link->sin_use, link->sslots, args[0]);
            if (slot != Py_None)
                return slot;  /* a slot, or an error */
            Py_DECREF(slot);
        }
    }
    return fp_delegate(conn, s_alloc_py, args, nargsf, kwnames);
}

static PyObject *
conn_send(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *timeout = timeout_arg(args, nargsf, kwnames, 2);
    Link *link = timeout != NULL ? link_of(conn) : NULL;
    if (link != NULL) {
        int r = fast_send(link, conn, args[0], args[1], timeout);
        if (r < 0)
            return NULL;
        if (r > 0)
            Py_RETURN_NONE;
    }
    return fp_delegate(conn, s_send_py, args, nargsf, kwnames);
}

static PyObject *
conn_recv(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *timeout = timeout_arg(args, nargsf, kwnames, 0);
    Link *link = timeout != NULL ? link_of(conn) : NULL;
    if (link == NULL)
        return fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
    double left;
    PyObject *m = fast_recv(link, conn, timeout, &left);
    if (m != Py_None)
        return m;  /* a message, or an error */
    Py_DECREF(m);
    if (left < 0)  /* handed over before reading: the caller's own arguments */
        return fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
    PyObject *rest = PyFloat_FromDouble(left);
    if (rest == NULL)
        return NULL;
    PyObject *a[1] = {rest};
    PyObject *r = fp_delegate(conn, s_recv_py, a, 1, NULL);
    Py_DECREF(rest);
    return r;
}

FP_CONNECTION_METHODS("StreamConnection")

/* -- a message's release ------------------------------------------------------------------ */

/* StreamConnection._release_message in C: the slot back to the receive pool, a credit owed
 * (sent once half the peer's window is owed) */
static PyObject *
give_back(PyObject *conn, PyObject *token)
{
    Link *link = link_of(conn);
    long long st_, owed;
    int r = link != NULL ? get_ll(conn, m_state, &st_) : 1;
    if (r < 0)
        return NULL;
    PyObject *tpool = NULL;
    if (r == 0 && token != Py_None) {
        r = 1;
        if (Py_IS_TYPE(token, fp.slot_type) && (tpool = PyMember_GetOne((char *)token, fp.pool)) != NULL) {
            Py_DECREF(tpool);
            r = tpool == link->rpool ? 0 : 1;
        } else if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (r != 0)  /* not the common message: the Python hook */
        return PyObject_CallMethodOneArg(conn, s_release_message, token);
    if (st_ >= broken_state)
        Py_RETURN_NONE;
    if (token != Py_None) {
        PyObject *idx = PyMember_GetOne((char *)token, fp.index);
        Py_ssize_t i = idx ? PyLong_AsSsize_t(idx) : -1;
        Py_XDECREF(idx);
        if (PyErr_Occurred() || pool_put(link->rfree, link->rin_use, i) < 0)
            return NULL;
    }
    if ((r = get_ll(conn, m_owed, &owed)) != 0)
        return r < 0 ? NULL : PyObject_CallMethodOneArg(conn, s_release_message, token);
    if (set_ll(conn, m_owed, owed + 1) < 0)
        return NULL;
    if (owed + 1 >= link->owe_flush)
        return PyObject_CallMethodNoArgs(conn, s_send_control);
    Py_RETURN_NONE;
}

/* Message.release for tcp messages: the views released, then the backend's part; a
 * TransportError from it becomes the connection's (Connection._release_failed), as in
 * transport/base.py */
static PyObject *
message_release(PyObject *msg, PyObject *unused)
{
    PyObject *conn, *token;
    int done = fp_unhook(&fp, msg, &conn, &token);
    if (done)
        return done < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *ret;
    if (conn == Py_None) {
        ret = token == Py_None ? Py_NewRef(Py_None) : PyObject_CallNoArgs(token);
    } else {
        ret = PyObject_TypeCheck(conn, conn_type) ? give_back(conn, token)
                                                  : PyObject_CallMethodOneArg(conn, s_release_message, token);
        if (ret == NULL && PyErr_ExceptionMatches(transport_error)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            ret = PyObject_CallMethodOneArg(conn, s_release_failed, value);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
    }
    Py_DECREF(conn);
    Py_DECREF(token);
    if (ret == NULL)
        return NULL;
    Py_DECREF(ret);
    Py_RETURN_NONE;
}

static PyMethodDef release_def = {"release", message_release, METH_NOARGS,
                                  "Hand the buffers back: the slot to the receive pool, a credit owed to the peer."};

static PyMethodDef Link_methods[] = {
    {"close", (PyCFunction)Link_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyMemberDef Link_members[] = {
    {"msgs_in", T_ULONGLONG, offsetof(Link, msgs_in), 0, "messages received here, not yet in stats"},
    {"bytes_in", T_ULONGLONG, offsetof(Link, bytes_in), 0, "their payload bytes"},
    {"msgs_out", T_ULONGLONG, offsetof(Link, msgs_out), 0, "messages sent here, not yet in stats"},
    {"bytes_out", T_ULONGLONG, offsetof(Link, bytes_out), 0, "their payload bytes"},
    {"open", T_INT, offsetof(Link, open), READONLY, "1 until close()"},
    {NULL},
};

static PyTypeObject LinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transport._tcpfast.Link",
    .tp_doc = PyDoc_STR("One tcp connection's compiled fast path (see transport/stream.py)."),
    .tp_basicsize = sizeof(Link),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Link_init,
    .tp_dealloc = (destructor)Link_dealloc,
    .tp_methods = Link_methods,
    .tp_members = Link_members,
};

PyDoc_STRVAR(bind_doc, "bind(msg_cls, slot_cls, conn_cls, transport_error, timeout_error, broken, packer, "
             "unpackb, tag_data, tag_credit, pad_min)\n--\n\nThe message class recv makes (a "
             "transport.base.Message subclass), the pools' slot class, StreamConnection (the __slots__ "
             "members the fast path reads and writes), the errors it hands on, the first state in which "
             "nothing is given back, the user header packer and unpacker, framing's DATA and CREDIT tags "
             "and PAD_MIN; returns the ``release`` method to install on the message class.");

static PyObject *
bind_classes(PyObject *mod, PyObject *args)
{
    PyObject *cls, *scls, *ccls, *terr, *tout, *pack, *unpack;
    long broken;
    unsigned int td, tc;
    long long pm;
    if (!PyArg_ParseTuple(args, "O!O!O!OOlOOIIL", &PyType_Type, &cls, &PyType_Type, &scls, &PyType_Type, &ccls,
                          &terr, &tout, &broken, &pack, &unpack, &td, &tc, &pm))
        return NULL;
    if (fp_bind(&fp, cls, scls) < 0)
        return NULL;
    PyMemberDef *ms[11];
    const char *names[11] = {"_state", "_credits", "_owed", "_rpos", "_rend", "_want", "_out", "_inbox",
                             "_rcvtimeo", "_rsize", "_link"};
    for (int i = 0; i < 11; i++)
        if ((ms[i] = fp_member(ccls, names[i])) == NULL)
            return NULL;
    m_state = ms[0], m_credits = ms[1], m_owed = ms[2], m_rpos = ms[3], m_rend = ms[4], m_want = ms[5];
    m_out = ms[6], m_inbox = ms[7], m_rcvtimeo = ms[8], m_rsize = ms[9], m_link = ms[10];
    if (kw_strict == NULL && (kw_strict = Py_BuildValue("(s)", "strict_map_key")) == NULL)
        return NULL;
    Py_XSETREF(conn_type, (PyTypeObject *)Py_NewRef(ccls));
    Py_XSETREF(transport_error, Py_NewRef(terr));
    Py_XSETREF(timeout_error, Py_NewRef(tout));
    Py_XSETREF(packer, Py_NewRef(pack));
    Py_XSETREF(unpackb, Py_NewRef(unpack));
    broken_state = broken;
    tag_data = td;
    tag_credit = tc;
    pad_min = pm;
    return PyDescr_NewMethod((PyTypeObject *)cls, &release_def);
}

static PyMethodDef module_methods[] = {
    {"connection_methods", connection_methods, METH_O, connection_methods_doc},
    {"bind", bind_classes, METH_VARARGS, bind_doc},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transport._tcpfast",
    "tcp://'s compiled fast path for the one-slot message (transport/stream.py owns the protocol).",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__tcpfast(void)
{
    struct {
        PyObject **p;
        const char *s;
    } names[] = {{&s_alloc_py, "_alloc_py"}, {&s_send_py, "_send_py"}, {&s_recv_py, "_recv_py"},
                 {&s_sent_part, "_sent_part"}, {&s_parse_rest, "_parse_rest"}, {&s_to_peer_gone, "_to_peer_gone"},
                 {&s_send_control, "_send_control"}, {&s_release_message, "_release_message"},
                 {&s_release_failed, "_release_failed"}, {&s_popleft, "popleft"},
                 {&s_default_timeout, "default_timeout"}, {&s_cur, "_cur"}, {&s_timeout, "timeout"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return NULL;
    return fp_module(&module, &LinkType);
}
