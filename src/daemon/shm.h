/*
 * shm: shared-memory buffers between hivemindd and the trainers on the same
 * machine (the client library, lib/hivemind.h). Tensors go through these,
 * never through the control socket.
 *
 * The daemon creates every segment (POSIX shm, shm_open with O_EXCL, mode
 * 0600, or 0660 for the control socket's group, a random name
 * "/hivemindd-PID-RANDOM"), sizes it with ftruncate
 * and maps it; the client opens the name, maps it and unlinks it (the
 * registry unlinks it too when it frees the segment, ignoring ENOENT).
 * Because the daemon sized the segment and never maps a client-chosen
 * object, a client cannot make it read past a mapping.
 *
 * Each segment belongs to the control connection that allocated it (its
 * owner) and is freed by hm_shm_release or when that connection closes
 * (hm_shm_release_owner), but any connection may name it: a trainer's
 * background rounds run on a second connection. A command that uses a
 * segment pins the byte range it works on (hm_shm_get) until it is done
 * (hm_shm_put), so a segment released or orphaned meanwhile stays mapped
 * until its last pin goes.
 *
 * Bounds: one segment is at most max_segment_bytes; all segments together
 * at most max_total_bytes (-ENOBUFS past it); at most HM_SHM_MAX_SEGMENTS.
 * Loop thread only.
 */
#ifndef HM_SHM_H
#define HM_SHM_H

#include <stddef.h>
#include <stdint.h>

typedef struct hm_shm hm_shm;

#define HM_SHM_NAME_MAX 64
#define HM_SHM_MAX_SEGMENTS 1024

typedef struct hm_shm_config {
    size_t max_segment_bytes; /* 0: 4 GiB */
    size_t max_total_bytes;   /* 0: 16 GiB */
    /* Nonzero: segments are mode 0660 and belong to group_gid, the control
     * socket's group, so a trainer in that group maps them (the group may
     * command the daemon anyway). Zero: 0600, the daemon's user only. */
    int group_access;
    unsigned group_gid;
} hm_shm_config;

int hm_shm_new(const hm_shm_config *cfg, hm_shm **shm_out);
/* Unmaps and unlinks every segment, pinned or not (daemon exit). */
void hm_shm_free(hm_shm *s);

/*
 * A new zero-filled segment of bytes (1..max_segment_bytes) owned by owner.
 * id_out gets its id (never 0), name_out its shm name. 0, -EINVAL,
 * -ENOBUFS (over a bound) or -errno of shm_open/ftruncate/mmap.
 */
int hm_shm_alloc(hm_shm *s, uint64_t owner, size_t bytes, uint64_t *id_out,
                 char name_out[HM_SHM_NAME_MAX]);
/* Frees a segment now or at its last hm_shm_put. 0, -ENOENT, -EPERM (not
 * the owner's). */
int hm_shm_release(hm_shm *s, uint64_t owner, uint64_t id);
/* Releases every segment of a connection that closed. */
void hm_shm_release_owner(hm_shm *s, uint64_t owner);

/*
 * Pins [offset, offset + bytes) of segment id and points *ptr_out at it.
 * 0, -ENOENT (no such segment, or released), -ERANGE (outside the segment,
 * or offset not a multiple of 4). Each successful get needs one put.
 */
int hm_shm_get(hm_shm *s, uint64_t id, uint64_t offset, uint64_t bytes, void **ptr_out);
void hm_shm_put(hm_shm *s, uint64_t id);

/*
 * Segments that owner holds (allocated and not released). The control
 * server asks it before idle-closing a connection (hivemindd), since
 * closing one releases its segments.
 */
size_t hm_shm_owned(const hm_shm *s, uint64_t owner);

/* For status: segments and bytes mapped. */
void hm_shm_stats(const hm_shm *s, size_t *segments_out, size_t *bytes_out);

#endif
