/* The producer process's loop over librdkafka, in C: a batch of columns in, delivery reports out in
 * bulk, no Python object per record but the number acknowledged (docs/log-source.md, "The producer
 * process"). harvester/kafka/producer_process.py uses it when it was built
 * (deploy/native/build.sh), and confluent-kafka's producer otherwise; both take the same frames and
 * give the same reports.
 *
 * It links the librdkafka that confluent-kafka's wheel carries, which that package has loaded by the
 * time this module is imported: one librdkafka in the process, of the version the rest of the
 * harvester runs.
 *
 * Threads: produce runs on the main thread, poll on the relay's poll thread (the GIL released while
 * librdkafka polls or waits), and librdkafka's own threads may log. The callbacks never touch Python:
 * they append to the buffers below under a mutex, and take() turns them into Python lists. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <librdkafka/rdkafka.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int64_t seq;
    int code;
    char *reason;
} Failure;

typedef struct {
    int level;
    char *text;
} LogLine;

typedef struct {
    int code;
    char *reason;
    int fatal;
} ErrorLine;

/* A growable array of items of one type: the reports waiting for take(). */
typedef struct {
    void *items;
    size_t count, capacity, size;
} Buffer;

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    pthread_mutex_t lock; /* guards the buffers and fatal_seen */
    Buffer acked, failed, logs, errors, fatal;
    int fatal_seen;
    int forward_logs, forward_errors;
    pid_t parent;
} Loop;

static PyObject *SettingsError; /* raised when the producer cannot be made: args (code, reason) */

static void refuse(int code, const char *reason);

/* Appends one item (of the buffer's size) and returns 0, or -1 when memory ran out. Caller holds
 * the lock. */
static int push(Buffer *buffer, const void *item) {
    if (buffer->count == buffer->capacity) {
        size_t capacity = buffer->capacity ? buffer->capacity * 2 : 1024;
        void *items = realloc(buffer->items, capacity * buffer->size);
        if (items == NULL)
            return -1;
        buffer->items = items;
        buffer->capacity = capacity;
    }
    memcpy((char *)buffer->items + buffer->count * buffer->size, item, buffer->size);
    buffer->count++;
    return 0;
}

/* push for a report that must not be lost (a record's, the producer's refusal): a record left
 * unreported would wait for ever, so without memory the process stops, and the harvester fails
 * everything it held. Caller holds the lock. */
static void keep(Buffer *buffer, const void *item) {
    if (push(buffer, item) != 0) {
        fprintf(stderr, "the producer process's loop ran out of memory\n");
        _exit(1);
    }
}

/* A copy of text, or NULL when memory ran out (the report then carries an empty reason). */
static char *copy(const char *text) { return strdup(text ? text : ""); }

static void fail(Loop *loop, int64_t seq, int code, const char *reason) {
    Failure failure = {seq, code, copy(reason)};
    pthread_mutex_lock(&loop->lock);
    keep(&loop->failed, &failure);
    pthread_mutex_unlock(&loop->lock);
}

static void delivered(rd_kafka_t *rk, const rd_kafka_message_t *message, void *opaque) {
    (void)rk;
    Loop *loop = opaque;
    int64_t seq = (int64_t)(intptr_t)message->_private;
    if (message->err) {
        fail(loop, seq, message->err, rd_kafka_err2str(message->err));
        return;
    }
    pthread_mutex_lock(&loop->lock);
    keep(&loop->acked, &seq);
    pthread_mutex_unlock(&loop->lock);
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque) {
    Loop *loop = opaque;
    char fatal_reason[512];
    int fatal = err == RD_KAFKA_RESP_ERR__FATAL;
    if (fatal) {
        err = rd_kafka_fatal_error(rk, fatal_reason, sizeof fatal_reason);
        reason = fatal_reason;
    }
    pthread_mutex_lock(&loop->lock);
    if (fatal && !loop->fatal_seen) { /* the producer's refusal: always reported, once */
        ErrorLine line = {err, copy(reason), 1};
        loop->fatal_seen = 1;
        keep(&loop->fatal, &line);
    }
    if (loop->forward_errors && !fatal) { /* as confluent-kafka: the fatal one is the refusal above */
        ErrorLine line = {err, copy(reason), 0};
        if (push(&loop->errors, &line) != 0) /* lost without memory, as a log line */
            free(line.reason);
    }
    pthread_mutex_unlock(&loop->lock);
}

