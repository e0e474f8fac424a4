/* workpool: see workpool.h. */
#include "averaging/workpool.h"

#include <errno.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

struct hm_workpool {
    uv_loop_t *loop;
    uv_async_t async;
    uv_mutex_t mu;
    uv_cond_t cv;
    uv_thread_t th[HM_WORKPOOL_MAX_THREADS];
    unsigned n_threads;
    size_t queue_max;
    size_t pending; /* submitted, done not yet run (loop thread only) */
    hm_work *q_head, *q_tail;       /* waiting for a worker (under mu) */
    hm_work *done_head, *done_tail; /* ran, done not yet run (under mu) */
    size_t n_busy;                  /* queued or running (under mu) */
    int stop;
};

unsigned hm_workpool_default_threads(void)
{
    unsigned n = uv_available_parallelism();
    n = n > 1 ? n - 1 : 1;
    return n > 8 ? 8 : n;
}

static void push(hm_work **head, hm_work **tail, hm_work *w)
{
    w->next = NULL;
    if (*tail != NULL)
        (*tail)->next = w;
    else
        *head = w;
    *tail = w;
}

static hm_work *pop(hm_work **head, hm_work **tail)
{
    hm_work *w = *head;
    if (w != NULL) {
        *head = w->next;
        if (*head == NULL)
            *tail = NULL;
        w->next = NULL;
    }
    return w;
}

static void worker(void *arg)
{
    hm_workpool *p = arg;
#ifdef __linux__
    /* What `top -H` and /proc/PID/task/TID/comm show. */
    (void)prctl(PR_SET_NAME, "hm-avg", 0, 0, 0);
#endif
    uv_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->q_head == NULL)
            uv_cond_wait(&p->cv, &p->mu);
        if (p->stop)
            break;
        hm_work *w = pop(&p->q_head, &p->q_tail);
        uv_mutex_unlock(&p->mu);
        w->work(w);
        uv_mutex_lock(&p->mu);
        push(&p->done_head, &p->done_tail, w);
        p->n_busy--;
        uv_async_send(&p->async);
    }
    uv_mutex_unlock(&p->mu);
}

/* Runs the done functions of finished jobs; on the loop thread. */
static void drain(hm_workpool *p, int cancelled)
{
    for (;;) {
        uv_mutex_lock(&p->mu);
        hm_work *w = pop(&p->done_head, &p->done_tail);
        int from_queue = 0;
        if (w == NULL && cancelled) {
            w = pop(&p->q_head, &p->q_tail);
            from_queue = w != NULL;
        }
        uv_mutex_unlock(&p->mu);
        if (w == NULL)
            return;
        p->pending--;
        w->done(w, from_queue);
    }
}

static void on_async(uv_async_t *a) { drain(a->data, 0); }

static void closed(uv_handle_t *h) { free(h->data); }

int hm_workpool_new(uv_loop_t *loop, unsigned threads, size_t queue_max, hm_workpool **out)
{
    *out = NULL;
    if (threads == 0 || threads > HM_WORKPOOL_MAX_THREADS || queue_max == 0)
        return -EINVAL;
    hm_workpool *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return -ENOMEM;
    p->loop = loop;
    p->queue_max = queue_max;
    int rc = uv_mutex_init(&p->mu);
    if (rc < 0)
        goto fail_mu;
    if ((rc = uv_cond_init(&p->cv)) < 0)
        goto fail_cv;
    if ((rc = uv_async_init(loop, &p->async, on_async)) < 0)
        goto fail_async;
    p->async.data = p;
    for (unsigned i = 0; i < threads; i++) {
        if ((rc = uv_thread_create(&p->th[i], worker, p)) < 0)
            break;
        p->n_threads++;
    }
    if (p->n_threads == 0) {
        uv_cond_destroy(&p->cv);
        uv_mutex_destroy(&p->mu);
        uv_close((uv_handle_t *)&p->async, closed); /* frees p */
        return rc;
    }
    *out = p;
    return 0;
fail_async:
    uv_cond_destroy(&p->cv);
fail_cv:
    uv_mutex_destroy(&p->mu);
fail_mu:
    free(p);
    return rc;
}

int hm_workpool_submit(hm_workpool *p, hm_work *w)
{
    int rc = 0;
    uv_mutex_lock(&p->mu);
    if (p->stop)
        rc = -ESHUTDOWN;
    else if (p->n_busy >= p->queue_max)
        rc = -EAGAIN;
    if (rc == 0) {
        push(&p->q_head, &p->q_tail, w);
        p->n_busy++;
        uv_cond_signal(&p->cv);
    }
    uv_mutex_unlock(&p->mu);
    if (rc == 0)
        p->pending++;
    return rc;
}

size_t hm_workpool_pending(const hm_workpool *p) { return p->pending; }
unsigned hm_workpool_threads(const hm_workpool *p) { return p->n_threads; }

void hm_workpool_close(hm_workpool *p)
{
    if (p == NULL)
        return;
    uv_mutex_lock(&p->mu);
    p->stop = 1;
    uv_cond_broadcast(&p->cv);
    uv_mutex_unlock(&p->mu);
    for (unsigned i = 0; i < p->n_threads; i++)
        uv_thread_join(&p->th[i]);
    drain(p, 1);
    uv_cond_destroy(&p->cv);
    uv_mutex_destroy(&p->mu);
    uv_close((uv_handle_t *)&p->async, closed);
}
