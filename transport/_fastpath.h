/* What the compiled fast paths (_shmfast.c, _rdmafast.c) share: the transport.base.Message
 * and transport.pool.Slot members they set directly, the connection state they check, the
 * send pool's free list they pop, a message's release up to the backend's give-back, and
 * the public alloc/send/recv that hand anything they decline to the connection's Python
 * methods (``_alloc_py``...). Each module includes it once: everything is static. */
#ifndef MOE_FASTPATH_H
#define MOE_FASTPATH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyTypeObject *msg_type, *slot_type;
    PyMemberDef *header, *buffers, *released, *conn, *token;  /* Message's slots */
    PyMemberDef *pool, *index, *nbytes;                       /* Slot's */
    PyObject *s_state, *s_release, *s_pop, *s_append;
} FastPath;

static PyMemberDef *
fp_member(PyObject *cls, const char *name)
{
    PyObject *d = PyObject_GetAttrString(cls, name);
    if (d == NULL)
        return NULL;
    if (!Py_IS_TYPE(d, &PyMemberDescr_Type) || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ member", cls, name);
        Py_DECREF(d);
        return NULL;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    Py_DECREF(d);  /* the class keeps the descriptor alive */
    return m;
}

/* the message class (a transport.base.Message subclass) and the send pool's slot class */
static int
fp_bind(FastPath *fp, PyObject *msg_cls, PyObject *slot_cls)
{
    if (!fp->s_state && (!(fp->s_state = PyUnicode_InternFromString("_state"))
                         || !(fp->s_release = PyUnicode_InternFromString("release"))
                         || !(fp->s_pop = PyUnicode_InternFromString("pop"))
                         || !(fp->s_append = PyUnicode_InternFromString("append"))))
        return -1;
    PyMemberDef *sp = fp_member(slot_cls, "pool"), *si = sp ? fp_member(slot_cls, "index") : NULL,
                *sn = si ? fp_member(slot_cls, "nbytes") : NULL;
    PyMemberDef *h = sn ? fp_member(msg_cls, "header") : NULL, *b = h ? fp_member(msg_cls, "buffers") : NULL,
                *r = b ? fp_member(msg_cls, "released") : NULL, *c = r ? fp_member(msg_cls, "_conn") : NULL,
                *t = c ? fp_member(msg_cls, "_token") : NULL;
    if (t == NULL)
        return -1;
    Py_XSETREF(fp->msg_type, (PyTypeObject *)Py_NewRef(msg_cls));
    Py_XSETREF(fp->slot_type, (PyTypeObject *)Py_NewRef(slot_cls));
    fp->pool = sp, fp->index = si, fp->nbytes = sn;
    fp->header = h, fp->buffers = b, fp->released = r, fp->conn = c, fp->token = t;
    return 0;
}

/* conn._state == OPEN (0); -1 with an error set if it cannot be read */
static inline int
fp_conn_open(FastPath *fp, PyObject *conn)
{
    PyObject *v = PyObject_GetAttr(conn, fp->s_state);
    if (v == NULL)
        return -1;
    long st_ = PyLong_AsLong(v);
    Py_DECREF(v);
    if (st_ == -1 && PyErr_Occurred())
        return -1;
    return st_ == 0;
}

/* A message of the bound class, its members set directly (no __init__ runs); steals none. */
static PyObject *
fp_message(FastPath *fp, PyObject *user, PyObject *view, PyObject *conn, PyObject *token)
{
    PyObject *bufs = PyList_New(1);
    if (bufs == NULL)
        return NULL;
    PyList_SET_ITEM(bufs, 0, Py_NewRef(view));
    PyObject *msg = fp->msg_type->tp_alloc(fp->msg_type, 0);
    if (msg == NULL || PyMember_SetOne((char *)msg, fp->header, user) < 0
        || PyMember_SetOne((char *)msg, fp->buffers, bufs) < 0
        || PyMember_SetOne((char *)msg, fp->released, Py_False) < 0
        || PyMember_SetOne((char *)msg, fp->conn, conn) < 0 || PyMember_SetOne((char *)msg, fp->token, token) < 0)
        Py_CLEAR(msg);
    Py_DECREF(bufs);
    return msg;
}

/* ``view``, a slice [lo, hi) of memoryview ``mem`` */
static PyObject *
fp_slice(PyObject *mem, unsigned long long lo, unsigned long long hi)
{
    PyObject *a = PyLong_FromUnsignedLongLong(lo), *b = PyLong_FromUnsignedLongLong(hi);
    PyObject *sl = (a && b) ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    PyObject *view = sl ? PyObject_GetItem(mem, sl) : NULL;
    Py_XDECREF(sl);
    return view;
}

/* Message.release up to the backend's part: 1 if it was released already; 0 with the
 * views released, the message marked and ``*conn`` and ``*token`` (new references, conn
 * maybe None) taken off it; -1 error (a view still exported raises BufferError, as in
 * Python). */
static int
fp_unhook(FastPath *fp, PyObject *msg, PyObject **conn, PyObject **token)
{
    PyObject *v = PyMember_GetOne((char *)msg, fp->released);
    if (v == NULL)
        return -1;
    int done = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (done)
        return 1;
    PyObject *empty = PyList_New(0);
    PyObject *bufs = PyMember_GetOne((char *)msg, fp->buffers);
    if (empty == NULL || bufs == NULL || PyMember_SetOne((char *)msg, fp->released, Py_True) < 0
        || PyMember_SetOne((char *)msg, fp->buffers, empty) < 0) {
        Py_XDECREF(empty);
        Py_XDECREF(bufs);
        return -1;
    }
    Py_DECREF(empty);
    if (PyList_Check(bufs)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bufs); i++) {
            PyObject *r = PyObject_CallMethodNoArgs(PyList_GET_ITEM(bufs, i), fp->s_release);
            if (r == NULL) {
                Py_DECREF(bufs);
                return -1;
            }
            Py_DECREF(r);
        }
    }
    Py_DECREF(bufs);
    *conn = PyMember_GetOne((char *)msg, fp->conn);
    *token = *conn ? PyMember_GetOne((char *)msg, fp->token) : NULL;
    if (*token == NULL || PyMember_SetOne((char *)msg, fp->conn, Py_None) < 0
        || PyMember_SetOne((char *)msg, fp->token, Py_None) < 0) {
        Py_CLEAR(*conn);
        Py_CLEAR(*token);
        return -1;
    }
    return 0;
}

