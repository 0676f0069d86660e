/* Thread pool with spin-then-sleep workers and a spinning barrier.
 *
 * Between jobs a worker spins briefly (a decode step follows the previous one within a fraction of
 * a millisecond), then sleeps on a condition variable so an idle server uses no CPU. Barrier waits
 * yield the core after a while, because on a machine with as many threads as cores another process
 * can hold the core the partner thread needs. */
#define _GNU_SOURCE
#include "sk_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

enum { IDLE_SPIN_NS = 200000, BARRIER_SPINS_BEFORE_YIELD = 20000 };

struct sk_pool {
    int n;
    pthread_t *threads;
    sk_job_fn fn;
    void *arg;
    atomic_int job;
    atomic_int done;
    atomic_int quit;
    atomic_int bar_count;
    atomic_int bar_gen;
    atomic_int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t run_mu; /* one job at a time: contexts made over another share its pool */
};

typedef struct {
    sk_pool *p;
    int ith;
} worker_arg;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *worker(void *raw) {
    worker_arg wa = *(worker_arg *)raw;
    free(raw);
    sk_pool *p = wa.p;
    int seen = 0;
    for (;;) {
        int64_t t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&p->job, memory_order_acquire) == seen && !atomic_load(&p->quit)) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() - t0 > IDLE_SPIN_NS) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->sleepers, 1);
                while (atomic_load(&p->job) == seen && !atomic_load(&p->quit)) pthread_cond_wait(&p->cv, &p->mu);
                atomic_fetch_sub(&p->sleepers, 1);
                pthread_mutex_unlock(&p->mu);
            }
        }
        if (atomic_load(&p->quit)) return NULL;
        seen = atomic_load_explicit(&p->job, memory_order_acquire);
        p->fn(p->arg, wa.ith, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

sk_pool *sk_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    sk_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_mutex_init(&p->run_mu, NULL);
    p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!p->threads) { free(p); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { p->n = i; break; }
        wa->p = p;
        wa->ith = i;
        if (pthread_create(&p->threads[i], NULL, worker, wa) != 0) { free(wa); p->n = i; break; }
    }
    return p;
}

void sk_pool_free(sk_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->run_mu);
    free(p->threads);
    free(p);
}

int sk_pool_size(const sk_pool *p) { return p->n; }

void sk_pool_run(sk_pool *p, sk_job_fn fn, void *arg) {
    pthread_mutex_lock(&p->run_mu);
    if (p->n == 1) {
        fn(arg, 0, 1);
        pthread_mutex_unlock(&p->run_mu);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->done, 0);
    atomic_store(&p->bar_count, 0);
    atomic_fetch_add(&p->job, 1); /* seq_cst: pairs with the sleepers check below */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    fn(arg, 0, p->n);
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->n - 1) {
        cpu_relax();
        if (++spins > BARRIER_SPINS_BEFORE_YIELD) sched_yield();
    }
    pthread_mutex_unlock(&p->run_mu);
}

void sk_pool_barrier(sk_pool *p) {
    if (p->n == 1) return;
    int gen = atomic_load_explicit(&p->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) == p->n - 1) {
        atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&p->bar_gen, 1, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&p->bar_gen, memory_order_acquire) == gen) {
        cpu_relax();
        if (++spins > BARRIER_SPINS_BEFORE_YIELD) sched_yield();
    }
}
