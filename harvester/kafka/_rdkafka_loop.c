/* The producer's loop over librdkafka, in C: a batch of columns in, delivery reports out in bulk, no
 * Python object per record but the number acknowledged (docs/log-source.md, "The producer process").
 * Where it was built (deploy/native/build.sh), harvester/kafka/native_publisher.py drives it in the
 * harvester's process and harvester/kafka/producer_process.py in a child; the child's Python loop
 * over confluent-kafka's producer takes the same columns and gives the same reports.
 *
 * It links the librdkafka that confluent-kafka's wheel carries, which that package has loaded by the
 * time this module is imported: one librdkafka in the process, of the version the rest of the
 * harvester runs.
 *
 * Threads: produce runs on one thread (a child's main thread, the native publisher's sender), poll
 * on the relay's poll thread (the GIL released while librdkafka produces, polls or waits), and
 * librdkafka's own threads may log. The callbacks never touch Python: they append to the reports
 * (_rdkafka_reports.c), and take() turns them into Python lists. */
#include "_rdkafka_reports.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    Reports reports; /* librdkafka's opaque */
    pid_t parent; /* the producer process's harvester, whose death ends it; 0 in the harvester itself */
} Loop;

static PyObject *SettingsError; /* raised when the producer cannot be made: args (code, reason) */

/* Raises SettingsError(code, reason). */
static void refuse(int code, const char *reason) {
    PyObject *args = Py_BuildValue("(is)", code, reason);
    if (args != NULL) {
        PyErr_SetObject(SettingsError, args);
        Py_DECREF(args);
    }
}

static PyObject *Loop_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Loop *self = (Loop *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    reports_init(&self->reports);
    return (PyObject *)self;
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"settings", "forward_logs", "forward_errors", "exit_when_orphaned", NULL};
    PyObject *settings;
    int forward_logs, forward_errors, exit_when_orphaned = 1;
    char reason[512];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!pp|p", keywords, &PyList_Type, &settings, &forward_logs,
                                     &forward_errors, &exit_when_orphaned))
        return -1;
    if (self->rk != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the loop has its producer already");
        return -1;
    }
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(settings); i++) {
        const char *name, *value; /* value NULL: the setting's default, as confluent-kafka's None */
        if (!PyArg_ParseTuple(PyList_GET_ITEM(settings, i), "sz", &name, &value)) {
            rd_kafka_conf_destroy(conf);
            return -1;
        }
        if (rd_kafka_conf_set(conf, name, value, reason, sizeof reason) != RD_KAFKA_CONF_OK) {
            rd_kafka_conf_destroy(conf);
            refuse(RD_KAFKA_RESP_ERR__INVALID_ARG, reason);
            return -1;
        }
    }
    self->reports.forward_errors = forward_errors;
    rd_kafka_conf_set_opaque(conf, &self->reports);
    rd_kafka_conf_set_dr_msg_cb(conf, reports_delivered);
    rd_kafka_conf_set_error_cb(conf, reports_error);
    if (forward_logs)
        rd_kafka_conf_set_log_cb(conf, reports_log);
    self->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, reason, sizeof reason);
    if (self->rk == NULL) {
        char refusal[600];
        rd_kafka_conf_destroy(conf);
        snprintf(refusal, sizeof refusal, "Failed to create producer: %s", reason); /* as confluent-kafka */
        refuse(rd_kafka_last_error(), refusal);
        return -1;
    }
    self->parent = exit_when_orphaned ? getppid() : 0;
    return 0;
}

/* The bytes of a str (UTF-8), of a bytes, or none for None: 0, or -1 with a Python error set. */
static int data_of(PyObject *object, const char **data, Py_ssize_t *size) {
    if (object == Py_None) {
        *data = NULL;
        *size = 0;
        return 0;
    }
    if (PyBytes_Check(object)) {
        *data = PyBytes_AS_STRING(object);
        *size = PyBytes_GET_SIZE(object);
        return 0;
    }
    if (PyUnicode_Check(object)) {
        *data = PyUnicode_AsUTF8AndSize(object, size);
        return *data == NULL ? -1 : 0;
    }
    PyErr_Format(PyExc_TypeError, "expected str, bytes or None, not %.100s", Py_TYPE(object)->tp_name);
    return -1;
}

