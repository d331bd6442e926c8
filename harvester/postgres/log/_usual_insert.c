/* The usual layout's inserts decoded in C: records.py's _usual, the log source's per-record decode,
 * without a Python object per field but those the record holds. records.py uses it when it was built
 * (deploy/native/build.sh) and HARVESTER_INSERT_DECODER is not "python"; both give the same record
 * (tests/unit/test_usual_insert.py, tests/log/test_decoding.py).
 *
 * An Insert message of pgoutput with binary values: 'I', the relation's oid, 'N', the column count,
 * then per column a kind ('b': binary, 'n': NULL, ...), and for 'b' a length and the bytes. The usual
 * row: id (bigint) and create_time (timestamptz) binary, topic and key binary, the value binary or
 * NULL, then both header arrays empty, as the no_headers bytes the caller gives. Anything else, or a
 * message too short to hold what it says, or a create_time past datetime's range, is not decoded
 * here (None): the caller's general path reads it, or raises the protocol error. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <datetime.h>

#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *record;     /* the record's class, called with (id, create_time, topic, key, value, headers) */
    PyObject *no_headers; /* bytes: both header columns as empty arrays */
    PyObject *epoch;      /* 2000-01-01 UTC, where a create_time's microseconds count from */
    int jsonb;            /* the value is jsonb: a version byte before the text */
    int64_t last_micros;  /* the last create_time decoded (a transaction's rows usually share it) */
    PyObject *last_time;  /* ... as a datetime, or NULL */
} Decoder;

/* The head: 'I', oid, 'N', the column count, then id and create_time (kind, length 8, value) and the
 * topic's kind and length. */
enum { HEAD = 39 };

static uint32_t u32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static int64_t i64(const unsigned char *p) { return (int64_t)((uint64_t)u32(p) << 32 | u32(p + 4)); }

static int Decoder_init(Decoder *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"record", "no_headers", "jsonb", "epoch", NULL};
    PyObject *record, *no_headers, *epoch;
    int jsonb;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!pO!", keywords, &record, &PyBytes_Type, &no_headers, &jsonb,
                                     PyDateTimeAPI->DateTimeType, &epoch))
        return -1;
    Py_INCREF(record);
    Py_INCREF(no_headers);
    Py_INCREF(epoch);
    Py_XSETREF(self->record, record);
    Py_XSETREF(self->no_headers, no_headers);
    Py_XSETREF(self->epoch, epoch);
    Py_CLEAR(self->last_time);
    self->jsonb = jsonb;
    return 0;
}

static void Decoder_dealloc(Decoder *self) {
    Py_XDECREF(self->record);
    Py_XDECREF(self->no_headers);
    Py_XDECREF(self->epoch);
    Py_XDECREF(self->last_time);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The create_time of ``micros`` (a new reference), or NULL with no error set when it lies outside
 * datetime's range ('infinity' is sent as int64's extremes). */
static PyObject *create_time(Decoder *self, int64_t micros) {
    if (self->last_time != NULL && micros == self->last_micros) {
        Py_INCREF(self->last_time);
        return self->last_time;
    }
    int64_t seconds = micros / 1000000, us = micros % 1000000;
    if (us < 0) {
        us += 1000000;
        seconds -= 1;
    }
    int64_t days = seconds / 86400, second = seconds % 86400;
    if (second < 0) {
        second += 86400;
        days -= 1;
    }
    PyObject *delta = PyDelta_FromDSU((int)days, (int)second, (int)us);
    if (delta == NULL)
        return NULL;
    PyObject *when = PyNumber_Add(self->epoch, delta);
    Py_DECREF(delta);
    if (when == NULL) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError))
            PyErr_Clear();
        return NULL;
    }
    Py_INCREF(when);
    Py_XSETREF(self->last_time, when);
    self->last_micros = micros;
    return when;
}

/* The record of the usual row in ``data`` (an Insert message's ``length`` bytes, read from the
 * relation's oid on: what is before it is not looked at), or None for another row; NULL on error. */
static PyObject *decode_insert(Decoder *self, const unsigned char *data, Py_ssize_t length) {
    if (length < HEAD || data[8] != 'b' || u32(data + 9) != 8 || data[21] != 'b' || u32(data + 22) != 8 ||
        data[34] != 'b')
        Py_RETURN_NONE;
    int64_t id = i64(data + 13), micros = i64(data + 26);
    Py_ssize_t topic_at = HEAD, topic_size = u32(data + 35);
    Py_ssize_t at = topic_at + topic_size;
    if (at + 5 > length || data[at] != 'b')
        Py_RETURN_NONE;
    Py_ssize_t key_at = at + 5, key_size = u32(data + at + 1);
    at = key_at + key_size;
    if (at >= length)
        Py_RETURN_NONE;
    Py_ssize_t value_at = 0, value_size = -1;
    if (data[at] == 'b') {
        if (at + 5 > length)
            Py_RETURN_NONE;
        value_at = at + 5;
        value_size = u32(data + at + 1);
        at = value_at + value_size;
        if (at > length)
            Py_RETURN_NONE;
    } else {
        at += 1;
    }
    Py_ssize_t tail = PyBytes_GET_SIZE(self->no_headers);
    if (length - at < tail || memcmp(data + at, PyBytes_AS_STRING(self->no_headers), (size_t)tail) != 0)
        Py_RETURN_NONE;
    if (self->jsonb && value_size > 0) {
        value_at += 1;
        value_size -= 1;
    }
    PyObject *when = create_time(self, micros);
    if (when == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    /* The fields one at a time: no call into Python with an error pending. */
    PyObject *fields[6] = {PyLong_FromLongLong(id), when, NULL, NULL, NULL, NULL};
    PyObject *out = NULL;
    if (fields[0] == NULL)
        goto done;
    fields[2] = PyUnicode_DecodeUTF8((const char *)data + topic_at, topic_size, NULL);
    if (fields[2] == NULL)
        goto done;
    fields[3] = PyUnicode_DecodeUTF8((const char *)data + key_at, key_size, NULL);
    if (fields[3] == NULL)
        goto done;
    fields[4] =
        value_size < 0 ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((const char *)data + value_at, value_size);
    if (fields[4] == NULL)
        goto done;
    fields[5] = PyList_New(0);
    if (fields[5] != NULL)
        out = PyObject_Vectorcall(self->record, fields, 6, NULL);
done:
    for (int i = 0; i < 6; i++)
        Py_XDECREF(fields[i]);
    return out;
}

static int initialized(Decoder *self) {
    if (self->record != NULL)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "the decoder was not initialized");
    return 0;
}

