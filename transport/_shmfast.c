/* shm://'s compiled fast path: the common message (one slot, framing's fixed-width fast
 * record) sent, received and released in one call each.
 *
 * transport/shm.py stays the whole protocol: this module only does, for the one record
 * shape it recognises, what shm.py's Python fast path does, byte for byte, on the same
 * cursors (the Link's members, which shm.py reads and writes too). Anything it does not
 * recognise -- no record yet, ring padding, a msgpack record, a malformed or hostile fast
 * record, a full ring -- it leaves untouched (recv returns None, send -1) and the Python
 * path handles it, errors included. So it never raises a protocol error itself and never
 * reads or writes outside the rings and words it was given (every index is checked against
 * the buffer it points into; the peer can rewrite its memory at any time, so each field
 * is read once into a local).
 *
 * Memory ordering is shmring.py's (x86-TSO): record bytes, then the tail; the Dekker
 * StoreLoad fence before reading the peer's "armed" word is a seq_cst fence (mfence),
 * where the Python path takes and drops a lock.
 */
#include "_fastpath.h"
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* transport/shmring.py: control word indexes (u64) */
#define W_OUT_TAIL (8 * 1)
#define W_OUT_HEAD (8 * 2)
#define W_RET_TAIL (8 * 3)
#define W_RET_HEAD (8 * 4)
#define W_ARMED_DATA (8 * 5)
#define W_ARMED_SPACE (8 * 6)
#define W_RUNG (8 * 7)
#define W_RUNG_AT (8 * 7 + 1)
#define N_WORDS (W_RUNG_AT + 1)
#define REC_HDR 8

/* bind(): the message class this module makes and releases, its slots, and what a
 * release needs to know about the connection (transport/base.py's lifecycle) */
static FastPath fp;
static PyObject *packer;  /* a user header's msgpack bytes */
static PyObject *protocol_error, *s_link, *s_release_failed;
static long broken_state;

typedef struct {
    PyObject_HEAD
    int open;
    Py_buffer seg, peer;            /* our mapping and the peer's (held while open) */
    volatile uint64_t *w, *pw;      /* our control words, the peer's */
    unsigned char *out, *in;        /* our record ring, the peer's */
    uint64_t out_cap, in_cap;
    volatile uint32_t *pret;        /* the return ring in the peer's segment */
    uint64_t pret_cap;
    volatile uint32_t *ret;         /* ours: the peer gives our slots back on it */
    uint64_t ret_cap;
    uint64_t recv_stride, recv_slot_size, recv_nslots;
    uint64_t max_record;            /* framing.MAX_FAST_RECORD */
    uint32_t tag;                   /* framing.TAG_FAST */
    int bell_fd, peer_bell_fd;
    PyObject *recv_mem, *unpack;
    /* attach_pool(): our send pool's free list, so alloc() pops it as BufferPool does */
    PyObject *pool, *free, *in_use, *slots;
    long long max_message;
    /* cursors shared with shm.py (see shmring.Cursors) */
    unsigned long long out_tail, in_head, ret_tail, ret_head, rung_sent, rung_seen;
    /* messages through this path, folded into ConnectionStats by shm.py */
    unsigned long long msgs_in, bytes_in, msgs_out, bytes_out;
} Link;