/* A term's identity headers (harvester.core.identity.Stamp), read once per stamp object. The
 * pointers borrow from the stamp, which the frame's list holds while produce runs. */
typedef struct {
    PyObject *stamp;
    const char *id_name, *epoch_name, *producer_name;
    const char *epoch, *producer;
    Py_ssize_t epoch_size, producer_size;
} StampView;

static int pair_of(PyObject *stamp, const char *attribute, const char **name, const char **value,
                   Py_ssize_t *size) {
    PyObject *pair = PyObject_GetAttrString(stamp, attribute);
    if (pair == NULL)
        return -1;
    Py_ssize_t name_size;
    int ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
             data_of(PyTuple_GET_ITEM(pair, 0), name, &name_size) == 0 &&
             data_of(PyTuple_GET_ITEM(pair, 1), value, size) == 0;
    Py_DECREF(pair); /* the stamp keeps the tuple, and so its items */
    if (!ok && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "a stamp's header is a (name, value) pair");
    return ok ? 0 : -1;
}

static int view_stamp(StampView *view, PyObject *stamp) {
    if (stamp == view->stamp)
        return 0;
    PyObject *id = PyObject_GetAttrString(stamp, "id");
    if (id == NULL)
        return -1;
    Py_ssize_t size;
    int ok = data_of(id, &view->id_name, &size) == 0;
    Py_DECREF(id);
    if (!ok || pair_of(stamp, "epoch", &view->epoch_name, &view->epoch, &view->epoch_size) != 0 ||
        pair_of(stamp, "producer", &view->producer_name, &view->producer, &view->producer_size) != 0)
        return -1;
    view->stamp = stamp;
    return 0;
}

/* headers_of's work, ``own`` being the record's headers as a PySequence_Fast (NULL for none). */
static rd_kafka_headers_t *headers_in(PyObject *own, StampView *stamp, long long record_id) {
    Py_ssize_t count = own == NULL ? 0 : PySequence_Fast_GET_SIZE(own);
    if (count == 0 && stamp == NULL)
        return NULL;
    rd_kafka_headers_t *headers = rd_kafka_headers_new((size_t)count + 3);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(own, i);
        const char *name, *value;
        Py_ssize_t name_size, value_size;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "a header is a (name, value) pair");
            rd_kafka_headers_destroy(headers);
            return NULL;
        }
        if (!PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "a header's name is a str");
            rd_kafka_headers_destroy(headers);
            return NULL;
        }
        if (data_of(PyTuple_GET_ITEM(pair, 0), &name, &name_size) != 0 ||
            data_of(PyTuple_GET_ITEM(pair, 1), &value, &value_size) != 0) {
            rd_kafka_headers_destroy(headers);
            return NULL;
        }
        rd_kafka_header_add(headers, name, name_size, value, value_size);
    }
    if (stamp != NULL) {
        char id[24];
        int size = snprintf(id, sizeof id, "%lld", record_id);
        rd_kafka_header_add(headers, stamp->id_name, -1, id, size);
        rd_kafka_header_add(headers, stamp->epoch_name, -1, stamp->epoch, stamp->epoch_size);
        rd_kafka_header_add(headers, stamp->producer_name, -1, stamp->producer, stamp->producer_size);
    }
    return headers;
}

/* A record's headers: its own, then its stamp's for record_id; NULL when it has none (or with a
 * Python error set: check PyErr_Occurred). */
static rd_kafka_headers_t *headers_of(PyObject *own, StampView *stamp, long long record_id) {
    PyObject *items = own == Py_None ? NULL : PySequence_Fast(own, "a record's headers are a sequence");
    if (own != Py_None && items == NULL)
        return NULL;
    rd_kafka_headers_t *headers = headers_in(items, stamp, record_id);
    Py_XDECREF(items);
    return headers;
}

/* One record's arguments to rd_kafka_produceva, built holding the GIL (they point into the
 * frame's objects, which the frame's lists keep alive and nothing else sees while produce runs). */
typedef struct {
    rd_kafka_vu_t vus[8];
    size_t count;
    rd_kafka_headers_t *headers; /* NULL for none; librdkafka's once produced */
    int64_t seq;
} Args;

