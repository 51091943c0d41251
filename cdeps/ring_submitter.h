/* A thread that submits what the caller queue's ring has published (Note [submitter] in
 * pyx/_queues.pyx, on io_uring; Note [engines] in nvmeswap/io/engines.py).
 *
 * The caller writes and publishes its entries, then counts a post under a mutex and goes
 * on; the thread enters the kernel with every entry published and not yet taken, many
 * in one io_uring_enter when they come faster than it submits. The kernel's refusal of
 * a request is a completion like any other, so unlike cdeps/submitter.h the thread keeps
 * no failures: a failure of the ring itself (an enter that is neither interrupted nor
 * short of resources) is kept for the caller to raise. After its last enter the thread
 * polls for new posts a short while before it sleeps, yielding its CPU while it polls
 * (as cdeps/submitter.h does, and for its reasons).
 */
#ifndef NVMESWAP_RING_SUBMITTER_H
#define NVMESWAP_RING_SUBMITTER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE     /* pthread_setname_np */
#endif

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "io_uring.h"

/* How long the thread looks for new posts before it sleeps. */
#define NVMESWAP_RING_SUBMITTER_POLL_NS 100000L

typedef struct {
    nvmeswap_uring *ring;       /* the caller's: the thread reads only the kernel's ends */
    pthread_mutex_t lock;
    pthread_cond_t work;        /* posted, or stop */
    unsigned posted;            /* posts the thread has not seen */
    long error;                 /* -errno of a failed enter, not yet taken */
    int sleeping;
    int stopping;
    pthread_t thread;
} nvmeswap_ring_submitter;

static inline long nvmeswap_ring_elapsed_ns(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000000000L + (now.tv_nsec - since->tv_nsec);
}

/* Enter the kernel with what is published and not taken; 0 or -errno. A kernel short of
 * resources takes them at a later enter (the reaper's). Unlocked: only reads the ring. */
static long nvmeswap_ring_submit_published(nvmeswap_uring *ring)
{
    unsigned pending;
    while ((pending = nvmeswap_uring_unsubmitted(ring)) != 0) {
        long ret = nvmeswap_io_uring_enter(ring->fd, pending, 0, 0);
        if (ret == -EAGAIN || ret == -EBUSY || ret == 0)
            return 0;
        if (ret < 0 && ret != -EINTR)
            return ret;
    }
    return 0;
}

static void *nvmeswap_ring_submitter_main(void *arg)
{
    nvmeswap_ring_submitter *s = (nvmeswap_ring_submitter *)arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        if (s->posted == 0 && !s->stopping) {
            struct timespec since;
            clock_gettime(CLOCK_MONOTONIC, &since);
            pthread_mutex_unlock(&s->lock);
            while (!__atomic_load_n(&s->posted, __ATOMIC_ACQUIRE)
                   && !__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)
                   && nvmeswap_ring_elapsed_ns(&since) < NVMESWAP_RING_SUBMITTER_POLL_NS)
                sched_yield();
            pthread_mutex_lock(&s->lock);
            while (s->posted == 0 && !s->stopping) {
                s->sleeping = 1;
                pthread_cond_wait(&s->work, &s->lock);
                s->sleeping = 0;
            }
        }
        if (s->posted == 0)
            break;      /* stopping, and everything posted has been submitted */
        __atomic_store_n(&s->posted, 0, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&s->lock);
        long ret = nvmeswap_ring_submit_published(s->ring);
        pthread_mutex_lock(&s->lock);
        if (ret < 0 && !s->error)
            s->error = ret;
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* Make the submitter and start its thread; NULL if either fails (the caller then submits
 * itself). */
static inline nvmeswap_ring_submitter *nvmeswap_ring_submitter_start(nvmeswap_uring *ring)
{
    nvmeswap_ring_submitter *s = (nvmeswap_ring_submitter *)calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ring = ring;
    if (pthread_mutex_init(&s->lock, NULL) == 0) {
        if (pthread_cond_init(&s->work, NULL) == 0) {
            if (pthread_create(&s->thread, NULL, nvmeswap_ring_submitter_main, s) == 0) {
                pthread_setname_np(s->thread, "nvmeswap-submit");
                return s;
            }
            pthread_cond_destroy(&s->work);
        }
        pthread_mutex_destroy(&s->lock);
    }
    free(s);
    return NULL;
}

/* The entries published so far are the thread's to submit. */
static inline void nvmeswap_ring_submitter_post(nvmeswap_ring_submitter *s)
{
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->posted, s->posted + 1, __ATOMIC_RELEASE);
    if (s->sleeping)
        pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->lock);
}

/* The -errno of an enter that failed in the thread, if any (then forgotten); else 0. */
static inline long nvmeswap_ring_submitter_take_error(nvmeswap_ring_submitter *s)
{
    pthread_mutex_lock(&s->lock);
    long error = s->error;
    s->error = 0;
    pthread_mutex_unlock(&s->lock);
    return error;
}

/* Submit what is posted, end the thread and free the submitter. */
static inline void nvmeswap_ring_submitter_stop(nvmeswap_ring_submitter *s)
{
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->work);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

#endif
