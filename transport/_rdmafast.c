/* rdma://'s compiled fast path: the common small message (one slot, framing's fixed-width
 * fast SEND) posted, polled, received and released without a Python frame or a pyverbs
 * object per message.
 *
 * transport/rdma_conn.py stays the whole protocol and pyverbs keeps the device, PD, MRs,
 * CQs and the QP's set-up: this module takes the QP and CQs pyverbs made (their C pointers,
 * found in pyverbs' objects and verified, see find_qp) and does, for the one message shape
 * it recognises, what rdma_conn.py's Python path does, on the same counters (the Link's
 * members, which rdma_conn.py reads and writes too). Anything else -- a DATA frame, a
 * credit message, a WRITE WITH IMMEDIATE, a failed completion, a malformed or hostile fast
 * SEND, a message that returns slots, no credit -- it hands to the Python path untouched:
 * a send declines (nothing posted), a completion it does not take goes to
 * ``conn._on_completions`` with every one after it, in order. So it never raises a
 * protocol error itself, and a peer's bytes are only ever read inside the receive buffer
 * the completion names, after checking its length.
 *
 * Only verbs.h's inline calls are used (ibv_post_send, ibv_post_recv, ibv_poll_cq go
 * through the context's ops): the module does not link libibverbs.
 */
#define _GNU_SOURCE
#include "_fastpath.h"
#include <stdint.h>
#include <string.h>
#include <arpa/inet.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define NPOLL 16
#define FAST_SIZE 16
#define FAST_ALIGN 64

/* bind(): the classes and helpers shared with rdma_conn.py */
static FastPath fp;
static PyObject *packer, *unpack, *transport_error;
static long broken_state, max_user;
static uint32_t tag_fast;
static PyObject *s_link, *s_popleft, *s_fd_used, *s_quiesce, *s_flush, *s_on_completions, *s_qp_error,
    *s_release_failed, *s_release_message, *s_alloc_py, *s_send_py, *s_recv_py;

typedef struct {
    PyObject_HEAD
    int open;
    struct ibv_qp *qp;
    struct ibv_cq *scq, *rcq;
    PyObject *qp_obj;               /* pyverbs' QP: alive as long as we hold its pointer */
    /* our receive buffers (pre-posted receives; message views are slices of rb_mem) */
    uint64_t rb_addr, rb_stride;
    uint32_t rb_size, rb_lkey, nrecv;
    PyObject *rb_mem;
    long long recv_max, recv_nslots;
    /* our send pool: alloc pops its free list as BufferPool.try_alloc does */
    PyObject *pool, *free, *in_use, *slots;
    uint64_t sp_addr, sp_stride, room;
    uint32_t sp_lkey;
    long long max_message, peer_small, max_inline, sq_depth, sig_every, flush_at, ack_at;
    long long peer_nslots, peer_nctrl;
    int peer_fast;                  /* the peer reads fast SENDs (framing.CAP_RDMA_FAST) */
    double spin;
    PyObject *inbox, *inflight, *owed_slots, *tx_slots;
    /* large messages: the peer's slots we WRITE into (tx_slots free, tx_free a flag each) and
     * our receive slots it WRITEs into (rp_*: recv_pool's memory, free list and flags) */
    PyObject *tx_free, *rp_mem, *rp_free, *rp_in_use;
    uint64_t raddr, rstride, rp_addr, rp_stride, rp_size;
    uint32_t rkey;
    /* counters shared with rdma_conn.py (see rdma_conn.Counters) */
    long long tx_credits, ctrl_budget, sq_used, unsig, wr_seq, owed_credits, owed_acks, unreturned;
    long long inline_sends;
    int skip_spin;
    /* messages through this path, folded into ConnectionStats by rdma_conn.py */
    unsigned long long msgs_in, bytes_in, msgs_out, bytes_out;
} Link;

static PyTypeObject LinkType;

/* ---------------------------------------------------------------- finding pyverbs' pointers */
static int
safe_read(const void *addr, void *out, size_t n)
{
    struct iovec local = {out, n}, remote = {(void *)addr, n};
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == (ssize_t)n ? 0 : -1;
}

/* does the object hold the word ``p`` (pyverbs keeps its C pointer in a field)? */
static int
holds(PyObject *obj, const void *p)
{
    Py_ssize_t size = Py_TYPE(obj)->tp_basicsize;
    for (Py_ssize_t off = sizeof(PyObject); off + (Py_ssize_t)sizeof(void *) <= size; off += sizeof(void *)) {
        void *w;
        memcpy(&w, (char *)obj + off, sizeof w);
        if (w == p)
            return 1;
    }
    return 0;
}

/* The struct ibv_qp * inside pyverbs' QP object: the word that points at a QP with our QP
 * number, RC, whose CQs are the pyverbs CQ objects' and share its context, whose context
 * has the ops we call. Every candidate is read with process_vm_readv, so a wrong guess is
 * EFAULT, never a fault; NULL (the Python path is used) if none fits. */
static struct ibv_qp *
find_qp(PyObject *qp_obj, uint32_t qpn, PyObject *rcq_obj, PyObject *scq_obj)
{
    Py_ssize_t size = Py_TYPE(qp_obj)->tp_basicsize;
    for (Py_ssize_t off = sizeof(PyObject); off + (Py_ssize_t)sizeof(void *) <= size; off += sizeof(void *)) {
        struct ibv_qp *p, q;
        struct ibv_cq rc, sc;
        struct ibv_context ctx;
        memcpy(&p, (char *)qp_obj + off, sizeof p);
        if (p == NULL || safe_read(p, &q, sizeof q) < 0)
            continue;
        if (q.qp_num != qpn || q.qp_type != IBV_QPT_RC || q.context == NULL || q.send_cq == NULL
            || q.recv_cq == NULL || q.send_cq == q.recv_cq)
            continue;
        if (safe_read(q.recv_cq, &rc, sizeof rc) < 0 || safe_read(q.send_cq, &sc, sizeof sc) < 0
            || safe_read(q.context, &ctx, sizeof ctx) < 0)
            continue;
        if (rc.context != q.context || sc.context != q.context || ctx.ops.post_send == NULL
            || ctx.ops.post_recv == NULL || ctx.ops.poll_cq == NULL)
            continue;
        if (!holds(rcq_obj, q.recv_cq) || !holds(scq_obj, q.send_cq))
            continue;
        return p;
    }
    return NULL;
}