/* Fills ``args`` for record seq; 0, or -1 with a Python error set (a malformed frame). */
static int args_of(Args *args, int64_t seq, PyObject *topic, PyObject *key, PyObject *value, PyObject *own,
                   PyObject *record_id, StampView *stamp, PyObject *place) {
    const char *topic_name, *key_data, *value_data;
    Py_ssize_t topic_size, key_size, value_size;
    if (!PyUnicode_Check(topic)) {
        PyErr_SetString(PyExc_TypeError, "a topic is a str");
        return -1;
    }
    topic_name = PyUnicode_AsUTF8AndSize(topic, &topic_size);
    if (topic_name == NULL || data_of(key, &key_data, &key_size) != 0 ||
        data_of(value, &value_data, &value_size) != 0)
        return -1;
    long long id = PyLong_AsLongLong(record_id);
    if (id == -1 && PyErr_Occurred())
        return -1;
    long long timestamp = 0;
    int partition = RD_KAFKA_PARTITION_UA;
    if (place != Py_None && !PyArg_ParseTuple(place, "Li", &timestamp, &partition))
        return -1;
    rd_kafka_headers_t *headers = headers_of(own, stamp, id);
    if (headers == NULL && PyErr_Occurred())
        return -1;
    rd_kafka_vu_t *vus = args->vus;
    size_t n = 0;
    vus[n].vtype = RD_KAFKA_VTYPE_TOPIC;
    vus[n++].u.cstr = topic_name;
    vus[n].vtype = RD_KAFKA_VTYPE_KEY;
    vus[n].u.mem.ptr = (void *)key_data;
    vus[n++].u.mem.size = (size_t)key_size;
    vus[n].vtype = RD_KAFKA_VTYPE_VALUE;
    vus[n].u.mem.ptr = (void *)value_data;
    vus[n++].u.mem.size = (size_t)value_size;
    vus[n].vtype = RD_KAFKA_VTYPE_OPAQUE;
    vus[n++].u.ptr = (void *)(intptr_t)seq;
    vus[n].vtype = RD_KAFKA_VTYPE_MSGFLAGS;
    vus[n++].u.i = RD_KAFKA_MSG_F_COPY;
    vus[n].vtype = RD_KAFKA_VTYPE_PARTITION;
    vus[n++].u.i32 = partition;
    if (timestamp != 0) {
        vus[n].vtype = RD_KAFKA_VTYPE_TIMESTAMP;
        vus[n++].u.i64 = timestamp;
    }
    if (headers != NULL) {
        vus[n].vtype = RD_KAFKA_VTYPE_HEADERS;
        vus[n++].u.headers = headers;
    }
    args->count = n;
    args->headers = headers;
    args->seq = seq;
    return 0;
}

/* Produces one record, without the GIL; while librdkafka's queue is full, the poll thread empties
 * it, and a producer process whose harvester died is not waited for (its pipe is not read now). */
static void produce_one(Loop *self, Args *args) {
    for (;;) {
        rd_kafka_error_t *error = rd_kafka_produceva(self->rk, args->vus, args->count);
        if (error == NULL)
            return; /* librdkafka owns the headers now */
        rd_kafka_resp_err_t code = rd_kafka_error_code(error);
        rd_kafka_error_destroy(error);
        if (code != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
            char reason[512];
            snprintf(reason, sizeof reason, "Unable to produce message: %s", rd_kafka_err2str(code));
            if (args->headers != NULL)
                rd_kafka_headers_destroy(args->headers);
            reports_fail(&self->reports, args->seq, code, reason);
            return;
        }
        usleep(5000);
        if (self->parent != 0 && getppid() != self->parent)
            _exit(0);
    }
}

/* 0 when the loop has its producer, else -1 with a Python error set (its __init__ failed). */
static int made(Loop *self) {
    if (self->rk != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "the loop has no producer");
    return -1;
}

