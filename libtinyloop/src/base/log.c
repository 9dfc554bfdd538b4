/* log.c — tl_log_set() and the internal tl_log() (log.h).
 *
 * The callback runs under a read lock, so several threads may log at once and
 * tl_log_set() (the write lock) returns only when no call of the callback it replaces
 * is still running: the caller may then free what user_data points at. Messages
 * logged while no callback is set are dropped, except the last TL_LOG_BACKLOG
 * warnings and errors, which the next callback set receives first (a program that sets
 * its callback after loading a model still sees what the load reported). */
#include "base/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define TL_LOG_BACKLOG 16

static pthread_rwlock_t callback_lock = PTHREAD_RWLOCK_INITIALIZER;
static tl_log_callback callback;
static void *callback_data;

/* A ring of the newest messages logged without a callback. */
static pthread_mutex_t backlog_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    tl_log_level level;
    char text[TL_LOG_MESSAGE_MAX];
} backlog[TL_LOG_BACKLOG];
static unsigned backlog_next, backlog_count;

static void keep(tl_log_level level, const char *text) {
    pthread_mutex_lock(&backlog_lock);
    backlog[backlog_next].level = level;
    snprintf(backlog[backlog_next].text, sizeof backlog[backlog_next].text, "%s", text);
    backlog_next = (backlog_next + 1) % TL_LOG_BACKLOG;
    if (backlog_count < TL_LOG_BACKLOG) backlog_count++;
    pthread_mutex_unlock(&backlog_lock);
}

/* Hands the kept messages, oldest first, to the callback just set (write lock held). */
static void deliver_backlog(void) {
    pthread_mutex_lock(&backlog_lock);
    unsigned first = (backlog_next + TL_LOG_BACKLOG - backlog_count) % TL_LOG_BACKLOG;
    for (unsigned i = 0; i < backlog_count; i++) {
        unsigned k = (first + i) % TL_LOG_BACKLOG;
        callback(backlog[k].level, backlog[k].text, callback_data);
    }
    backlog_count = 0;
    pthread_mutex_unlock(&backlog_lock);
}

tl_status tl_log_set(tl_log_callback fn, void *user_data) {
    pthread_rwlock_wrlock(&callback_lock);
    callback = fn;
    callback_data = fn ? user_data : NULL;
    if (fn) deliver_backlog();
    pthread_rwlock_unlock(&callback_lock);
    return TL_OK;
}

void tl_log(tl_log_level level, const char *fmt, ...) {
    pthread_rwlock_rdlock(&callback_lock);
    if (callback || level <= TL_LOG_WARN) {
        char text[TL_LOG_MESSAGE_MAX];
        va_list args;
        va_start(args, fmt);
        vsnprintf(text, sizeof text, fmt, args);   /* truncates, always NUL-terminates */
        va_end(args);
        if (callback)
            callback(level, text, callback_data);
        else
            keep(level, text);
    }
    pthread_rwlock_unlock(&callback_lock);
}
