/*
 * daemon: what hivemindd.c shares with the other source files of the
 * hivemindd program (such as daemon_moe.c, the experts.* commands). It
 * exposes the daemon's shared-memory registry (shm.h) and the one parser of
 * the shared-memory tensor references that commands take in their args.
 *
 * A shared-memory tensor reference is a JSON object
 *
 *     {"shm": ID, "offset": BYTES, "elems": N}
 *
 * naming N float32 values at byte offset BYTES (a multiple of 4; 0 when
 * absent) of a segment that a client allocated with "shm.alloc". Any
 * connection may name any live segment (a trainer's background rounds run
 * on a second connection), so the id is the capability; segment ids are
 * random 53-bit numbers (exact as JSON numbers everywhere), so a stale id
 * practically never names a newer segment.
 *
 * Loop thread only, like everything in the daemon.
 */
#ifndef HM_DAEMON_H
#define HM_DAEMON_H

#include "src/daemon/control.h"
#include "src/daemon/shm.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

struct daemon;

/* The daemon's shared-memory registry; NULL once it is shutting down. */
hm_shm *hm_daemon_shm(struct daemon *d);

/*
 * Validates the reference ref (args.<what>; what names it in the error
 * message) and pins its range (hm_shm_get). elems > 0 is the number of
 * floats the command needs: the reference's "elems" must equal it (or be
 * absent). On success *ptr_out points at the floats and *id_out holds the
 * segment id: call hm_shm_put(shm, *id_out) once done with the range (the
 * memory stays mapped until then even if the segment is freed or its owner
 * disconnects). On error the function has already answered req with a
 * "bad_args" error (or "stopping" when shm is NULL) and returns a negative
 * code: -EINVAL (malformed or a count mismatch), -ENOENT (no such segment,
 * or freed), -ERANGE (outside the segment) or -ESHUTDOWN.
 */
int hm_daemon_shm_ref(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                      size_t elems, float **ptr_out, uint64_t *id_out);

/*
 * The same for a reference whose size the command takes from it: "elems"
 * is required (1 to max_elems) and *elems_out gets it.
 */
int hm_daemon_shm_ref_any(hm_shm *shm, hm_control_req *req, const json_t *ref, const char *what,
                          size_t max_elems, float **ptr_out, uint64_t *id_out,
                          size_t *elems_out);

/* ---- argument checks shared by the command files (daemon_args.c) ---- */

/* Answers req with result, or with an "internal" error when it is NULL
 * (a failed json_pack). */
void hm_daemon_reply(hm_control_req *req, json_t *result);
/* args.name as seconds in (0, max], def when absent; -1 when bad (replied). */
double hm_daemon_arg_seconds(hm_control_req *req, const json_t *args, const char *name,
                             double def, double max);
/* args.name as an integer in [lo, hi], def when absent (def < 0: the
 * argument is required); -1 when bad (replied). */
long long hm_daemon_arg_int(hm_control_req *req, const json_t *args, const char *name,
                            long long def, long long lo, long long hi);
/* args.name as an absolute path of less than PATH_MAX bytes, copied into
 * out (PATH_MAX bytes); -1 when bad (replied). */
int hm_daemon_arg_path(hm_control_req *req, const json_t *args, const char *name, char *out);

#endif
