/* The native loop's reports (_rdkafka_reports.h). */
#include "_rdkafka_reports.h"

#include <stdio.h>
#include <stdlib.h>
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

void reports_init(Reports *reports) {
    pthread_mutex_init(&reports->lock, NULL);
    reports->acked.size = sizeof(int64_t);
    reports->failed.size = sizeof(Failure);
    reports->logs.size = sizeof(LogLine);
    reports->errors.size = sizeof(ErrorLine);
    reports->fatal.size = sizeof(ErrorLine);
}

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

void reports_fail(Reports *reports, int64_t seq, int code, const char *reason) {
    Failure failure = {seq, code, copy(reason)};
    pthread_mutex_lock(&reports->lock);
    keep(&reports->failed, &failure);
    pthread_mutex_unlock(&reports->lock);
}

void reports_delivered(rd_kafka_t *rk, const rd_kafka_message_t *message, void *opaque) {
    (void)rk;
    Reports *reports = opaque;
    int64_t seq = (int64_t)(intptr_t)message->_private;
    if (message->err) {
        reports_fail(reports, seq, message->err, rd_kafka_err2str(message->err));
        return;
    }
    pthread_mutex_lock(&reports->lock);
    keep(&reports->acked, &seq);
    pthread_mutex_unlock(&reports->lock);
}

void reports_error(rd_kafka_t *rk, int err, const char *reason, void *opaque) {
    Reports *reports = opaque;
    char fatal_reason[512];
    int fatal = err == RD_KAFKA_RESP_ERR__FATAL;
    if (fatal) {
        err = rd_kafka_fatal_error(rk, fatal_reason, sizeof fatal_reason);
        reason = fatal_reason;
    }
    pthread_mutex_lock(&reports->lock);
    if (fatal && !reports->fatal_seen) { /* the producer's refusal: always reported, once */
        ErrorLine line = {err, copy(reason), 1};
        reports->fatal_seen = 1;
        keep(&reports->fatal, &line);
    }
    if (reports->forward_errors && !fatal) { /* as confluent-kafka: the fatal one is the refusal above */
        ErrorLine line = {err, copy(reason), 0};
        if (push(&reports->errors, &line) != 0) /* lost without memory, as a log line */
            free(line.reason);
    }
    pthread_mutex_unlock(&reports->lock);
}

/* librdkafka's syslog levels as Python's logging levels, as confluent-kafka maps them. */
static const int LEVELS[8] = {50, 50, 50, 40, 30, 20, 20, 10};

void reports_log(const rd_kafka_t *rk, int level, const char *facility, const char *text) {
    Reports *reports = rd_kafka_opaque(rk);
    char line[2048];
    snprintf(line, sizeof line, "%s [%s] %s", facility, rd_kafka_name(rk), text);
    LogLine entry = {LEVELS[level < 0 ? 0 : level > 7 ? 7 : level], copy(line)};
    pthread_mutex_lock(&reports->lock);
    if (push(&reports->logs, &entry) != 0)
        free(entry.text);
    pthread_mutex_unlock(&reports->lock);
}

/* Moves a buffer's items out (under the lock) into *taken, leaving it empty. */
static void move(Buffer *from, Buffer *taken) {
    *taken = *from;
    from->items = NULL;
    from->count = from->capacity = 0;
}

/* Frees the buffers' items and the texts they own. */
static void free_items(Buffer *acked, Buffer *failed, Buffer *logs, Buffer *errors, Buffer *fatal) {
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

void reports_free(Reports *reports) {
    free_items(&reports->acked, &reports->failed, &reports->logs, &reports->errors, &reports->fatal);
    pthread_mutex_destroy(&reports->lock);
}

/* One report's Python form, by its buffer's type; NULL with a Python error set. */
static PyObject *acked_item(const void *item) { return PyLong_FromLongLong(*(const int64_t *)item); }

static PyObject *failed_item(const void *item) {
    const Failure *f = item;
    return Py_BuildValue("(Lis)", (long long)f->seq, f->code, f->reason ? f->reason : "");
}

static PyObject *log_item(const void *item) {
    const LogLine *line = item;
    return Py_BuildValue("(is)", line->level, line->text ? line->text : "");
}

static PyObject *error_item(const void *item) {
    const ErrorLine *line = item;
    return Py_BuildValue("(isO)", line->code, line->reason ? line->reason : "", line->fatal ? Py_True : Py_False);
}

static PyObject *fatal_item(const void *item) {
    const ErrorLine *line = item;
    return Py_BuildValue("(is)", line->code, line->reason ? line->reason : "");
}

/* A buffer's items as a Python list; NULL with a Python error set. */
static PyObject *list_of(const Buffer *buffer, PyObject *(*item_of)(const void *)) {
    PyObject *list = PyList_New((Py_ssize_t)buffer->count);
    for (size_t i = 0; list != NULL && i < buffer->count; i++) {
        PyObject *item = item_of((const char *)buffer->items + i * buffer->size);
        if (item == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    return list;
}

PyObject *reports_take(Reports *reports) {
    Buffer taken[5];
    pthread_mutex_lock(&reports->lock);
    move(&reports->acked, &taken[0]);
    move(&reports->failed, &taken[1]);
    move(&reports->logs, &taken[2]);
    move(&reports->errors, &taken[3]);
    move(&reports->fatal, &taken[4]);
    pthread_mutex_unlock(&reports->lock);
    PyObject *result;
    if (taken[0].count + taken[1].count + taken[2].count + taken[3].count + taken[4].count == 0) {
        result = Py_None;
        Py_INCREF(result);
    } else {
        PyObject *(*item_of[5])(const void *) = {acked_item, failed_item, log_item, error_item, fatal_item};
        PyObject *lists[5] = {NULL};
        int ok = 1;
        for (int i = 0; ok && i < 5; i++)
            ok = (lists[i] = list_of(&taken[i], item_of[i])) != NULL;
        result = ok ? PyTuple_Pack(5, lists[0], lists[1], lists[2], lists[3], lists[4]) : NULL;
        for (int i = 0; i < 5; i++)
            Py_XDECREF(lists[i]);
    }
    free_items(&taken[0], &taken[1], &taken[2], &taken[3], &taken[4]);
    return result;
}