/* ---------------------------------------------------------------- the Link */
static void
release_all(Link *self)
{
    self->open = 0;
    self->qp = NULL;
    self->scq = self->rcq = NULL;
    Py_CLEAR(self->qp_obj);
    Py_CLEAR(self->rb_mem);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->free);
    Py_CLEAR(self->in_use);
    Py_CLEAR(self->slots);
    Py_CLEAR(self->inbox);
    Py_CLEAR(self->inflight);
    Py_CLEAR(self->owed_slots);
    Py_CLEAR(self->tx_slots);
    Py_CLEAR(self->tx_free);
    Py_CLEAR(self->rp_mem);
    Py_CLEAR(self->rp_free);
    Py_CLEAR(self->rp_in_use);
}

static void
Link_dealloc(Link *self)
{
    release_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Link_init(Link *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"qp", "qpn", "recv_cq", "send_cq", "rb_addr", "rb_stride", "rb_size", "rb_lkey",
                             "nrecv", "rb_mem", "recv_max", "recv_nslots", "pool", "free", "in_use", "slots",
                             "sp_addr", "sp_stride", "room", "sp_lkey", "max_message", "peer_small",
                             "max_inline", "sq_depth", "sig_every", "flush_at", "ack_at", "peer_nslots",
                             "peer_nctrl", "peer_fast", "spin", "inbox", "inflight", "owed_slots", "tx_slots",
                             "tx_free", "raddr", "rkey", "rstride", "rp_mem", "rp_addr", "rp_stride", "rp_size",
                             "rp_free", "rp_in_use", NULL};
    PyObject *qp_obj, *rcq_obj, *scq_obj, *rb_mem, *pool, *free, *in_use, *slots, *inbox, *inflight, *owed,
        *tx_slots, *tx_free, *rp_mem, *rp_free, *rp_in_use;
    unsigned long long raddr, rstride, rp_addr, rp_stride, rp_size;
    unsigned int rkey;
    unsigned int qpn, rb_size, rb_lkey, nrecv, sp_lkey;
    unsigned long long rb_addr, rb_stride, sp_addr, sp_stride, room;
    long long recv_max, recv_nslots, max_message, peer_small, max_inline, sq_depth, sig_every, flush_at, ack_at,
        peer_nslots, peer_nctrl;
    int peer_fast;
    double spin;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OIOOKKIIIOLLOOO!O!KKKILLLLLLLLLpdOOO!OO!KIKOKKKOO!", kwlist, &qp_obj, &qpn,
                                     &rcq_obj, &scq_obj, &rb_addr, &rb_stride, &rb_size, &rb_lkey, &nrecv,
                                     &rb_mem, &recv_max, &recv_nslots, &pool, &free, &PyList_Type, &in_use,
                                     &PyList_Type, &slots, &sp_addr, &sp_stride, &room, &sp_lkey, &max_message,
                                     &peer_small, &max_inline, &sq_depth, &sig_every, &flush_at, &ack_at,
                                     &peer_nslots, &peer_nctrl, &peer_fast, &spin, &inbox, &inflight,
                                     &PyList_Type, &owed, &tx_slots, &PyByteArray_Type, &tx_free, &raddr, &rkey,
                                     &rstride, &rp_mem, &rp_addr, &rp_stride, &rp_size, &rp_free, &PyList_Type,
                                     &rp_in_use))
        return -1;
    struct ibv_qp *qp = find_qp(qp_obj, qpn, rcq_obj, scq_obj);
    if (qp == NULL) {
        PyErr_SetString(PyExc_LookupError, "pyverbs' QP object holds no QP pointer this module recognises");
        return -1;
    }
    release_all(self);
    self->qp = qp;
    self->rcq = qp->recv_cq;
    self->scq = qp->send_cq;
#define KEEP(f, v) (Py_INCREF(v), self->f = (v))
    KEEP(qp_obj, qp_obj);
    KEEP(rb_mem, rb_mem);
    KEEP(pool, pool);
    KEEP(free, free);
    KEEP(in_use, in_use);
    KEEP(slots, slots);
    KEEP(inbox, inbox);
    KEEP(inflight, inflight);
    KEEP(owed_slots, owed);
    KEEP(tx_slots, tx_slots);
    KEEP(tx_free, tx_free);
    KEEP(rp_mem, rp_mem);
    KEEP(rp_free, rp_free);
    KEEP(rp_in_use, rp_in_use);
#undef KEEP
    self->raddr = raddr, self->rkey = rkey, self->rstride = rstride;
    self->rp_addr = rp_addr, self->rp_stride = rp_stride, self->rp_size = rp_size;
    self->rb_addr = rb_addr, self->rb_stride = rb_stride, self->rb_size = rb_size, self->rb_lkey = rb_lkey;
    self->nrecv = nrecv, self->recv_max = recv_max, self->recv_nslots = recv_nslots;
    self->sp_addr = sp_addr, self->sp_stride = sp_stride, self->room = room, self->sp_lkey = sp_lkey;
    self->max_message = max_message, self->peer_small = peer_small, self->max_inline = max_inline;
    self->sq_depth = sq_depth, self->sig_every = sig_every, self->flush_at = flush_at, self->ack_at = ack_at;
    self->peer_nslots = peer_nslots, self->peer_nctrl = peer_nctrl, self->peer_fast = peer_fast;
    self->spin = spin;
    self->open = 1;
    return 0;
}

PyDoc_STRVAR(close_doc, "close()\n--\n\nForget the QP (before pyverbs destroys it): every later call "
             "declines, the counters stay readable.");

