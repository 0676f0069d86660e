/* A fixed pool of threads that all run one function per job and meet at barriers inside it
 * (one wake-up per forward pass, not one per operation). */
#ifndef SK_POOL_H
#define SK_POOL_H

typedef struct sk_pool sk_pool;
typedef void (*sk_job_fn)(void *arg, int ith, int nth);

sk_pool *sk_pool_new(int n_threads);
void sk_pool_free(sk_pool *p);
int sk_pool_size(const sk_pool *p);
/* Run fn(arg, i, n) on every thread (the caller is thread 0) and return when all have finished; a
 * second caller waits for the running job. */
void sk_pool_run(sk_pool *p, sk_job_fn fn, void *arg);
/* Called by every thread of a job: returns once all of them have arrived. */
void sk_pool_barrier(sk_pool *p);

#endif
