/*
 * workpool: a bounded pool of worker threads for averaging's arithmetic.
 *
 * The loop thread hands a job to the pool; a worker runs its work function,
 * and the job's done function then runs on the loop thread (through one
 * uv_async), so the loop only moves buffers and timers while the reduction
 * and the chunk coding of a round run elsewhere (docs/architecture.md,
 * "Threading"). The pool is its own rather than libuv's threadpool: that one
 * is shared with file and DNS work (tensor files, resolving), is sized by an
 * environment variable for the whole process, and has no bound on its queue.
 *
 * Rules: a work function touches only what its job owns (never loop-owned
 * structures); hm_workpool_submit refuses with -EAGAIN when the queue is
 * full, so the caller decides what back-pressure means (allreduce computes
 * that chunk on the loop, as before); every submitted job's done function
 * runs exactly once, on the loop, with cancelled = 1 when the pool closed
 * before it ran.
 */
#ifndef HM_AVERAGING_WORKPOOL_H
#define HM_AVERAGING_WORKPOOL_H

#include <stddef.h>
#include <uv.h>

/* Workers at most, whatever the machine. */
#define HM_WORKPOOL_MAX_THREADS 16u

typedef struct hm_work hm_work;
typedef void (*hm_work_fn)(hm_work *w);
typedef void (*hm_work_done_fn)(hm_work *w, int cancelled);

struct hm_work {
    hm_work *next; /* the pool's */
    hm_work_fn work;
    hm_work_done_fn done;
};

typedef struct hm_workpool hm_workpool;

/* Threads for a machine: its cores less the loop's, 1 to 8. */
unsigned hm_workpool_default_threads(void);

/* threads 1..HM_WORKPOOL_MAX_THREADS, queue_max >= 1 jobs waiting or running. */
int hm_workpool_new(uv_loop_t *loop, unsigned threads, size_t queue_max, hm_workpool **out);

/* 0, -EAGAIN (queue full), -ESHUTDOWN (closing). On failure done never runs. */
int hm_workpool_submit(hm_workpool *p, hm_work *w);

/* Jobs submitted and not yet handed back. */
size_t hm_workpool_pending(const hm_workpool *p);
unsigned hm_workpool_threads(const hm_workpool *p);

/*
 * Stops the workers (a job running finishes; jobs still queued do not
 * run), joins them, then runs every job's done on the loop thread from
 * inside this call (cancelled for those that never ran) and frees the
 * pool once its async handle is closed. Blocks the loop at most for the
 * jobs that are running.
 */
void hm_workpool_close(hm_workpool *p);

#endif