static PyObject *
Link_close(Link *self, PyObject *unused)
{
    release_all(self);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- helpers */
static double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int
call0(PyObject *obj, PyObject *name)
{
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* after a call that made progress: a connection whose fd is used keeps it quiet */
static int
quiesce_if_fd_used(PyObject *conn)
{
    PyObject *v = PyObject_GetAttr(conn, s_fd_used);
    if (v == NULL)
        return -1;
    int used = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (used < 0)
        return -1;
    return used ? call0(conn, s_quiesce) : 0;
}

/* a send slot the transport is done with, back to the pool (Slot.release) */
static int
put_slot(Link *self, PyObject *s)
{
    if (Py_TYPE(s) == fp.slot_type) {
        PyObject *p = PyMember_GetOne((char *)s, fp.pool), *ix = p ? PyMember_GetOne((char *)s, fp.index) : NULL;
        Py_ssize_t i = ix ? PyLong_AsSsize_t(ix) : -1;
        Py_XDECREF(p);
        Py_XDECREF(ix);
        if (PyErr_Occurred())
            return -1;
        if (p == self->pool && i >= 0 && i < PyList_GET_SIZE(self->in_use)
            && PyList_GET_ITEM(self->in_use, i) == Py_True) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (idx == NULL)
                return -1;
            PyObject *r = PyObject_CallMethodOneArg(self->free, fp.s_append, idx);
            Py_DECREF(idx);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
            Py_INCREF(Py_False);
            PyList_SetItem(self->in_use, i, Py_False);
            return 0;
        }
    }
    return call0(s, fp.s_release);  /* anything else: its own release says what is wrong */
}

/* ---------------------------------------------------------------- sending */
/* Post the fast SEND for a one-slot message; 0 sent, 1 declined (nothing posted, nothing
 * changed), -1 error. */
static int
send_fast(Link *self, PyObject *conn, PyObject *header, PyObject *buffers)
{
    PyObject *b;
    if (!self->open || !self->peer_fast || fp.slot_type == NULL)
        return 1;
    if (PyList_CheckExact(buffers) && PyList_GET_SIZE(buffers) == 1)
        b = PyList_GET_ITEM(buffers, 0);
    else if (PyTuple_CheckExact(buffers) && PyTuple_GET_SIZE(buffers) == 1)
        b = PyTuple_GET_ITEM(buffers, 0);
    else
        return 1;
    if (Py_TYPE(b) != fp.slot_type)
        return 1;
    if (self->tx_credits <= 0 || self->sq_used + 1 > self->sq_depth || PyList_GET_SIZE(self->owed_slots) > 1
        || self->owed_credits > 0xFFFF || self->owed_acks > 0xFFFF)
        return 1;  /* more than one slot to return: a DATA frame carries them */
    long long owed = -1;
    if (PyList_GET_SIZE(self->owed_slots)) {
        owed = PyLong_AsLongLong(PyList_GET_ITEM(self->owed_slots, 0));
        if (owed < 0 || owed >= 0xFFFF) {
            PyErr_Clear();
            return 1;
        }
    }
    PyObject *bpool = PyMember_GetOne((char *)b, fp.pool);
    if (bpool == NULL)
        return -1;
    Py_DECREF(bpool);
    if (bpool != self->pool)
        return 1;
    int open = fp_conn_open(&fp, conn);
    if (open <= 0)
        return open < 0 ? -1 : 1;
    PyObject *raw = NULL;
    char *user = NULL;
    Py_ssize_t ulen = 0;
    if (!(PyDict_CheckExact(header) && PyDict_GET_SIZE(header) == 0)) {
        raw = PyObject_CallOneArg(packer, header);
        if (raw == NULL || PyBytes_AsStringAndSize(raw, &user, &ulen) < 0) {
            Py_XDECREF(raw);
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyErr_Clear();  /* not serialisable: the Python path raises TypeError */
            return 1;
        }
    }
    int rc = 1;
    PyObject *index = PyMember_GetOne((char *)b, fp.index), *nb = index ? PyMember_GetOne((char *)b, fp.nbytes) : NULL;
    long long i = index ? PyLong_AsLongLong(index) : -1, n = nb ? PyLong_AsLongLong(nb) : -1;
    Py_XDECREF(index);
    Py_XDECREF(nb);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto out;
    }
    uint64_t off = ((uint64_t)FAST_SIZE + ulen + FAST_ALIGN - 1) & ~(uint64_t)(FAST_ALIGN - 1);
    if (ulen > max_user || i < 0 || i >= PyList_GET_SIZE(self->slots) || n < 0 || n > self->max_message
        || off > self->room)
        goto out;  /* a big header: the Python path */
    /* a frame larger than the peer's receive buffers goes by WRITE WITH IMMEDIATE into one
     * of its slots (the immediate names it; as many slots as credits, so one is free) */
    int large = (long long)off + n > self->peer_small;
    Py_ssize_t nfree = PyObject_Size(self->free), nslot = large ? PyObject_Size(self->tx_slots) : 0;
    if (nfree < 0 || nslot < 0) {
        rc = -1;
        goto out;
    }
    if (large && nslot == 0)
        goto out;
    int inl = !large && self->max_inline > 0 && (long long)off + n <= self->max_inline;
    PyObject *held = inl ? PyTuple_New(0) : PyList_New(1);
    PyObject *wid = PyLong_FromLongLong(self->wr_seq + 1), *rec = PyList_New(4);
    if (held == NULL || wid == NULL || rec == NULL) {
        Py_XDECREF(held);
        Py_XDECREF(wid);
        Py_XDECREF(rec);
        rc = -1;
        goto out;
    }
    if (!inl)
        PyList_SET_ITEM(held, 0, Py_NewRef(b));
    PyList_SET_ITEM(rec, 0, wid);
    PyList_SET_ITEM(rec, 1, PyLong_FromLong(1));
    PyList_SET_ITEM(rec, 2, held);
    PyList_SET_ITEM(rec, 3, Py_NewRef(Py_None));
    unsigned char *p = (unsigned char *)(uintptr_t)(self->sp_addr + (uint64_t)i * self->sp_stride + self->room - off);
    uint32_t head[2] = {tag_fast, (uint32_t)n};
    uint16_t counts[4] = {(uint16_t)self->owed_credits, (uint16_t)self->owed_acks, (uint16_t)ulen,
                          (uint16_t)(owed + 1)};
    memcpy(p, head, 8);
    memcpy(p + 8, counts, 8);
    if (ulen)
        memcpy(p + FAST_SIZE, user, (size_t)ulen);
    int sig = self->unsig + 1 >= self->sig_every || nfree <= self->sig_every;
    struct ibv_sge sge = {(uintptr_t)p, (uint32_t)(off + n), self->sp_lkey};
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = (uint64_t)(self->wr_seq + 1);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = (sig ? IBV_SEND_SIGNALED : 0) | (inl ? IBV_SEND_INLINE : 0);
    long long ps = -1;  /* the peer's slot */
    if (large) {
        PyObject *o = PyObject_CallMethodNoArgs(self->tx_slots, s_popleft);
        ps = o ? PyLong_AsLongLong(o) : -1;
        Py_XDECREF(o);
        if (ps < 0 || ps >= PyByteArray_GET_SIZE(self->tx_free) || ps >= self->peer_nslots) {
            Py_DECREF(rec);
            rc = PyErr_Occurred() ? -1 : 1;  /* not a slot list we understand: the Python path */
            goto out;
        }
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl((uint32_t)ps);
        wr.wr.rdma.remote_addr = self->raddr + (uint64_t)ps * self->rstride;
        wr.wr.rdma.rkey = self->rkey;
    }
    if (ibv_post_send(self->qp, &wr, &bad)) {  /* the Python path posts again and says why */
        Py_DECREF(rec);
        if (large) {
            PyObject *o = PyObject_CallMethod(self->tx_slots, "appendleft", "L", ps);  /* as it was */
            if (o == NULL)
                rc = -1;
            Py_XDECREF(o);
        }
        goto out;
    }
    if (large)
        PyByteArray_AS_STRING(self->tx_free)[ps] = 0;
    rc = 0;
    self->wr_seq += 1;
    self->tx_credits -= 1;
    self->unreturned -= self->owed_credits;
    self->owed_credits = self->owed_acks = 0;
    if (owed >= 0 && PyList_SetSlice(self->owed_slots, 0, PyList_GET_SIZE(self->owed_slots), NULL) < 0)
        rc = -1;
    self->sq_used += 1;
    self->unsig = sig ? 0 : self->unsig + 1;
    self->msgs_out += 1;
    self->bytes_out += (unsigned long long)n;
    PyObject *r = PyObject_CallMethodOneArg(self->inflight, fp.s_append, rec);
    Py_DECREF(rec);
    if (r == NULL)
        rc = -1;
    Py_XDECREF(r);
    if (rc == 0 && inl) {  /* its bytes are in the work request: the slot is ours again */
        self->inline_sends += 1;
        if (put_slot(self, b) < 0)
            rc = -1;
    }
out:
    Py_XDECREF(raw);
    return rc;
}

