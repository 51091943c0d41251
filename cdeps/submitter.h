/* A thread that hands the caller queue's requests to the kernel (Note [submitter] in
 * pyx/_queues.pyx).
 *
 * The caller posts a request under a mutex and goes on; the thread submits whatever has
 * been posted, many requests in one io_submit when they come faster than it submits. A
 * request the kernel refuses is kept as a failure (slot and errno) and the eventfd is
 * signalled, so that the thread reading completions finds it. After its last batch the
 * thread polls for new requests a short while before it sleeps: a burst of small
 * requests then never waits for a wake-up. It polls with sched_yield, not a pause
 * instruction: where it shares a CPU with the caller (2 cores and other work), spinning
 * kept the caller off that CPU while it held the mutex in a post, up to the whole poll
 * window (a post inside the handle: median 0.12 us, p99 125 us). The gain is small and
 * noisy on a shared 2-core machine: 4 KiB async reads through the handle, six paired
 * fresh processes (bench/small_async.py --contender nvmeswap), median 32.8k/s with the
 * pause instruction against 37.4k/s with sched_yield, 4 pairs of 6 faster.
 */
#ifndef NVMESWAP_SUBMITTER_H
#define NVMESWAP_SUBMITTER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE     /* pthread_setname_np */
#endif

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernel_aio.h"

/* How long the thread looks for new requests before it sleeps. */
#define NVMESWAP_SUBMITTER_POLL_NS 100000L

typedef struct {
    aio_context_t ctx;
    int eventfd;
    int capacity;
    pthread_mutex_t lock;
    pthread_cond_t work;        /* requests posted, or stop */
    pthread_cond_t drained;     /* nothing posted, nothing being submitted */
    struct iocb **posted;       /* waiting for the thread, oldest first */
    int n_posted;
    struct iocb **batch;        /* the thread's own: what it is submitting */
    int submitting;
    int *failed_slots;          /* refused by the kernel, not yet taken */
    int *failed_errnos;
    int n_failed;
    int *refused_slots;         /* the thread's own: refused in its current batch */
    int *refused_errnos;
    int sleeping;
    int stopping;
    pthread_t thread;
} nvmeswap_submitter;