static inline uint64_t ld(volatile uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st(volatile uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static void
ring(Link *self)
{
    struct timespec ts;
    uint64_t one = 1;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* the clock time.monotonic_ns() reads */
    st(&self->pw[W_RUNG_AT], (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
    /* EAGAIN (the counter is saturated: rung anyway) or a peer gone: nothing to do */
    if (write(self->peer_bell_fd, &one, sizeof one) < 0) { /* ignored, as shmring.ring_bell */ }
    self->rung_sent += 1;
    st(&self->pw[W_RUNG], self->rung_sent);  /* after the write: a reader that sees it may clear */
}

static int
inside(Py_buffer *view, Py_ssize_t off, Py_ssize_t len, const char *what)
{
    if (off < 0 || len < 0 || off > view->len - len) {
        PyErr_Format(PyExc_ValueError, "%s (%zd bytes at %zd) is outside its mapping of %zd bytes",
                     what, len, off, view->len);
        return -1;
    }
    return 0;
}

static int
pow2(uint64_t v) { return v && !(v & (v - 1)); }

static int
Link_init(Link *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"seg", "out_off", "out_cap", "peer", "in_off", "in_cap", "pret_off", "pret_cap",
                         "ret_off", "ret_cap", "recv_mem", "recv_stride", "recv_slot_size", "recv_nslots",
                         "bell_fd", "peer_bell_fd", "unpack", "max_record", "tag", "out_tail", "in_head",
                         "ret_tail", "ret_head", "rung_sent", "rung_seen", NULL};
    PyObject *seg, *peer, *recv_mem, *unpack;
    Py_ssize_t out_off, out_cap, in_off, in_cap, pret_off, pret_cap, ret_off, ret_cap;
    unsigned long long stride, slot_size, nslots, max_record, out_tail, in_head, ret_tail, ret_head, rung_sent,
        rung_seen;
    unsigned int tag;
    int bell_fd, peer_bell_fd;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Link is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnnOnnnnnnOKKKiiOKIKKKKKK", kw, &seg, &out_off, &out_cap,
                                     &peer, &in_off, &in_cap, &pret_off, &pret_cap, &ret_off, &ret_cap,
                                     &recv_mem, &stride, &slot_size, &nslots, &bell_fd, &peer_bell_fd, &unpack,
                                     &max_record, &tag, &out_tail, &in_head, &ret_tail, &ret_head, &rung_sent,
                                     &rung_seen))
        return -1;
    if (!pow2((uint64_t)out_cap) || !pow2((uint64_t)in_cap) || !pow2((uint64_t)pret_cap)
        || !pow2((uint64_t)ret_cap)) {
        PyErr_SetString(PyExc_ValueError, "ring sizes must be powers of two");
        return -1;
    }
    if (fp.msg_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bind() the message class first");
        return -1;
    }
    if (max_record < 16 || max_record > (1u << 20) || !PyCallable_Check(unpack)) {
        PyErr_SetString(PyExc_ValueError, "bad max_record or unpack");
        return -1;
    }
    if (PyObject_GetBuffer(seg, &self->seg, PyBUF_WRITABLE) < 0)
        return -1;
    if (PyObject_GetBuffer(peer, &self->peer, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&self->seg);
        return -1;
    }
    if (inside(&self->seg, 0, N_WORDS * 8, "our control words") < 0
        || inside(&self->seg, out_off, out_cap, "our ring") < 0
        || inside(&self->peer, 0, N_WORDS * 8, "the peer's control words") < 0
        || inside(&self->peer, in_off, in_cap, "the peer's ring") < 0
        || inside(&self->peer, pret_off, pret_cap * 4, "the peer's return ring") < 0
        || inside(&self->seg, ret_off, ret_cap * 4, "our return ring") < 0
        || (((uintptr_t)self->seg.buf | (uintptr_t)self->peer.buf | (uintptr_t)out_off | (uintptr_t)in_off
             | (uintptr_t)pret_off | (uintptr_t)ret_off) & 7)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "mappings and rings must be 8-byte aligned");
        PyBuffer_Release(&self->seg);
        PyBuffer_Release(&self->peer);
        return -1;
    }
    self->w = (volatile uint64_t *)self->seg.buf;
    self->pw = (volatile uint64_t *)self->peer.buf;
    self->out = (unsigned char *)self->seg.buf + out_off;
    self->in = (unsigned char *)self->peer.buf + in_off;
    self->pret = (volatile uint32_t *)((unsigned char *)self->peer.buf + pret_off);
    self->out_cap = (uint64_t)out_cap;
    self->in_cap = (uint64_t)in_cap;
    self->pret_cap = (uint64_t)pret_cap;
    self->ret = (volatile uint32_t *)((unsigned char *)self->seg.buf + ret_off);
    self->ret_cap = (uint64_t)ret_cap;
    self->recv_stride = stride;
    self->recv_slot_size = slot_size;
    self->recv_nslots = nslots;
    self->max_record = max_record;
    self->tag = tag;
    self->bell_fd = bell_fd;
    self->peer_bell_fd = peer_bell_fd;
    Py_INCREF(recv_mem);
    Py_INCREF(unpack);
    self->recv_mem = recv_mem;
    self->unpack = unpack;
    self->out_tail = out_tail;
    self->in_head = in_head;
    self->ret_tail = ret_tail;
    self->ret_head = ret_head;
    self->rung_sent = rung_sent;
    self->rung_seen = rung_seen;
    self->open = 1;
    return 0;
}