static PyObject *Loop_produce(Loop *self, PyObject *args) {
    long long first;
    PyObject *topics, *keys, *values, *headers, *ids, *stamps, *placements;
    if (made(self) != 0 || !PyArg_ParseTuple(args, "LO!O!O!O!O!O!O", &first, &PyList_Type, &topics, &PyList_Type, &keys,
                          &PyList_Type, &values, &PyList_Type, &headers, &PyList_Type, &ids, &PyList_Type,
                          &stamps, &placements))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(topics);
    PyObject *columns[] = {keys, values, headers, ids, stamps};
    for (size_t c = 0; c < sizeof columns / sizeof *columns; c++)
        if (PyList_GET_SIZE(columns[c]) != count) {
            PyErr_SetString(PyExc_ValueError, "the frame's columns differ in length");
            return NULL;
        }
    if (placements != Py_None && (!PyList_Check(placements) || PyList_GET_SIZE(placements) != count)) {
        PyErr_SetString(PyExc_ValueError, "placements is None or a list as long as the columns");
        return NULL;
    }
    /* The records' arguments first, holding the GIL; then librdkafka's produce without it, so that
     * the poll thread (and, in the harvester, its other threads) runs meanwhile. */
    Args *all = PyMem_Malloc(sizeof(Args) * (size_t)(count > 0 ? count : 1));
    if (all == NULL)
        return PyErr_NoMemory();
    StampView view = {NULL};
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *stamp = PyList_GET_ITEM(stamps, i);
        PyObject *place = placements == Py_None ? Py_None : PyList_GET_ITEM(placements, i);
        if ((stamp != Py_None && view_stamp(&view, stamp) != 0) ||
            args_of(&all[i], first + i, PyList_GET_ITEM(topics, i), PyList_GET_ITEM(keys, i),
                    PyList_GET_ITEM(values, i), PyList_GET_ITEM(headers, i), PyList_GET_ITEM(ids, i),
                    stamp == Py_None ? NULL : &view, place) != 0) {
            for (Py_ssize_t j = 0; j < i; j++)
                if (all[j].headers != NULL)
                    rd_kafka_headers_destroy(all[j].headers);
            PyMem_Free(all);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        produce_one(self, &all[i]);
    Py_END_ALLOW_THREADS
    PyMem_Free(all);
    Py_RETURN_NONE;
}

static PyObject *Loop_poll(Loop *self, PyObject *args) {
    double timeout;
    if (made(self) != 0 || !PyArg_ParseTuple(args, "d", &timeout))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rd_kafka_poll(self->rk, (int)(timeout * 1000));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Loop_take(Loop *self, PyObject *unused) {
    (void)unused;
    return reports_take(&self->reports);
}

static PyObject *Loop_flush(Loop *self, PyObject *args) {
    double timeout;
    if (made(self) != 0 || !PyArg_ParseTuple(args, "d", &timeout))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rd_kafka_flush(self->rk, (int)(timeout * 1000));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rd_kafka_outq_len(self->rk));
}

static PyObject *Loop_purge(Loop *self, PyObject *unused) {
    (void)unused;
    if (made(self) != 0)
        return NULL;
    /* It waits for each broker thread to purge its queues: without the GIL, as flush, so that a
     * slow broker thread holds back this thread only, not every thread of the harvester. */
    Py_BEGIN_ALLOW_THREADS
    rd_kafka_purge(self->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void Loop_dealloc(Loop *self) {
    if (self->rk != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rd_kafka_destroy(self->rk);
        Py_END_ALLOW_THREADS
    }
    reports_free(&self->reports);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Loop_methods[] = {
    {"produce", (PyCFunction)Loop_produce, METH_VARARGS,
     "produce(first, topics, keys, values, headers, ids, stamps, placements): a batch, in order."},
    {"poll", (PyCFunction)Loop_poll, METH_VARARGS, "poll(timeout): serve librdkafka's callbacks."},
    {"take", (PyCFunction)Loop_take, METH_NOARGS,
     "take(): (acked, failed, logs, errors, fatal) reported since the last take, or None."},
    {"flush", (PyCFunction)Loop_flush, METH_VARARGS, "flush(timeout): wait; how many are left."},
    {"purge", (PyCFunction)Loop_purge, METH_NOARGS, "purge(): drop what is queued or in flight."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "harvester.kafka._rdkafka_loop.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Loop(settings, forward_logs, forward_errors, exit_when_orphaned=True): a librdkafka producer fed columns.",
    .tp_new = Loop_new,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_rdkafka_loop",
    .m_doc = "The producer's loop over librdkafka, fed batches as columns.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__rdkafka_loop(void) {
    if (PyType_Ready(&LoopType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    SettingsError = PyErr_NewException("harvester.kafka._rdkafka_loop.SettingsError", NULL, NULL);
    if (SettingsError == NULL || PyModule_AddObjectRef(m, "SettingsError", SettingsError) < 0 ||
        PyModule_AddObjectRef(m, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
