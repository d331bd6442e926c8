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

PyObject *reports_take(Reports *reports) {
    Buffer acked, failed, logs, errors, fatal;
    pthread_mutex_lock(&reports->lock);
    move(&reports->acked, &acked);
    move(&reports->failed, &failed);
    move(&reports->logs, &logs);
    move(&reports->errors, &errors);
    move(&reports->fatal, &fatal);
    pthread_mutex_unlock(&reports->lock);
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
    free_items(&acked, &failed, &logs, &errors, &fatal);
    return result;
}