static void
release_all(Link *self)
{
    if (self->open) {
        self->open = 0;
        PyBuffer_Release(&self->seg);
        PyBuffer_Release(&self->peer);
    }
    Py_CLEAR(self->recv_mem);
    Py_CLEAR(self->unpack);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->free);
    Py_CLEAR(self->in_use);
    Py_CLEAR(self->slots);
}

static void
Link_dealloc(Link *self)
{
    release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(close_doc, "close()\n--\n\nRelease the mappings (the cursors stay readable); every "
             "later call declines (recv None, send and give_back -1).");

static PyObject *
Link_close(Link *self, PyObject *unused)
{
    release_all(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(send_doc, "send(slot, nbytes, user)\n--\n\nWrite the fast record for ``nbytes`` of "
             "our slot ``slot`` with packed user header ``user`` (b\"\" for {}) and publish it, ringing "
             "the peer if it sleeps; 0. -1, with nothing written, when the record needs the Python path "
             "(ring padding, a full ring, a header too large, a corrupted head, a closed link).");

/* The fast record for ``nbytes`` of our slot ``slot``, published; -1 (nothing written)
 * when it needs the Python path. */
static int
send_record(Link *self, unsigned long long slot, unsigned long long nbytes, const char *user, Py_ssize_t ulen)
{
    if (!self->open || slot > UINT32_MAX)
        return -1;
    uint64_t n = 16 + (uint64_t)ulen;
    if (n > self->max_record)
        return -1;
    uint64_t need = (n + 15) & ~(uint64_t)7;  /* REC_HDR + n rounded up to 8 */
    uint64_t old = self->out_tail, cap = self->out_cap;
    uint64_t pos = old & (cap - 1);
    uint64_t used = old - ld(&self->w[W_OUT_HEAD]);
    if (pos + need > cap || used > cap - need)  /* padding first, no room, or a corrupted head */
        return -1;
    unsigned char *p = self->out + pos;
    uint32_t hdr[4] = {(uint32_t)n, 0, self->tag, (uint32_t)slot};
    memcpy(p, hdr, sizeof hdr);
    memcpy(p + 16, &nbytes, 8);
    if (ulen)
        memcpy(p + REC_HDR + 16, user, (size_t)ulen);
    self->out_tail = old + need;
    st(&self->w[W_OUT_TAIL], old + need);  /* publish: after the record's bytes */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the tail (store) before "armed" and head (loads) */
    if (ld(&self->pw[W_ARMED_DATA]) && ld(&self->w[W_OUT_HEAD]) == old)
        ring(self);  /* armed, and it had taken all but our record */
    self->msgs_out += 1;
    self->bytes_out += nbytes;
    return 0;
}

static PyObject *
Link_send(Link *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long slot, nbytes;
    char *user;
    Py_ssize_t ulen;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send(slot, nbytes, user)");
        return NULL;
    }
    slot = PyLong_AsUnsignedLongLong(args[0]);
    nbytes = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (PyBytes_AsStringAndSize(args[2], &user, &ulen) < 0)
        return NULL;
    return PyLong_FromLong(send_record(self, slot, nbytes, user, ulen));
}

PyDoc_STRVAR(send_message_doc, "send_message(conn, header, buffers)\n--\n\nShmConnection.send's "
             "fast path whole: ``buffers`` one Slot of our send pool, ``conn`` open, the header "
             "packed ({} as no bytes) into a fast record that fits; 0. -1 when anything is otherwise "
             "(the Python path then sends it, or raises what is wrong), nothing written.");

static PyObject *
Link_send_message(Link *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "send_message(conn, header, buffers)");
        return NULL;
    }
    PyObject *conn = args[0], *header = args[1], *buffers = args[2], *b;
    if (!self->open || self->pool == NULL || fp.slot_type == NULL)
        return PyLong_FromLong(-1);
    if (PyList_CheckExact(buffers) && PyList_GET_SIZE(buffers) == 1)
        b = PyList_GET_ITEM(buffers, 0);
    else if (PyTuple_CheckExact(buffers) && PyTuple_GET_SIZE(buffers) == 1)
        b = PyTuple_GET_ITEM(buffers, 0);
    else
        return PyLong_FromLong(-1);
    if (Py_TYPE(b) != fp.slot_type)
        return PyLong_FromLong(-1);
    PyObject *bpool = PyMember_GetOne((char *)b, fp.pool);
    if (bpool == NULL)
        return NULL;
    Py_DECREF(bpool);
    if (bpool != self->pool)
        return PyLong_FromLong(-1);
    int open = fp_conn_open(&fp, conn);
    if (open <= 0)
        return open < 0 ? NULL : PyLong_FromLong(-1);
    PyObject *raw = NULL;
    char *user = NULL;
    Py_ssize_t ulen = 0;
    if (!(PyDict_CheckExact(header) && PyDict_GET_SIZE(header) == 0)) {
        raw = PyObject_CallOneArg(packer, header);
        if (raw == NULL) {  /* not serialisable: the Python path raises TypeError */
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            PyErr_Clear();
            return PyLong_FromLong(-1);
        }
        if (PyBytes_AsStringAndSize(raw, &user, &ulen) < 0) {
            Py_DECREF(raw);
            PyErr_Clear();
            return PyLong_FromLong(-1);
        }
    }
    PyObject *index = PyMember_GetOne((char *)b, fp.index), *nbytes = index ? PyMember_GetOne((char *)b, fp.nbytes) : NULL;
    unsigned long long i = index ? PyLong_AsUnsignedLongLong(index) : 0, n = nbytes ? PyLong_AsUnsignedLongLong(nbytes) : 0;
    Py_XDECREF(index);
    Py_XDECREF(nbytes);
    int r = PyErr_Occurred() ? -2 : send_record(self, i, n, user, ulen);
    Py_XDECREF(raw);
    if (r == -2) {
        PyErr_Clear();
        r = -1;
    }
    return PyLong_FromLong(r);
}