/* post receive buffer ``i`` again; 0 or the verbs error */
static int
repost(Link *self, uint64_t i)
{
    struct ibv_sge sge = {(uintptr_t)(self->rb_addr + i * self->rb_stride), self->rb_size, self->rb_lkey};
    struct ibv_recv_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return ibv_post_recv(self->qp, &wr, &bad);
}

/* ---------------------------------------------------------------- receiving */
typedef struct {
    uint32_t nbytes;
    uint16_t credits, acks, ulen, slot;  /* slot: a returned slot + 1, or 0 */
    uint64_t off;  /* the payload's offset */
} FastHead;

/* The ``len`` bytes at ``b`` are a well-formed fast SEND head (framing.parse_rdma_fast's
 * checks, bar the user header's msgpack; ``exact`` 0: a slot of ``len`` bytes it must fit,
 * parse_rdma_fast_slot's): 1 and ``h`` filled, else 0. */
static int
parse_head(const unsigned char *b, uint64_t len, long long max_payload, int exact, FastHead *h)
{
    if (len < FAST_SIZE)
        return 0;
    uint32_t tag;
    memcpy(&tag, b, 4);
    memcpy(&h->nbytes, b + 4, 4);
    memcpy(&h->credits, b + 8, 2);
    memcpy(&h->acks, b + 10, 2);
    memcpy(&h->ulen, b + 12, 2);
    memcpy(&h->slot, b + 14, 2);
    if (tag != tag_fast || h->ulen > max_user)
        return 0;
    h->off = ((uint64_t)FAST_SIZE + h->ulen + FAST_ALIGN - 1) & ~(uint64_t)(FAST_ALIGN - 1);
    return (long long)h->nbytes <= max_payload && (exact ? h->off + h->nbytes == len : h->off + h->nbytes <= len);
}

/* the user header of a parsed head: {} for none; NULL with no error set if undecodable */
static PyObject *
user_of(const unsigned char *b, const FastHead *h)
{
    if (h->ulen == 0)
        return PyDict_New();
    PyObject *raw = PyBytes_FromStringAndSize((const char *)b + FAST_SIZE, h->ulen);
    if (raw == NULL)
        return NULL;
    PyObject *user = PyObject_CallOneArg(unpack, raw);
    Py_DECREF(raw);
    if (user == NULL && PyErr_ExceptionMatches(PyExc_Exception))
        PyErr_Clear();  /* garbage: parse_rdma_fast raises the ProtocolError */
    return user;
}

PyDoc_STRVAR(parse_doc, "parse(buf, length, max_payload, slot=False)\n--\n\nWhat the receive path makes of "
             "a SEND of ``length`` bytes at the start of ``buf`` (``slot``: a WRITE WITH IMMEDIATE into a "
             "slot of ``length`` bytes): ``(user, [credits, acks, [slot...]], payload_start, nbytes)`` if it takes it "
             "as a fast SEND, None if it leaves it to the Python path (tests compare it with "
             "framing.parse_rdma_fast and parse_rdma_fast_slot).");