static inline long nvmeswap_elapsed_ns(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* Submit the thread's batch of ``n``; what the kernel refuses goes to ``refused_*``.
 * Unlocked: only the thread touches its batch and its refusals. */
static int nvmeswap_submit_batch(nvmeswap_submitter *s, int n)
{
    int done = 0, n_refused = 0;
    while (done < n) {
        long ret = nvmeswap_io_submit(s->ctx, n - done, s->batch + done);
        if (ret > 0) {
            done += (int)ret;
        } else if (ret != -EINTR) {
            /* The first request not taken is the one refused; go on after it. */
            s->refused_slots[n_refused] = (int)s->batch[done]->aio_data;
            s->refused_errnos[n_refused++] = ret < 0 ? (int)-ret : EIO;
            done++;
        }
    }
    return n_refused;
}

static void *nvmeswap_submitter_main(void *arg)
{
    nvmeswap_submitter *s = (nvmeswap_submitter *)arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        if (s->n_posted == 0 && !s->stopping) {
            struct timespec since;
            clock_gettime(CLOCK_MONOTONIC, &since);
            pthread_mutex_unlock(&s->lock);
            while (!__atomic_load_n(&s->n_posted, __ATOMIC_ACQUIRE)
                   && !__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)
                   && nvmeswap_elapsed_ns(&since) < NVMESWAP_SUBMITTER_POLL_NS)
                sched_yield();
            pthread_mutex_lock(&s->lock);
            while (s->n_posted == 0 && !s->stopping) {
                s->sleeping = 1;
                pthread_cond_wait(&s->work, &s->lock);
                s->sleeping = 0;
            }
        }
        if (s->n_posted == 0)
            break;      /* stopping, and everything posted has been submitted */
        int n = s->n_posted;
        memcpy(s->batch, s->posted, sizeof(struct iocb *) * n);
        __atomic_store_n(&s->n_posted, 0, __ATOMIC_RELEASE);
        s->submitting = n;
        pthread_mutex_unlock(&s->lock);
        int n_refused = nvmeswap_submit_batch(s, n);
        pthread_mutex_lock(&s->lock);
        for (int i = 0; i < n_refused; i++) {
            s->failed_slots[s->n_failed] = s->refused_slots[i];
            s->failed_errnos[s->n_failed++] = s->refused_errnos[i];
        }
        s->submitting = 0;
        pthread_cond_broadcast(&s->drained);
        if (n_refused) {
            uint64_t one = 1;       /* wake the thread reading completions */
            ssize_t ignored = write(s->eventfd, &one, sizeof one);
            (void)ignored;
        }
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static void nvmeswap_submitter_free(nvmeswap_submitter *s)
{
    free(s->posted);
    free(s->batch);
    free(s->failed_slots);
    free(s->failed_errnos);
    free(s->refused_slots);
    free(s->refused_errnos);
    free(s);
}

/* Make the submitter and start its thread; NULL if either fails (the caller then submits
 * requests itself). */
static inline nvmeswap_submitter *nvmeswap_submitter_start(aio_context_t ctx, int eventfd,
                                                           int capacity)
{
    nvmeswap_submitter *s = (nvmeswap_submitter *)calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ctx = ctx;
    s->eventfd = eventfd;
    s->capacity = capacity;
    s->posted = (struct iocb **)malloc(sizeof(struct iocb *) * capacity);
    s->batch = (struct iocb **)malloc(sizeof(struct iocb *) * capacity);
    s->failed_slots = (int *)malloc(sizeof(int) * capacity);
    s->failed_errnos = (int *)malloc(sizeof(int) * capacity);
    s->refused_slots = (int *)malloc(sizeof(int) * capacity);
    s->refused_errnos = (int *)malloc(sizeof(int) * capacity);
    if (s->posted && s->batch && s->failed_slots && s->failed_errnos && s->refused_slots
            && s->refused_errnos && pthread_mutex_init(&s->lock, NULL) == 0) {
        if (pthread_cond_init(&s->work, NULL) == 0) {
            if (pthread_cond_init(&s->drained, NULL) == 0) {
                if (pthread_create(&s->thread, NULL, nvmeswap_submitter_main, s) == 0) {
                    /* Named here, not by the thread: the name is there on return. */
                    pthread_setname_np(s->thread, "nvmeswap-submit");
                    return s;
                }
                pthread_cond_destroy(&s->drained);
            }
            pthread_cond_destroy(&s->work);
        }
        pthread_mutex_destroy(&s->lock);
    }
    nvmeswap_submitter_free(s);
    return NULL;
}

/* Hand one request to the thread. */
static inline void nvmeswap_submitter_post(nvmeswap_submitter *s, struct iocb *cb)
{
    pthread_mutex_lock(&s->lock);
    s->posted[s->n_posted] = cb;
    __atomic_store_n(&s->n_posted, s->n_posted + 1, __ATOMIC_RELEASE);
    if (s->sleeping)
        pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->lock);
}

/* Wait until everything posted has been handed to the kernel or refused. */
static inline void nvmeswap_submitter_drain(nvmeswap_submitter *s)
{
    pthread_mutex_lock(&s->lock);
    while (s->n_posted || s->submitting)
        pthread_cond_wait(&s->drained, &s->lock);
    pthread_mutex_unlock(&s->lock);
}

/* Move the refusals recorded so far to ``slots`` and ``errnos``; how many. */
static inline int nvmeswap_submitter_take_failed(nvmeswap_submitter *s, int *slots,
                                                 int *errnos)
{
    pthread_mutex_lock(&s->lock);
    int n = s->n_failed;
    memcpy(slots, s->failed_slots, sizeof(int) * n);
    memcpy(errnos, s->failed_errnos, sizeof(int) * n);
    s->n_failed = 0;
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* Submit what is posted, end the thread and free the submitter. */
static inline void nvmeswap_submitter_stop(nvmeswap_submitter *s)
{
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->drained);
    pthread_cond_destroy(&s->work);
    pthread_mutex_destroy(&s->lock);
    nvmeswap_submitter_free(s);
}

#endif