/* Our slots the peer gave back, from our return ring into the attached pool's free list (shm.py's
 * _take_returns for ids it can take): 0 when every one waiting was taken; 1 when it stopped at a
 * corrupted ring or an id we did not lend, which it leaves in the ring for the Python path to
 * report; -1 with an exception set. */
static int
take_returns(Link *self)
{
    uint64_t head = self->ret_head, tail = ld(&self->w[W_RET_TAIL]);
    if (tail == head)
        return 0;
    if (tail - head > self->ret_cap)
        return 1;
    PyObject *in_use = self->in_use;
    Py_ssize_t nslots = PyList_GET_SIZE(in_use);
    int r = 0;
    for (; head != tail; head++) {
        uint32_t i = self->ret[head & (self->ret_cap - 1)];  /* read once: the peer may rewrite it */
        if ((Py_ssize_t)i >= nslots || PyList_GET_ITEM(in_use, i) != Py_True) {
            r = 1;  /* out of range or returned twice */
            break;
        }
        PyObject *id = PyLong_FromUnsignedLong(i);
        PyObject *done = id ? PyObject_CallMethodOneArg(self->free, fp.s_append, id) : NULL;
        Py_XDECREF(id);
        if (done == NULL) {
            r = -1;
            break;
        }
        Py_DECREF(done);
        PyList_SetItem(in_use, i, Py_NewRef(Py_False));
    }
    if (head != self->ret_head) {
        self->ret_head = head;
        st(&self->w[W_RET_HEAD], head);  /* the peer's room to return more */
    }
    return r;
}