/* BufferPool.try_alloc on the pool's own lists: its last freed slot sized to ``nbytes``
 * (checked by the caller); Py_None, nothing taken, when none is free or the free list holds
 * something it does not understand (the Python path then says). */
static PyObject *
fp_pool_pop(FastPath *fp, PyObject *free, PyObject *in_use, PyObject *slots, PyObject *nbytes)
{
    Py_ssize_t n = PyObject_Size(free);  /* a deque */
    if (n < 0)
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    PyObject *last = PyObject_CallMethodNoArgs(free, fp->s_pop);  /* last freed, first reused */
    if (last == NULL)
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(last);
    if (i < 0 || i >= PyList_GET_SIZE(slots) || i >= PyList_GET_SIZE(in_use)) {
        PyObject *r = PyObject_CallMethodOneArg(free, fp->s_append, last);  /* put it back */
        Py_DECREF(last);
        Py_XDECREF(r);
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_DECREF(last);
    PyObject *slot = PyList_GET_ITEM(slots, i);
    if (PyMember_SetOne((char *)slot, fp->nbytes, nbytes) < 0)
        return NULL;
    Py_INCREF(Py_True);
    PyList_SetItem(in_use, i, Py_True);
    return Py_NewRef(slot);
}

/* what every Link type starts with */
typedef struct {
    PyObject_HEAD
    int open;
} FastLink;

/* ``conn.<name>`` if it is an open Link of type ``cls``, else NULL (borrowed: the connection keeps it) */
static inline FastLink *
fp_link_of(PyObject *conn, PyObject *name, PyTypeObject *cls)
{
    PyObject *link = PyObject_GetAttr(conn, name);
    if (link == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(link);
    return PyObject_TypeCheck(link, cls) && ((FastLink *)link)->open ? (FastLink *)link : NULL;
}

/* ``conn.<name>(*args)``: the Python method a compiled one hands a call to */
static PyObject *
fp_delegate(PyObject *conn, PyObject *name, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *meth = PyObject_GetAttr(conn, name);
    if (meth == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(meth, args, nargsf, kwnames);
    Py_DECREF(meth);
    return r;
}

/* (alloc, send, recv) method descriptors of ``cls`` */
static PyObject *
fp_methods(PyObject *cls, PyMethodDef *alloc, PyMethodDef *send, PyMethodDef *recv)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "a class");
        return NULL;
    }
    PyTypeObject *t = (PyTypeObject *)cls;
    PyObject *a = PyDescr_NewMethod(t, alloc), *b = a ? PyDescr_NewMethod(t, send) : NULL,
             *c = b ? PyDescr_NewMethod(t, recv) : NULL;
    PyObject *r = c ? PyTuple_Pack(3, a, b, c) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    return r;
}

/* the module of ``def``, with ``link_type`` ready and added as ``Link`` */
static PyObject *
fp_module(struct PyModuleDef *def, PyTypeObject *link_type)
{
    if (PyType_Ready(link_type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(def);
    if (m == NULL)
        return NULL;
    Py_INCREF(link_type);
    if (PyModule_AddObject(m, "Link", (PyObject *)link_type) < 0) {
        Py_DECREF(link_type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* The public alloc, send and recv of a connection class, from a module's conn_alloc,
 * conn_send and conn_recv (defined before this is used), and its connection_methods(cls). */
#define FP_CONNECTION_METHODS(cls_name)                                                                      \
    static PyMethodDef conn_alloc_def = {"alloc", (PyCFunction)(void (*)(void))conn_alloc,                   \
                                         METH_FASTCALL | METH_KEYWORDS,                                       \
                                         "alloc(nbytes, timeout=None)\n--\n\nA send slot (see Connection.alloc)."}; \
    static PyMethodDef conn_send_def = {"send", (PyCFunction)(void (*)(void))conn_send,                      \
                                        METH_FASTCALL | METH_KEYWORDS,                                        \
                                        "send(header, buffers=(), timeout=None)\n--\n\nSee Connection.send."};   \
    static PyMethodDef conn_recv_def = {"recv", (PyCFunction)(void (*)(void))conn_recv,                      \
                                        METH_FASTCALL | METH_KEYWORDS,                                        \
                                        "recv(timeout=None)\n--\n\nSee Connection.recv."};                        \
    PyDoc_STRVAR(connection_methods_doc, "connection_methods(cls)\n--\n\n(alloc, send, recv) method "          \
                 "descriptors for ``cls`` (" cls_name "), which must define _alloc_py, _send_py and _recv_py."); \
    static PyObject *connection_methods(PyObject *mod, PyObject *cls)                                        \
    {                                                                                                         \
        return fp_methods(cls, &conn_alloc_def, &conn_send_def, &conn_recv_def);                             \
    }

#endif