/* Raises SettingsError(code, reason). */
static void refuse(int code, const char *reason) {
    PyObject *args = Py_BuildValue("(is)", code, reason);
    if (args != NULL) {
        PyErr_SetObject(SettingsError, args);
        Py_DECREF(args);
    }
}

/* librdkafka's syslog levels as Python's logging levels, as confluent-kafka maps them. */
static const int LEVELS[8] = {50, 50, 50, 40, 30, 20, 20, 10};

static void on_log(const rd_kafka_t *rk, int level, const char *facility, const char *text) {
    Loop *loop = rd_kafka_opaque(rk);
    char line[2048];
    snprintf(line, sizeof line, "%s [%s] %s", facility, rd_kafka_name(rk), text);
    LogLine entry = {LEVELS[level < 0 ? 0 : level > 7 ? 7 : level], copy(line)};
    pthread_mutex_lock(&loop->lock);
    if (push(&loop->logs, &entry) != 0)
        free(entry.text);
    pthread_mutex_unlock(&loop->lock);
}

static PyObject *Loop_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    Loop *self = (Loop *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->lock, NULL);
    self->acked.size = sizeof(int64_t);
    self->failed.size = sizeof(Failure);
    self->logs.size = sizeof(LogLine);
    self->errors.size = sizeof(ErrorLine);
    self->fatal.size = sizeof(ErrorLine);
    return (PyObject *)self;
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"settings", "forward_logs", "forward_errors", NULL};
    PyObject *settings;
    int forward_logs, forward_errors;
    char reason[512];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!pp", keywords, &PyList_Type, &settings, &forward_logs,
                                     &forward_errors))
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
    self->forward_logs = forward_logs;
    self->forward_errors = forward_errors;
    rd_kafka_conf_set_opaque(conf, self);
    rd_kafka_conf_set_dr_msg_cb(conf, delivered);
    rd_kafka_conf_set_error_cb(conf, on_error);
    if (forward_logs)
        rd_kafka_conf_set_log_cb(conf, on_log);
    self->rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, reason, sizeof reason);
    if (self->rk == NULL) {
        char refusal[600];
        rd_kafka_conf_destroy(conf);
        snprintf(refusal, sizeof refusal, "Failed to create producer: %s", reason); /* as confluent-kafka */
        refuse(rd_kafka_last_error(), refusal);
        return -1;
    }
    self->parent = getppid();
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

/* While librdkafka's queue is full: the poll thread empties it; a harvester that died is not
 * waited for (its end of the pipe is not read now). */
static void wait_while_full(Loop *self) {
    Py_BEGIN_ALLOW_THREADS
    usleep(5000);
    Py_END_ALLOW_THREADS
    if (getppid() != self->parent)
        _exit(0);
}