PyDoc_STRVAR(alloc_doc, "alloc(conn, nbytes)\n--\n\nShmConnection.alloc's fast path: the slots the "
             "peer gave back taken into the attached pool first, then its last freed slot, sized to "
             "``nbytes``; None (nothing taken) when none is free, ``nbytes`` is out of range, ``conn`` "
             "is not open or the return ring holds something it does not take (the Python path then "
             "waits or raises).");

static PyObject *
Link_alloc(Link *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "alloc(conn, nbytes)");
        return NULL;
    }
    if (!self->open || self->free == NULL || !PyLong_CheckExact(args[1]))
        Py_RETURN_NONE;
    long long nbytes = PyLong_AsLongLong(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (nbytes < 0 || nbytes > self->max_message)
        Py_RETURN_NONE;
    int open = fp_conn_open(&fp, args[0]);
    if (open <= 0) {
        if (open < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    /* returns first: the slot given back last is reused next, so the slots in flight stay the
     * working set (a sender that took them only when its pool ran dry would write each slot once,
     * faulting it in on both sides, before it came back to the first) */
    int taken = take_returns(self);
    if (taken != 0)
        return taken < 0 ? NULL : Py_NewRef(Py_None);
    return fp_pool_pop(&fp, self->free, self->in_use, self->slots, args[1]);
}

PyDoc_STRVAR(attach_pool_doc, "attach_pool(pool, free, in_use, slots, max_message)\n--\n\nOur send "
             "pool (transport.pool.BufferPool) and its free list, in-use flags and slots, for alloc "
             "and send_message.");

static PyObject *
Link_attach_pool(Link *self, PyObject *args)
{
    PyObject *pool, *free, *in_use, *slots;
    long long max_message;
    if (!PyArg_ParseTuple(args, "OOO!O!L", &pool, &free, &PyList_Type, &in_use, &PyList_Type, &slots,
                          &max_message))
        return NULL;
    Py_INCREF(pool);
    Py_INCREF(free);
    Py_INCREF(in_use);
    Py_INCREF(slots);
    Py_XSETREF(self->pool, pool);
    Py_XSETREF(self->free, free);
    Py_XSETREF(self->in_use, in_use);
    Py_XSETREF(self->slots, slots);
    self->max_message = max_message;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(recv_doc, "recv(conn)\n--\n\nThe next record as a message of the bound class "
             "(header, [view], released False, conn, the slot; no __init__ runs) "
             "if it is a well-formed fast record, its ring space given back; None, with nothing "
             "consumed, for anything else (no record, padding, another record, a malformed one: the "
             "Python path reads it and says what is wrong).");

static PyObject *
Link_recv(Link *self, PyObject *conn)
{
    if (!self->open)
        Py_RETURN_NONE;
    uint64_t head = self->in_head, cap = self->in_cap;
    uint64_t avail = ld(&self->pw[W_OUT_TAIL]) - head;
    if (avail == 0 || avail > cap)
        Py_RETURN_NONE;
    uint64_t pos = head & (cap - 1);
    if (pos + 16 + REC_HDR > cap)
        Py_RETURN_NONE;
    unsigned char rec[REC_HDR + 16];
    memcpy(rec, self->in + pos, sizeof rec);  /* read once: the peer may rewrite it */
    uint32_t n, tag, slot;
    uint64_t k;
    memcpy(&n, rec, 4);
    memcpy(&tag, rec + REC_HDR, 4);
    memcpy(&slot, rec + REC_HDR + 4, 4);
    memcpy(&k, rec + REC_HDR + 8, 8);
    uint64_t need = ((uint64_t)n + 15) & ~(uint64_t)7;
    if (n < 16 || n > self->max_record || need > avail || pos + need > cap || tag != self->tag
        || slot >= self->recv_nslots || k > self->recv_slot_size)
        Py_RETURN_NONE;
    PyObject *user;
    if (n == 16) {
        user = PyDict_New();
    } else {
        PyObject *raw = PyBytes_FromStringAndSize((const char *)self->in + pos + REC_HDR + 16, n - 16);
        if (raw == NULL)
            return NULL;
        user = PyObject_CallOneArg(self->unpack, raw);
        Py_DECREF(raw);
        if (user == NULL) {  /* garbage: the Python path raises the ProtocolError */
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;  /* KeyboardInterrupt, MemoryError...: not ours to hide */
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    if (user == NULL)
        return NULL;
    uint64_t base = (uint64_t)slot * self->recv_stride;
    PyObject *view = fp_slice(self->recv_mem, base, base + k);
    PyObject *s = view ? PyLong_FromUnsignedLong(slot) : NULL;
    PyObject *msg = s ? fp_message(&fp, user, view, conn, s) : NULL;
    Py_DECREF(user);
    Py_XDECREF(view);
    Py_XDECREF(s);
    if (msg == NULL)
        return NULL;
    /* consumed: its ring space goes back, and we re-arm (see shm.py's recv) */
    self->in_head = head + need;
    st(&self->pw[W_OUT_HEAD], head + need);
    st(&self->w[W_ARMED_DATA], 1);
    if (ld(&self->pw[W_ARMED_SPACE]))
        ring(self);  /* the peer waits for ring space */
    uint64_t rung = ld(&self->w[W_RUNG]);
    if (rung != self->rung_seen) {  /* we were rung for this record: unread, the fd stays readable */
        uint64_t v;
        if (read(self->bell_fd, &v, sizeof v) < 0) { /* EAGAIN: nothing to clear */ }
        self->rung_seen = rung;
    }
    self->msgs_in += 1;
    self->bytes_in += k;
    return msg;
}

static int
give_back(Link *self, unsigned long slot)
{
    if (!self->open || slot > UINT32_MAX)
        return -1;
    uint64_t tail = self->ret_tail;
    if (tail - ld(&self->pw[W_RET_HEAD]) >= self->pret_cap)
        return -1;  /* more returned than the peer has: it corrupted its head */
    self->pret[tail & (self->pret_cap - 1)] = (uint32_t)slot;
    self->ret_tail = tail + 1;
    st(&self->pw[W_RET_TAIL], tail + 1);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* the return (store) before "armed" (load) */
    if (ld(&self->pw[W_ARMED_SPACE]))
        ring(self);
    return 0;
}

PyDoc_STRVAR(give_back_doc, "give_back(slot)\n--\n\nReturn the peer's slot ``slot`` on its return "
             "ring (the credit), ringing it if it waits; 0, or -1 if the ring is corrupted (the "
             "peer moved its head) or the link closed.");

static PyObject *
Link_give_back(Link *self, PyObject *arg)
{
    unsigned long slot = PyLong_AsUnsignedLong(arg);
    if (slot == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(give_back(self, slot));
}

PyDoc_STRVAR(ring_doc, "ring()\n--\n\nRing the peer's doorbell (W_RUNG_AT, the eventfd, W_RUNG).");

static PyObject *
Link_ring(Link *self, PyObject *unused)
{
    if (self->open)
        ring(self);
    Py_RETURN_NONE;
}

static PyMethodDef Link_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Link_send, METH_FASTCALL, send_doc},
    {"send_message", (PyCFunction)(void (*)(void))Link_send_message, METH_FASTCALL, send_message_doc},
    {"alloc", (PyCFunction)(void (*)(void))Link_alloc, METH_FASTCALL, alloc_doc},
    {"attach_pool", (PyCFunction)Link_attach_pool, METH_VARARGS, attach_pool_doc},
    {"recv", (PyCFunction)Link_recv, METH_O, recv_doc},
    {"give_back", (PyCFunction)Link_give_back, METH_O, give_back_doc},
    {"ring", (PyCFunction)Link_ring, METH_NOARGS, ring_doc},
    {"close", (PyCFunction)Link_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyMemberDef Link_members[] = {
    {"out_tail", T_ULONGLONG, offsetof(Link, out_tail), 0, "bytes we published in our ring"},
    {"in_head", T_ULONGLONG, offsetof(Link, in_head), 0, "bytes we consumed from the peer's ring"},
    {"ret_tail", T_ULONGLONG, offsetof(Link, ret_tail), 0, "slot ids we returned to the peer"},
    {"ret_head", T_ULONGLONG, offsetof(Link, ret_head), 0, "slot ids the peer returned that we took"},
    {"rung_sent", T_ULONGLONG, offsetof(Link, rung_sent), 0, "times we rang the peer"},
    {"rung_seen", T_ULONGLONG, offsetof(Link, rung_seen), 0, "the peer's ring count we cleared for"},
    {"msgs_in", T_ULONGLONG, offsetof(Link, msgs_in), 0, "messages received here, not yet in stats"},
    {"bytes_in", T_ULONGLONG, offsetof(Link, bytes_in), 0, "their payload bytes"},
    {"msgs_out", T_ULONGLONG, offsetof(Link, msgs_out), 0, "messages sent here, not yet in stats"},
    {"bytes_out", T_ULONGLONG, offsetof(Link, bytes_out), 0, "their payload bytes"},
    {"open", T_INT, offsetof(Link, open), READONLY, "1 until close()"},
    {NULL},
};

static PyTypeObject LinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transport._shmfast.Link",
    .tp_doc = PyDoc_STR("One shm connection's compiled fast path (see transport/shm.py)."),
    .tp_basicsize = sizeof(Link),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Link_init,
    .tp_dealloc = (destructor)Link_dealloc,
    .tp_methods = Link_methods,
    .tp_members = Link_members,
};

/* A message of the bound class, released: what shm.py's _SlotMessage.release does (the
 * views released, the slot given back, a corrupted return ring made the connection's
 * error), for messages whose connection has a Link. */
static PyObject *
message_release(PyObject *msg, PyObject *unused)
{
    PyObject *conn, *token;
    int done = fp_unhook(&fp, msg, &conn, &token);
    if (done)
        return done < 0 ? NULL : Py_NewRef(Py_None);
    if (conn == Py_None) {
        Py_DECREF(conn);
        Py_DECREF(token);
        Py_RETURN_NONE;
    }
    PyObject *state = PyObject_GetAttr(conn, fp.s_state);
    PyObject *link = state ? PyObject_GetAttr(conn, s_link) : NULL;
    PyObject *ret = NULL;
    if (link != NULL) {
        long st_ = PyLong_AsLong(state);
        unsigned long slot = PyLong_AsUnsignedLong(token);
        if (PyErr_Occurred()) {
            /* not ours: leave it to the error */
        } else if (st_ >= broken_state || !PyObject_TypeCheck(link, &LinkType)) {  /* torn down, or no Link */
            ret = Py_NewRef(Py_None);
        } else if (give_back((Link *)link, slot) < 0) {
            PyObject *why = PyUnicode_FromString("more slots returned than the peer has");
            PyObject *err = why ? PyObject_CallOneArg(protocol_error, why) : NULL;
            ret = err ? PyObject_CallMethodOneArg(conn, s_release_failed, err) : NULL;
            Py_XDECREF(why);
            Py_XDECREF(err);
        } else {
            ret = Py_NewRef(Py_None);
        }
    }
    Py_XDECREF(token);
    Py_XDECREF(link);
    Py_XDECREF(state);
    Py_DECREF(conn);
    if (ret == NULL)
        return NULL;
    Py_DECREF(ret);
    Py_RETURN_NONE;
}

static PyMethodDef release_def = {"release", message_release, METH_NOARGS,
                                  "Hand the buffers back and return the slot to the peer (the credit)."};

PyDoc_STRVAR(bind_doc, "bind(msg_cls, protocol_error, broken, slot_cls, packer)\n--\n\nThe message class recv makes "
             "(a transport.base.Message subclass: its slots header, buffers, released, _conn, _token are "
             "set directly), the error a corrupted return ring is reported as, and the first "
             "connection state in which nothing is given back, the send pool's slot class and the "
             "user header packer; returns the ``release`` method to install on the message class.");

static PyObject *
bind(PyObject *mod, PyObject *args)
{
    PyObject *cls, *err, *scls, *pack;
    long broken;
    if (!PyArg_ParseTuple(args, "O!OlO!O", &PyType_Type, &cls, &err, &broken, &PyType_Type, &scls, &pack))
        return NULL;
    if (fp_bind(&fp, cls, scls) < 0)
        return NULL;
    Py_XSETREF(protocol_error, Py_NewRef(err));
    Py_XSETREF(packer, Py_NewRef(pack));
    broken_state = broken;
    return PyDescr_NewMethod((PyTypeObject *)cls, &release_def);
}

/* ShmConnection's alloc, send and recv when the compiled path is built: the Link's fast
 * path first (no Python frame at all for the common message), and whatever it declines --
 * or any call with keywords -- goes to the Python method of the same name with a leading
 * underscore and "_py" (ShmConnection._alloc_py...), which owns the waiting and the errors. */
static PyObject *s_alloc_py, *s_send_py, *s_recv_py;

static Link *
link_of(PyObject *conn)
{
    return (Link *)fp_link_of(conn, s_link, &LinkType);
}

static PyObject *
conn_alloc(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Link *link = kwnames == NULL && n >= 1 && n <= 2 ? link_of(conn) : NULL;
    if (link != NULL) {
        PyObject *a[2] = {conn, args[0]};
        PyObject *slot = Link_alloc(link, a, 2);
        if (slot != Py_None)
            return slot;  /* a slot, or an error */
        Py_DECREF(slot);
    }
    return fp_delegate(conn, s_alloc_py, args, nargsf, kwnames);
}

static PyObject *
conn_send(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Link *link = kwnames == NULL && n >= 2 && n <= 3 ? link_of(conn) : NULL;
    if (link != NULL) {
        PyObject *a[3] = {conn, args[0], args[1]};
        PyObject *r = Link_send_message(link, a, 3);
        if (r == NULL)
            return NULL;
        long sent = PyLong_AsLong(r);
        Py_DECREF(r);
        if (sent == 0)
            Py_RETURN_NONE;
    }
    return fp_delegate(conn, s_send_py, args, nargsf, kwnames);
}

static PyObject *
conn_recv(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Link *link = kwnames == NULL && n <= 1 ? link_of(conn) : NULL;
    if (link != NULL) {
        int open = fp_conn_open(&fp, conn);  /* a BROKEN or CLOSED connection raises, below */
        if (open < 0)
            return NULL;
        if (open) {
            PyObject *m = Link_recv(link, conn);
            if (m != Py_None)
                return m;
            Py_DECREF(m);
        }
    }
    return fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
}

FP_CONNECTION_METHODS("ShmConnection")

static PyMethodDef module_methods[] = {
    {"connection_methods", connection_methods, METH_O, connection_methods_doc},
    {"bind", bind, METH_VARARGS, bind_doc},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transport._shmfast",
    "shm://'s compiled fast path for the one-slot fast record (transport/shm.py owns the protocol).",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__shmfast(void)
{
    if (!(s_link = PyUnicode_InternFromString("_link"))
        || !(s_release_failed = PyUnicode_InternFromString("_release_failed"))
        || !(s_alloc_py = PyUnicode_InternFromString("_alloc_py")) || !(s_send_py = PyUnicode_InternFromString("_send_py"))
        || !(s_recv_py = PyUnicode_InternFromString("_recv_py")))
        return NULL;
    return fp_module(&module, &LinkType);
}
