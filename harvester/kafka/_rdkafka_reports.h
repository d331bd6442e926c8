/* The reports of the producer process's native loop (_rdkafka_loop.c) waiting to go back to the
 * harvester: librdkafka's callbacks append to them from whichever thread serves them (the poll
 * thread, the final flush, librdkafka's own threads for logs) without touching Python, under the
 * mutex; reports_take turns them into one report frame, with the GIL held. */
#ifndef HARVESTER_RDKAFKA_REPORTS_H
#define HARVESTER_RDKAFKA_REPORTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <librdkafka/rdkafka.h>
#include <pthread.h>
#include <stdint.h>

/* A growable array of items of one type. */
typedef struct {
    void *items;
    size_t count, capacity, size;
} Buffer;

typedef struct {
    pthread_mutex_t lock; /* guards the rest */
    Buffer acked;         /* int64_t: the numbers acknowledged */
    Buffer failed;        /* Failure */
    Buffer logs;          /* LogLine */
    Buffer errors;        /* ErrorLine: forwarded errors */
    Buffer fatal;         /* ErrorLine: the producer's fatal error, once */
    int fatal_seen;
    int forward_errors;
} Reports;

void reports_init(Reports *reports);
void reports_free(Reports *reports);

/* Record seq failed with code and reason (copied). */
void reports_fail(Reports *reports, int64_t seq, int code, const char *reason);

/* (acked, failed, logs, errors, fatal) reported since the last call, as Python lists; None for
 * nothing; NULL with a Python error set. */
PyObject *reports_take(Reports *reports);

/* librdkafka's callbacks; the opaque (rd_kafka_conf_set_opaque) is the Reports. */
void reports_delivered(rd_kafka_t *rk, const rd_kafka_message_t *message, void *opaque);
void reports_error(rd_kafka_t *rk, int err, const char *reason, void *opaque);
void reports_log(const rd_kafka_t *rk, int level, const char *facility, const char *text);

#endif