/* Produces one record numbered seq; 0, or -1 with a Python error set (a malformed frame). */
static int produce_one(Loop *self, int64_t seq, PyObject *topic, PyObject *key, PyObject *value, PyObject *own,
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
    rd_kafka_vu_t vus[8];
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
    for (;;) {
        rd_kafka_error_t *error = rd_kafka_produceva(self->rk, vus, n);
        if (error == NULL)
            return 0; /* librdkafka owns the headers now */
        rd_kafka_resp_err_t code = rd_kafka_error_code(error);
        rd_kafka_error_destroy(error);
        if (code != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
            char reason[512];
            snprintf(reason, sizeof reason, "Unable to produce message: %s", rd_kafka_err2str(code));
            if (headers != NULL)
                rd_kafka_headers_destroy(headers);
            fail(self, seq, code, reason);
            return 0;
        }
        wait_while_full(self);
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
    StampView view = {NULL};
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *stamp = PyList_GET_ITEM(stamps, i);
        if (stamp != Py_None && view_stamp(&view, stamp) != 0)
            return NULL;
        PyObject *place = placements == Py_None ? Py_None : PyList_GET_ITEM(placements, i);
        if (produce_one(self, first + i, PyList_GET_ITEM(topics, i), PyList_GET_ITEM(keys, i),
                        PyList_GET_ITEM(values, i), PyList_GET_ITEM(headers, i), PyList_GET_ITEM(ids, i),
                        stamp == Py_None ? NULL : &view, place) != 0)
            return NULL;
    }
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

/* Moves a buffer's items out (under the lock) into *taken, leaving it empty. */
static void move(Buffer *from, Buffer *taken) {
    *taken = *from;
    from->items = NULL;
    from->count = from->capacity = 0;
}

/* Frees the buffers' items and the texts they own. */
static void free_reports(Buffer *acked, Buffer *failed, Buffer *logs, Buffer *errors, Buffer *fatal) {
    for (size_t i = 0; i < failed->count; i++)
        free(((Failure *)failed->items)[i].reason);
    for (size_t i = 0; i < logs->count; i++)
        free(((LogLine *)logs->items)[i].text);
    for (size_t i = 0; i < errors->count; i++)
        free(((ErrorLine *)errors->items)[i].reason);
    for (size_t i = 0; i < fatal->count; i++)
        free(((ErrorLine *)fatal->items)[i].reason);
    free(acked->items);
    free(failed->items);
    free(logs->items);
    free(errors->items);
    free(fatal->items);
}

static PyObject *Loop_take(Loop *self, PyObject *unused) {
    (void)unused;
    Buffer acked, failed, logs, errors, fatal;
    pthread_mutex_lock(&self->lock);
    move(&self->acked, &acked);
    move(&self->failed, &failed);
    move(&self->logs, &logs);
    move(&self->errors, &errors);
    move(&self->fatal, &fatal);
    pthread_mutex_unlock(&self->lock);
    PyObject *result = NULL;
    if (acked.count + failed.count + logs.count + errors.count + fatal.count == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    PyObject *lists[5] = {PyList_New((Py_ssize_t)acked.count), PyList_New((Py_ssize_t)failed.count),
                          PyList_New((Py_ssize_t)logs.count), PyList_New((Py_ssize_t)errors.count),
                          PyList_New((Py_ssize_t)fatal.count)};
    int ok = lists[0] && lists[1] && lists[2] && lists[3] && lists[4];
    for (size_t i = 0; ok && i < acked.count; i++) {
        PyObject *seq = PyLong_FromLongLong(((int64_t *)acked.items)[i]);
        ok = seq != NULL;
        if (ok)
            PyList_SET_ITEM(lists[0], (Py_ssize_t)i, seq);
    }
    for (size_t i = 0; ok && i < failed.count; i++) {
        Failure *f = (Failure *)failed.items + i;
        PyObject *item = Py_BuildValue("(Lis)", (long long)f->seq, f->code, f->reason ? f->reason : "");
        ok = item != NULL;
        if (ok)
            PyList_SET_ITEM(lists[1], (Py_ssize_t)i, item);
    }
    for (size_t i = 0; ok && i < logs.count; i++) {
        LogLine *line = (LogLine *)logs.items + i;
        PyObject *item = Py_BuildValue("(is)", line->level, line->text ? line->text : "");
        ok = item != NULL;
        if (ok)
            PyList_SET_ITEM(lists[2], (Py_ssize_t)i, item);
    }
    for (size_t i = 0; ok && i < errors.count; i++) {
        ErrorLine *line = (ErrorLine *)errors.items + i;
        PyObject *item = Py_BuildValue("(isO)", line->code, line->reason ? line->reason : "",
                                       line->fatal ? Py_True : Py_False);
        ok = item != NULL;
        if (ok)
            PyList_SET_ITEM(lists[3], (Py_ssize_t)i, item);
    }
    for (size_t i = 0; ok && i < fatal.count; i++) {
        ErrorLine *line = (ErrorLine *)fatal.items + i;
        PyObject *item = Py_BuildValue("(is)", line->code, line->reason ? line->reason : "");
        ok = item != NULL;
        if (ok)
            PyList_SET_ITEM(lists[4], (Py_ssize_t)i, item);
    }
    if (ok)
        result = PyTuple_Pack(5, lists[0], lists[1], lists[2], lists[3], lists[4]);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(lists[i]);
done:
    free_reports(&acked, &failed, &logs, &errors, &fatal);
    return result;
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
    rd_kafka_purge(self->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
    Py_RETURN_NONE;
}

static void Loop_dealloc(Loop *self) {
    if (self->rk != NULL) {
        Py_BEGIN_ALLOW_THREADS
        rd_kafka_destroy(self->rk);
        Py_END_ALLOW_THREADS
    }
    free_reports(&self->acked, &self->failed, &self->logs, &self->errors, &self->fatal);
    pthread_mutex_destroy(&self->lock);
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
    .tp_doc = "Loop(settings, forward_logs, forward_errors): a librdkafka producer fed columns.",
    .tp_new = Loop_new,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_rdkafka_loop",
    .m_doc = "The producer process's loop over librdkafka.",
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