static PyObject *Decoder_decode(Decoder *self, PyObject *message) {
    if (!initialized(self))
        return NULL;
    if (!PyBytes_Check(message)) {
        PyErr_SetString(PyExc_TypeError, "an Insert message is bytes");
        return NULL;
    }
    return decode_insert(self, (const unsigned char *)PyBytes_AS_STRING(message), PyBytes_GET_SIZE(message));
}

/* take_streamed(raw, start, head, xid, oid, changes, room, cost): streamed.py's take of the usual
 * inserts, straight from the stream's copy data. From raw[start] on (buffers whose message starts at
 * ``head``), each Insert of the subtransaction ``xid`` (4 bytes) into the table ``oid`` (4 bytes)
 * that this decoder reads is appended to ``changes`` as its record; each costs its message's size
 * without the xid, and ``cost``. It stops at any other item (whoever called it takes that one as
 * it would any change: a row this decoder leaves to the general path, one it fails on), and after
 * the change that brings what it took past ``room``. Returns (the index it stopped at, what it took
 * costs). */
static PyObject *Decoder_take_streamed(Decoder *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!initialized(self))
        return NULL;
    if (nargs != 8 || !PyList_Check(args[0]) || !PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) != 4 ||
        !PyBytes_Check(args[4]) || PyBytes_GET_SIZE(args[4]) != 4 || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "take_streamed(raw: list, start: int, head: int, xid: bytes[4], oid: bytes[4], changes: list,"
                        " room: int, cost: int)");
        return NULL;
    }
    PyObject *raw = args[0], *changes = args[5];
    const char *xid = PyBytes_AS_STRING(args[3]), *oid = PyBytes_AS_STRING(args[4]);
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), head = PyLong_AsSsize_t(args[2]);
    long long room = PyLong_AsLongLong(args[6]), cost = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0 || head < 1) {
        PyErr_SetString(PyExc_ValueError, "take_streamed: start and head out of range");
        return NULL;
    }
    long long taken = 0;
    Py_ssize_t i = start;
    while (i < PyList_GET_SIZE(raw) && taken <= room) {
        Py_buffer view;
        if (PyObject_GetBuffer(PyList_GET_ITEM(raw, i), &view, PyBUF_SIMPLE) < 0)
            return NULL;
        const unsigned char *data = view.buf;
        /* 'w', its head, then 'I', the xid, the oid, 'N': the message without its xid starts at its last byte. */
        Py_ssize_t at = head + 4, length = view.len - at;
        PyObject *record = NULL;
        if (length >= 6 && data[0] == 'w' && data[head] == 'I' && memcmp(data + head + 1, xid, 4) == 0 &&
            memcmp(data + at + 1, oid, 4) == 0 && data[at + 5] == 'N') {
            record = decode_insert(self, data + at, length);
            if (record == NULL)
                PyErr_Clear(); /* taken by the caller, which meets the error where it would */
            else if (record == Py_None)
                Py_CLEAR(record);
        }
        PyBuffer_Release(&view);
        if (record == NULL)
            break;
        int appended = PyList_Append(changes, record);
        Py_DECREF(record);
        if (appended < 0)
            return NULL;
        taken += length + cost; /* the message without its xid: as long as what the view holds from at */
        i++;
    }
    return Py_BuildValue("nL", i, taken);
}

static PyMethodDef Decoder_methods[] = {
    {"decode", (PyCFunction)Decoder_decode, METH_O,
     "decode(message): the record of a usual row's Insert message, or None for another (records.py)."},
    {"take_streamed", (PyCFunction)(void (*)(void))Decoder_take_streamed, METH_FASTCALL,
     "take_streamed(raw, start, head, xid, oid, changes, room, cost): the usual inserts of a streamed"
     " transaction, decoded from the stream's copy data (streamed.py)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "harvester.postgres.log._usual_insert.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decoder(record, no_headers, jsonb, epoch): decodes the usual layout's Insert messages.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Decoder_init,
    .tp_dealloc = (destructor)Decoder_dealloc,
    .tp_methods = Decoder_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_usual_insert",
    .m_doc = "The usual outbox layout's Insert messages decoded in C (records.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__usual_insert(void) {
    PyDateTime_IMPORT;
    if (PyDateTimeAPI == NULL || PyType_Ready(&DecoderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Decoder", (PyObject *)&DecoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
