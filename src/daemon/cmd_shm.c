/*
 * cmd_shm: shared memory with the trainers (shm.h, daemon.h): the
 * "shm.alloc" and "shm.free" commands, the release of a connection's
 * segments when it closes, and the one parser of the shared-memory
 * references that other command groups take (hm_daemon_shm_ref). The
 * registry itself belongs to main.c, which frees it after the loop, when
 * nothing pins a segment any more.
 */
#include "config.h"

#include "src/daemon/daemon.h"
#include "src/base/util.h"

#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

hm_shm *hm_daemon_shm(const hm_daemon *d) { return d->stopping ? NULL : d->shm; }

/* args.<what>.<name> as an integer in [lo, hi], or def when absent (-1: required). */
static int ref_uint(hm_control_req *req, const json_t *ref, const char *what, const char *name,
                    int64_t def, int64_t lo, int64_t hi, uint64_t *out)
{
    const json_t *v = json_object_get(ref, name);
    char msg[160];
    if (v == NULL && def >= 0) {
        *out = (uint64_t)def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(msg, sizeof(msg), "args.%s.%s must be an integer from %lld to %lld", what, name,
                 (long long)lo, (long long)hi);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

/* The one parser of shared-memory references: elems > 0 fixes the count,
 * 0 takes it from the reference (1..max_elems). */
static int shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                   size_t elems, size_t max_elems, float **ptr_out, uint64_t *id_out,
                   size_t *elems_out)
{
    char msg[256];
    uint64_t id, offset, n;
    void *p;
    if (shm == NULL) {
        hm_daemon_reply_stopping(req);
        return -ESHUTDOWN;
    }
    if (!json_is_object(ref)) {
        snprintf(msg, sizeof(msg),
                 "args.%s must be a shared-memory reference {\"shm\": ID, \"offset\": BYTES, "
                 "\"elems\": N}", what);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    if (ref_uint(req, ref, what, "shm", -1, 1, (int64_t)1 << 53, &id) < 0 ||
        ref_uint(req, ref, what, "offset", 0, 0, INT64_MAX, &offset) < 0 ||
        ref_uint(req, ref, what, "elems", elems > 0 ? (int64_t)elems : -1, 1,
                 (int64_t)(elems > 0 ? elems : max_elems), &n) < 0)
        return -EINVAL;
    if (elems > 0 && n != elems) {
        snprintf(msg, sizeof(msg), "args.%s.elems is %llu but the command needs %zu floats",
                 what, (unsigned long long)n, elems);
        hm_control_reply_error(req, "bad_args", msg);
        return -EINVAL;
    }
    int r = hm_shm_get(shm, id, offset, n * sizeof(float), &p);
    if (r == -ENOENT) {
        snprintf(msg, sizeof(msg), "args.%s: no shared-memory segment %llu (never allocated, "
                 "or freed)", what, (unsigned long long)id);
        hm_control_reply_error(req, "bad_args", msg);
        return r;
    }
    if (r != 0) {
        snprintf(msg, sizeof(msg), "args.%s: %llu floats at byte offset %llu do not fit in "
                 "segment %llu (or the offset is not a multiple of 4)", what,
                 (unsigned long long)n, (unsigned long long)offset, (unsigned long long)id);
        hm_control_reply_error(req, "bad_args", msg);
        return r;
    }
    *ptr_out = p;
    *id_out = id;
    if (elems_out != NULL)
        *elems_out = (size_t)n;
    return 0;
}

int hm_daemon_shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                      size_t elems, float **ptr_out, uint64_t *id_out)
{
    if (elems == 0) {
        hm_control_reply_error(req, "bad_args", "a tensor of no elements");
        return -EINVAL;
    }
    return shm_ref(shm, req, ref, what, elems, elems, ptr_out, id_out, NULL);
}

int hm_daemon_shm_ref_any(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                          size_t max_elems, float **ptr_out, uint64_t *id_out, size_t *elems_out)
{
    return shm_ref(shm, req, ref, what, 0, max_elems, ptr_out, id_out, elems_out);
}

static void cmd_shm_alloc(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    hm_shm *shm = hm_daemon_shm(d);
    const json_t *v = json_object_get(args, "bytes");
    char name[HM_SHM_NAME_MAX], msg[256];
    uint64_t id;
    if (shm == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        hm_control_reply_error(req, "bad_args", "args.bytes must be a positive integer");
        return;
    }
    size_t bytes = (size_t)json_integer_value(v);
    int r = hm_shm_alloc(shm, hm_control_req_client(req), bytes, &id, name);
    if (r != 0) {
        size_t segs, total;
        hm_shm_stats(shm, &segs, &total);
        if (r == -ENOBUFS)
            snprintf(msg, sizeof(msg), "cannot allocate %zu bytes of shared memory: over the "
                     "daemon's bounds (%zu segments of %zu bytes are in use)", bytes, segs, total);
        else
            snprintf(msg, sizeof(msg), "cannot allocate %zu bytes of shared memory: %s", bytes,
                     strerror(-r));
        hm_control_reply_error(req, r == -ENOBUFS ? "limit" : r == -ENOSPC ? "no_space"
                                                                        : "internal", msg);
        return;
    }
    hm_daemon_reply(req, json_pack("{s:I, s:s, s:I}", "shm", (json_int_t)id, "name", name, "bytes",
                                 (json_int_t)bytes));
}

static void cmd_shm_free(void *ud, hm_control_req *req, const json_t *args)
{
    hm_daemon *d = ud;
    hm_shm *shm = hm_daemon_shm(d);
    const json_t *v = json_object_get(args, "shm");
    char msg[160];
    if (shm == NULL) {
        hm_daemon_reply_stopping(req);
        return;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1) {
        hm_control_reply_error(req, "bad_args", "args.shm must be a segment id");
        return;
    }
    uint64_t id = (uint64_t)json_integer_value(v);
    int r = hm_shm_release(shm, hm_control_req_client(req), id);
    if (r == -ENOENT) {
        snprintf(msg, sizeof(msg), "no shared-memory segment %llu (never allocated, or freed)",
                 (unsigned long long)id);
        hm_control_reply_error(req, "not_found", msg);
        return;
    }
    if (r == -EPERM) {
        snprintf(msg, sizeof(msg), "segment %llu belongs to another connection",
                 (unsigned long long)id);
        hm_control_reply_error(req, "not_owner", msg);
        return;
    }
    hm_daemon_reply(req, json_object());
}

/* A control connection closed: its segments go (pinned ones at their last put). */
static void on_conn_closed(void *ud, uint64_t conn_id)
{
    hm_daemon *d = ud;
    if (d->shm != NULL)
        hm_shm_release_owner(d->shm, conn_id);
}

/* A connection that holds segments is a trainer between rounds: closing it
 * for idleness would release its buffers, so it never idles out. */
static int conn_holds_shm(void *ud, uint64_t conn_id)
{
    hm_daemon *d = ud;
    return d->shm != NULL && hm_shm_owned(d->shm, conn_id) > 0;
}

int hm_cmd_shm_register(hm_daemon *d, hm_control *ctl, char *err, size_t errlen)
{
    int r;
    if ((r = hm_control_register(ctl, "shm.alloc", cmd_shm_alloc, d)) != 0 ||
        (r = hm_control_register(ctl, "shm.free", cmd_shm_free, d)) != 0) {
        snprintf(err, errlen, "cannot register the shared-memory commands: %s", hm_strerror(r));
        return r;
    }
    hm_control_set_close_cb(ctl, on_conn_closed, d);
    hm_control_set_idle_check(ctl, conn_holds_shm, d);
    return 0;
}