static PyObject *
parse(PyObject *mod, PyObject *args)
{
    Py_buffer buf;
    unsigned long long length;
    long long max_payload;
    int slot = 0;
    if (!PyArg_ParseTuple(args, "y*KL|p", &buf, &length, &max_payload, &slot))
        return NULL;
    FastHead h;
    PyObject *r = NULL;
    if (length > (unsigned long long)buf.len || !parse_head(buf.buf, length, max_payload, !slot, &h)) {
        r = Py_NewRef(Py_None);
    } else {
        PyObject *user = user_of(buf.buf, &h);
        if (user != NULL)
            r = h.slot ? Py_BuildValue("(N[II[I]]KI)", user, (unsigned)h.credits, (unsigned)h.acks, h.slot - 1u,
                                       (unsigned long long)h.off, (unsigned)h.nbytes)
                       : Py_BuildValue("(N[II[]]KI)", user, (unsigned)h.credits, (unsigned)h.acks,
                                       (unsigned long long)h.off, (unsigned)h.nbytes);
        else if (!PyErr_Occurred())
            r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&buf);
    return r;
}

/* Take one receive completion if it is a well-formed fast SEND (into a receive buffer) or
 * fast WRITE WITH IMMEDIATE (into a free receive slot) whose credits the peer may return: 1
 * (queued as a message; a slot taken, the receive buffer of a WRITE posted again), 0 (not
 * ours: nothing changed), -1 error. */
static int
take_fast(Link *self, PyObject *conn, const struct ibv_wc *wc)
{
    int large;
    if (wc->status != IBV_WC_SUCCESS || wc->wr_id >= self->nrecv)
        return 0;
    if (wc->opcode == IBV_WC_RECV && !(wc->wc_flags & IBV_WC_WITH_IMM))
        large = 0;
    else if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM)
        large = 1;
    else
        return 0;
    uint64_t s = 0, base;
    PyObject *mem;
    const unsigned char *b;
    FastHead h;
    if (large) {  /* the immediate names the slot: one of ours, and free */
        s = ntohl(wc->imm_data);
        if ((long long)s >= self->recv_nslots || (Py_ssize_t)s >= PyList_GET_SIZE(self->rp_in_use)
            || PyList_GET_ITEM(self->rp_in_use, s) != Py_False)
            return 0;
        base = s * self->rp_stride, mem = self->rp_mem;
        b = (const unsigned char *)(uintptr_t)(self->rp_addr + base);
        if (!parse_head(b, self->rp_size, self->recv_max, 0, &h))
            return 0;
    } else {
        if (wc->byte_len > self->rb_size)
            return 0;
        base = wc->wr_id * self->rb_stride, mem = self->rb_mem;
        b = (const unsigned char *)(uintptr_t)(self->rb_addr + base);
        if (!parse_head(b, wc->byte_len, self->recv_max, 1, &h))
            return 0;
    }
    Py_ssize_t nfree = PyObject_Size(self->tx_slots);
    if (nfree < 0)
        return -1;
    long long ret = (long long)h.slot - 1;  /* a slot of the peer's it returns, or -1 */
    if (ret >= 0 && (ret >= self->peer_nslots || ret >= PyByteArray_GET_SIZE(self->tx_free)
                     || PyByteArray_AS_STRING(self->tx_free)[ret]))
        return 0;  /* a slot we do not hold: _apply raises the ProtocolError */
    if (self->tx_credits + h.credits > self->peer_nslots || self->ctrl_budget + h.acks > self->peer_nctrl
        || nfree + (ret >= 0) < self->tx_credits + h.credits)
        return 0;  /* more than the peer was given: _apply raises the ProtocolError */
    PyObject *user = user_of(b, &h);
    if (user == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *view = fp_slice(mem, base + h.off, base + h.off + h.nbytes);
    PyObject *tok = view ? (large ? PyLong_FromLongLong(-1 - (long long)s) : PyLong_FromUnsignedLongLong(wc->wr_id))
                         : NULL;
    PyObject *msg = tok ? fp_message(&fp, user, view, conn, tok) : NULL;
    Py_DECREF(user);
    Py_XDECREF(view);
    Py_XDECREF(tok);
    if (msg == NULL)
        return -1;
    if (large) {  /* recv_pool.take(s), and the receive the WRITE consumed posted again */
        PyObject *r = PyObject_CallMethod(self->rp_free, "remove", "K", (unsigned long long)s);
        if (r == NULL) {
            Py_DECREF(msg);
            if (!PyErr_ExceptionMatches(PyExc_ValueError))
                return -1;
            PyErr_Clear();
            return 0;
        }
        Py_DECREF(r);
        PyList_SetItem(self->rp_in_use, s, Py_NewRef(Py_True));
        if (repost(self, wc->wr_id)) {
            r = PyObject_CallMethod(conn, "_fail", "s", "re-posting a receive failed");
            if (r == NULL) {
                Py_DECREF(msg);
                return -1;
            }
            Py_DECREF(r);
        }
    }
    PyObject *r = PyObject_CallMethodOneArg(self->inbox, fp.s_append, msg);
    Py_DECREF(msg);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    if (ret >= 0) {  /* the peer's slot is ours to WRITE into again */
        r = PyObject_CallMethod(self->tx_slots, "append", "L", ret);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        PyByteArray_AS_STRING(self->tx_free)[ret] = 1;
    }
    self->tx_credits += h.credits;
    self->ctrl_budget += h.acks;
    self->unreturned += 1;
    self->msgs_in += 1;
    self->bytes_in += h.nbytes;
    return 1;
}

/* Process polled receive completions in order: fast SENDs here, the first other one and
 * everything after it by conn._on_completions (which also flushes owed credits); -1 error. */
static int
process_recv(Link *self, PyObject *conn, const struct ibv_wc *wc, int n)
{
    int k = 0;
    for (; k < n; k++) {
        int r = take_fast(self, conn, &wc[k]);
        if (r < 0)
            return -1;
        if (r == 0)
            break;
    }
    if (k < n) {
        PyObject *rest = PyList_New(n - k);
        if (rest == NULL)
            return -1;
        for (int j = k; j < n; j++) {
            const struct ibv_wc *w = &wc[j];
            PyObject *t = Py_BuildValue("(KiiiII)", (unsigned long long)w->wr_id, (int)w->status, (int)w->opcode,
                                        (int)w->wc_flags, (unsigned int)w->byte_len, (unsigned int)w->imm_data);
            if (t == NULL) {
                Py_DECREF(rest);
                return -1;
            }
            PyList_SET_ITEM(rest, j - k, t);
        }
        PyObject *r = PyObject_CallMethodOneArg(conn, s_on_completions, rest);
        Py_DECREF(rest);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if (self->owed_acks >= self->ack_at || self->owed_credits >= self->flush_at)
        return call0(conn, s_flush);
    return 0;
}

/* one poll of the receive CQ, processed; the number of completions or -1 */
static int
poll_recv(Link *self, PyObject *conn)
{
    struct ibv_wc wc[NPOLL];
    int n = ibv_poll_cq(self->rcq, NPOLL, wc);
    if (n <= 0)
        return 0;  /* none, or a polling error: that surfaces as the QP's, through the Python path */
    return process_recv(self, conn, wc, n) < 0 ? -1 : n;
}

PyDoc_STRVAR(poll_doc, "poll(conn)\n--\n\nrdma_conn's _poll_recv: one poll of the receive CQ; fast "
             "SENDs become messages in the inbox here, anything else goes to conn._on_completions in "
             "order. The number of completions.");

static PyObject *
Link_poll(Link *self, PyObject *conn)
{
    if (!self->open)
        return PyLong_FromLong(0);
    int n = poll_recv(self, conn);
    return n < 0 ? NULL : PyLong_FromLong(n);
}

/* one poll of the send CQ: in-flight records retired as rdma_conn's _poll_send does */
static int
poll_send(Link *self, PyObject *conn)
{
    struct ibv_wc wc[NPOLL];
    int n = ibv_poll_cq(self->scq, NPOLL, wc);
    if (n <= 0)
        return 0;
    for (int k = 0; k < n; k++) {
        if (wc[k].status != IBV_WC_SUCCESS) {
            PyObject *r = PyObject_CallMethod(conn, "_send_failed", "i", (int)wc[k].status);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
        while (PyObject_Size(self->inflight) > 0) {
            PyObject *rec = PyObject_CallMethodNoArgs(self->inflight, s_popleft);
            if (rec == NULL)
                return -1;
            if (!PyList_Check(rec) || PyList_GET_SIZE(rec) != 4) {
                Py_DECREF(rec);
                PyErr_SetString(PyExc_RuntimeError, "an in-flight record is not [wr_id, nwr, slots, hdr]");
                return -1;
            }
            long long wid = PyLong_AsLongLong(PyList_GET_ITEM(rec, 0));
            self->sq_used -= PyLong_AsLongLong(PyList_GET_ITEM(rec, 1));
            PyObject *held = PyList_GET_ITEM(rec, 2), *hdr = PyList_GET_ITEM(rec, 3);
            PyObject *it = PyObject_GetIter(held), *s;
            int bad = it == NULL;
            while (!bad && (s = PyIter_Next(it)) != NULL) {
                bad = put_slot(self, s) < 0;
                Py_DECREF(s);
            }
            Py_XDECREF(it);
            if (!bad && PyErr_Occurred())
                bad = 1;
            if (!bad && hdr != Py_None)
                bad = call0(hdr, fp.s_release) < 0;
            Py_DECREF(rec);
            if (bad)
                return -1;
            if ((unsigned long long)wid == wc[k].wr_id)
                break;
        }
    }
    return n;
}

PyDoc_STRVAR(poll_send_doc, "poll_send(conn)\n--\n\nrdma_conn's _poll_send without its drain after a "
             "QP error: one poll of the send CQ, the in-flight records up to each completion retired "
             "(slots back to the pool); a failed one reported to conn._send_failed(status). The number "
             "of completions.");

static PyObject *
Link_poll_send(Link *self, PyObject *conn)
{
    if (!self->open)
        return PyLong_FromLong(0);
    int n = poll_send(self, conn);
    return n < 0 ? NULL : PyLong_FromLong(n);
}

/* ---------------------------------------------------------------- release */

static int owe_credit(Link *self, PyObject *conn);

/* rdma_conn's _release for a message whose connection has an open Link: ``tok`` >= 0 is a
 * receive buffer (posted again), -1 - slot a receive slot (freed, owed to the peer) */
static int
release_token(Link *self, PyObject *conn, PyObject *tok)
{
    long long t = PyLong_AsLongLong(tok);
    if (t == -1 && PyErr_Occurred())
        return -1;
    PyObject *err = PyObject_GetAttr(conn, s_qp_error);
    if (err == NULL)
        return -1;
    int failed = err != Py_None;
    Py_DECREF(err);
    if (failed || t >= (long long)self->nrecv)
        return 0;
    if (t < 0) {  /* a slot: free again, and owed to the peer */
        Py_ssize_t s = (Py_ssize_t)(-1 - t);
        if (s >= PyList_GET_SIZE(self->rp_in_use) || PyList_GET_ITEM(self->rp_in_use, s) != Py_True) {
            PyObject *r = PyObject_CallMethodOneArg(conn, s_release_message, tok);  /* it says what is wrong */
            Py_XDECREF(r);
            return r == NULL ? -1 : 0;
        }
        PyObject *idx = PyLong_FromSsize_t(s);
        PyObject *a = idx ? PyObject_CallMethodOneArg(self->rp_free, fp.s_append, idx) : NULL;
        PyObject *b = a ? PyObject_CallMethodOneArg(self->owed_slots, fp.s_append, idx) : NULL;
        Py_XDECREF(idx);
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (b == NULL)
            return -1;
        PyList_SetItem(self->rp_in_use, s, Py_NewRef(Py_False));
        return owe_credit(self, conn);
    }
    int e = repost(self, (uint64_t)t);
    if (e) {
        PyObject *r = PyObject_CallMethod(conn, "_fail", "s", e == ENOMEM ? "re-posting a receive failed: queue full"
                                                                         : "re-posting a receive failed");
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    return owe_credit(self, conn);
}

/* a released message's credit, returned at once if enough are owed or the peer may be out */
static int
owe_credit(Link *self, PyObject *conn)
{
    self->owed_credits += 1;
    if (self->owed_credits >= self->flush_at || self->unreturned >= self->recv_nslots) {
        PyObject *r = PyObject_CallMethod(conn, "_flush", "O", Py_True);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    return 0;
}

/* Message.release for messages this module made: the views released, the receive posted
 * again and the credit owed (rdma_conn's _release), or conn._release_message(token) when the
 * connection no longer has a Link. A TransportError goes to conn._release_failed, as in
 * transport/base.py. */
static PyObject *
message_release(PyObject *msg, PyObject *unused)
{
    PyObject *conn, *tok;
    int done = fp_unhook(&fp, msg, &conn, &tok);
    if (done)
        return done < 0 ? NULL : Py_NewRef(Py_None);
    int rc = 0;
    if (conn != Py_None) {
        PyObject *state = PyObject_GetAttr(conn, fp.s_state), *link = state ? PyObject_GetAttr(conn, s_link) : NULL;
        long st_ = state ? PyLong_AsLong(state) : -1;
        if (link == NULL || PyErr_Occurred()) {
            rc = -1;
        } else if (PyObject_TypeCheck(link, &LinkType) && ((Link *)link)->open) {
            if (st_ < broken_state)
                rc = release_token((Link *)link, conn, tok);
        } else {
            PyObject *r = PyObject_CallMethodOneArg(conn, s_release_message, tok);
            Py_XDECREF(r);
            rc = r == NULL ? -1 : 0;
        }
        Py_XDECREF(state);
        Py_XDECREF(link);
        if (rc < 0 && PyErr_ExceptionMatches(transport_error)) {
            PyObject *et, *ev, *etb;
            PyErr_Fetch(&et, &ev, &etb);
            PyErr_NormalizeException(&et, &ev, &etb);
            PyObject *r = ev ? PyObject_CallMethodOneArg(conn, s_release_failed, ev) : NULL;
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(etb);
            Py_XDECREF(r);
            rc = r == NULL ? -1 : 0;
        }
    }
    Py_DECREF(conn);
    Py_DECREF(tok);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef release_def = {"release", message_release, METH_NOARGS,
                                  "Hand the buffers back and post the receive again (the credit)."};

/* ---------------------------------------------------------------- the type */
static PyMethodDef Link_methods[] = {
    {"poll", (PyCFunction)Link_poll, METH_O, poll_doc},
    {"poll_send", (PyCFunction)Link_poll_send, METH_O, poll_send_doc},
    {"close", (PyCFunction)Link_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyMemberDef Link_members[] = {
    {"tx_credits", T_LONGLONG, offsetof(Link, tx_credits), 0, "messages we may send (the peer's receives)"},
    {"ctrl_budget", T_LONGLONG, offsetof(Link, ctrl_budget), 0, "credit messages we may send"},
    {"sq_used", T_LONGLONG, offsetof(Link, sq_used), 0, "send queue entries not completed"},
    {"unsig", T_LONGLONG, offsetof(Link, unsig), 0, "sends posted since the last signaled one"},
    {"wr_seq", T_LONGLONG, offsetof(Link, wr_seq), 0, "the last work request id"},
    {"owed_credits", T_LONGLONG, offsetof(Link, owed_credits), 0, "credits released, not returned yet"},
    {"owed_acks", T_LONGLONG, offsetof(Link, owed_acks), 0, "credit messages not acknowledged yet"},
    {"unreturned", T_LONGLONG, offsetof(Link, unreturned), 0, "messages received whose credit is not back"},
    {"inline_sends", T_LONGLONG, offsetof(Link, inline_sends), 0, "messages sent inline"},
    {"skip_spin", T_INT, offsetof(Link, skip_spin), 0, "the next wait skips its spin (recv spun already)"},
    {"msgs_in", T_ULONGLONG, offsetof(Link, msgs_in), 0, "messages received here, not yet in stats"},
    {"bytes_in", T_ULONGLONG, offsetof(Link, bytes_in), 0, "their payload bytes"},
    {"msgs_out", T_ULONGLONG, offsetof(Link, msgs_out), 0, "messages sent here, not yet in stats"},
    {"bytes_out", T_ULONGLONG, offsetof(Link, bytes_out), 0, "their payload bytes"},
    {"open", T_INT, offsetof(Link, open), READONLY, "1 until close()"},
    {NULL},
};

static PyTypeObject LinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "transport._rdmafast.Link",
    .tp_doc = "One rdma:// connection's QP and CQs (pyverbs'), its buffers and the counters both paths use.",
    .tp_basicsize = sizeof(Link),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Link_init,
    .tp_dealloc = (destructor)Link_dealloc,
    .tp_methods = Link_methods,
    .tp_members = Link_members,
};

/* ---------------------------------------------------------------- connection methods */
/* RdmaConnection's alloc, send and recv where this module is built: the Link first, and
 * whatever it declines -- or any call with keywords -- goes to the Python method of the same
 * name with "_py" (RdmaConnection._alloc_py...), which owns the waiting and the errors. */
static Link *
link_of(PyObject *conn)
{
    return (Link *)fp_link_of(conn, s_link, &LinkType);
}

/* the last freed slot of the send pool sized to nbytes; Py_None when the Python path must */
static PyObject *
pop_slot(Link *self, PyObject *conn, PyObject *nbytes_obj)
{
    if (!PyLong_CheckExact(nbytes_obj))
        Py_RETURN_NONE;
    long long nbytes = PyLong_AsLongLong(nbytes_obj);
    if (nbytes == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (nbytes < 0 || nbytes > self->max_message)
        Py_RETURN_NONE;
    int open = fp_conn_open(&fp, conn);
    if (open <= 0) {
        if (open < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (self->sq_used > 0) {  /* slots come back as send completions */
        Py_ssize_t n = PyObject_Size(self->free);
        if (n < 0 || (n == 0 && poll_send(self, conn) < 0))
            return NULL;
    }
    return fp_pool_pop(&fp, self->free, self->in_use, self->slots, nbytes_obj);
}

static PyObject *
conn_alloc(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Link *link = kwnames == NULL && n >= 1 && n <= 2 ? link_of(conn) : NULL;
    if (link != NULL) {
        PyObject *slot = pop_slot(link, conn, args[0]);
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
        int r = send_fast(link, conn, args[0], args[1]);
        if (r < 0)
            return NULL;
        if (r == 0) {
            if (quiesce_if_fd_used(conn) < 0)
                return NULL;
            Py_RETURN_NONE;
        }
    }
    return fp_delegate(conn, s_send_py, args, nargsf, kwnames);
}

/* the inbox's first message, or Py_None */
static PyObject *
pop_inbox(Link *self)
{
    Py_ssize_t n = PyObject_Size(self->inbox);
    if (n < 0)
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(self->inbox, s_popleft);
}

static PyObject *
conn_recv(PyObject *conn, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    Link *link = kwnames == NULL && n <= 1 ? link_of(conn) : NULL;
    if (link == NULL)
        return fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
    link->skip_spin = 0;
    PyObject *m = pop_inbox(link);
    if (m != Py_None)
        return m;
    Py_DECREF(m);
    int open = fp_conn_open(&fp, conn);
    if (open < 0)
        return NULL;
    double spin = link->spin;
    if (n == 1 && args[0] != Py_None) {  /* a shorter timeout bounds the spin */
        double t = PyFloat_AsDouble(args[0]);
        if (t == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            t = 0;
        }
        if (t < spin)
            spin = t > 0 ? t : 0;
    }
    if (open && link->sq_used > link->sq_depth / 2) {
        /* retire completed sends before the queue fills (the spin below watches only the
         * receive CQ: a send completion in the middle of it would delay the reply; a dead
         * peer shows in the Python wait that follows a fruitless spin) */
        if (poll_send(link, conn) < 0)
            return NULL;
        if (!link->open || (open = fp_conn_open(&fp, conn)) < 0)
            return link->open ? NULL : fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
    }
    if (open) {
        double end = -1;
        struct ibv_wc wc[NPOLL];
        for (;;) {
            int got = ibv_poll_cq(link->rcq, NPOLL, wc);
            if (got > 0) {
                if (process_recv(link, conn, wc, got) < 0)
                    return NULL;
                if (!link->open)
                    break;
                m = pop_inbox(link);
                if (m != Py_None) {
                    if (m != NULL && quiesce_if_fd_used(conn) < 0)
                        Py_CLEAR(m);
                    return m;
                }
                Py_DECREF(m);
            } else if (got < 0) {
                break;
            }
            if (got > 0 && (open = fp_conn_open(&fp, conn)) <= 0) {
                if (open < 0)
                    return NULL;
                break;
            }
            double t = now();
            if (end < 0)
                end = t + spin;
            if (t >= end)
                break;
        }
        link->skip_spin = spin > 0;  /* spun already: the Python wait sleeps at once */
    }
    return fp_delegate(conn, s_recv_py, args, nargsf, kwnames);
}

FP_CONNECTION_METHODS("RdmaConnection")

PyDoc_STRVAR(bind_doc, "bind(msg_cls, slot_cls, packer, unpack, transport_error, broken, tag, max_user)\n--\n\n"
             "The message class poll makes (a transport.base.Message subclass: its slots are set directly), "
             "the send pool's slot class, the user header's packer and unpacker, the error a release reports "
             "to conn._release_failed, the first connection state in which nothing is posted again, "
             "framing.TAG_RFAST and framing.MAX_FAST_USER; returns the ``release`` method to install on the "
             "message class.");

static PyObject *
bind_classes(PyObject *mod, PyObject *args)
{
    PyObject *cls, *scls, *pack, *unp, *err;
    long broken, maxu;
    unsigned int tag;
    if (!PyArg_ParseTuple(args, "O!O!OOOlIl", &PyType_Type, &cls, &PyType_Type, &scls, &pack, &unp, &err, &broken,
                          &tag, &maxu))
        return NULL;
    if (fp_bind(&fp, cls, scls) < 0)
        return NULL;
    Py_XSETREF(packer, Py_NewRef(pack));
    Py_XSETREF(unpack, Py_NewRef(unp));
    Py_XSETREF(transport_error, Py_NewRef(err));
    broken_state = broken;
    tag_fast = tag;
    max_user = maxu;
    return PyDescr_NewMethod((PyTypeObject *)cls, &release_def);
}

static PyMethodDef module_methods[] = {
    {"connection_methods", connection_methods, METH_O, connection_methods_doc},
    {"bind", bind_classes, METH_VARARGS, bind_doc},
    {"parse", parse, METH_VARARGS, parse_doc},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "transport._rdmafast",
    "rdma://'s compiled fast path for the small fast SEND (transport/rdma_conn.py owns the protocol).",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__rdmafast(void)
{
#define INTERN(v, s) if (!((v) = PyUnicode_InternFromString(s))) return NULL
    INTERN(s_link, "_link");
    INTERN(s_popleft, "popleft");
    INTERN(s_fd_used, "_fd_used");
    INTERN(s_quiesce, "_quiesce");
    INTERN(s_flush, "_flush");
    INTERN(s_on_completions, "_on_completions");
    INTERN(s_qp_error, "_qp_error");
    INTERN(s_release_failed, "_release_failed");
    INTERN(s_release_message, "_release_message");
    INTERN(s_alloc_py, "_alloc_py");
    INTERN(s_send_py, "_send_py");
    INTERN(s_recv_py, "_recv_py");
#undef INTERN
    return fp_module(&module, &LinkType);
}
