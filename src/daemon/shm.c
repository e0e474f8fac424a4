/*
 * shm: the daemon's registry of shared-memory segments (see shm.h). It owns
 * every segment's mapping and name; the clients only map what the daemon
 * created and sized.
 *
 * Segments are reserved with posix_fallocate where the file system offers
 * it, so that a full /dev/shm is a clear -ENOSPC at allocation rather than
 * a SIGBUS later, when the daemon writes an averaged tensor into a page
 * that tmpfs can no longer back. A client that shrinks the object on
 * purpose (ftruncate on its own descriptor) can still make the daemon fault;
 * POSIX shared memory has no seals, and whoever may use the control socket
 * can stop the daemon anyway, so this is no new power.
 *
 * A small array of segments is searched linearly: there are at most
 * HM_SHM_MAX_SEGMENTS and every lookup is one command's worth of work.
 */
#include "config.h"

#include "src/daemon/shm.h"
#include "src/base/util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define MOD "shm"
#define DEFAULT_MAX_SEGMENT ((size_t)4 << 30)
#define DEFAULT_MAX_TOTAL ((size_t)16 << 30)
/* Ids stay below 2^53 so that every JSON reader holds them exactly. */
#define ID_MASK ((UINT64_C(1) << 53) - 1)

typedef struct seg {
    uint64_t id, owner;
    char name[HM_SHM_NAME_MAX];
    size_t bytes;
    void *map;
    size_t pins;
    int released; /* freed by its owner; unmapped at the last put */
} seg;

struct hm_shm {
    size_t max_segment, max_total;
    int group_access;
    gid_t gid;
    size_t total; /* bytes mapped, released-but-pinned segments included */
    size_t n;
    seg *segs[HM_SHM_MAX_SEGMENTS];
};

int hm_shm_new(const hm_shm_config *cfg, hm_shm **shm_out)
{
    hm_shm *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return -ENOMEM;
    s->max_segment = cfg != NULL && cfg->max_segment_bytes ? cfg->max_segment_bytes
                                                           : DEFAULT_MAX_SEGMENT;
    s->max_total = cfg != NULL && cfg->max_total_bytes ? cfg->max_total_bytes : DEFAULT_MAX_TOTAL;
    s->group_access = cfg != NULL && cfg->group_access;
    s->gid = cfg != NULL ? (gid_t)cfg->group_gid : 0;
    *shm_out = s;
    return 0;
}

/* Unmaps, unlinks (unless done already) and forgets segs[i]. */
static void destroy_at(hm_shm *s, size_t i)
{
    seg *g = s->segs[i];
    if (!g->released && shm_unlink(g->name) != 0 && errno != ENOENT)
        hm_warn(MOD, "cannot unlink %s: %s", g->name, strerror(errno));
    munmap(g->map, g->bytes);
    s->total -= g->bytes;
    s->segs[i] = s->segs[--s->n];
    s->segs[s->n] = NULL;
    free(g);
}

void hm_shm_free(hm_shm *s)
{
    if (s == NULL)
        return;
    while (s->n > 0)
        destroy_at(s, s->n - 1);
    free(s);
}

static size_t find(const hm_shm *s, uint64_t id)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->segs[i]->id == id)
            return i;
    return SIZE_MAX;
}

static int random_u64(uint64_t *out)
{
    size_t got = 0;
    while (got < sizeof(*out)) {
        ssize_t r = getrandom((char *)out + got, sizeof(*out) - got, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -errno;
        got += (size_t)r;
    }
    return 0;
}

int hm_shm_alloc(hm_shm *s, uint64_t owner, size_t bytes, uint64_t *id_out,
                 char name_out[HM_SHM_NAME_MAX])
{
    seg *g = NULL;
    int fd = -1, result = 0;
    uint64_t rnd;

    if (bytes == 0)
        return -EINVAL;
    if (bytes > s->max_segment || bytes > s->max_total - s->total ||
        s->n >= HM_SHM_MAX_SEGMENTS)
        return -ENOBUFS;
    g = calloc(1, sizeof(*g));
    if (g == NULL)
        return -ENOMEM;
    do {
        result = random_u64(&rnd);
        if (result != 0)
            goto out;
        g->id = rnd & ID_MASK;
    } while (g->id == 0 || find(s, g->id) != SIZE_MAX);
    g->owner = owner;
    g->bytes = bytes;
    /* A fresh random name per try: O_EXCL refuses a name that exists, so a
     * segment is never one somebody else prepared. */
    for (int tries = 0; fd < 0; tries++) {
        result = random_u64(&rnd);
        if (result != 0)
            goto out;
        snprintf(g->name, sizeof(g->name), "/hivemindd-%ld-%016llx", (long)getpid(),
                 (unsigned long long)rnd);
        fd = shm_open(g->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && (errno != EEXIST || tries >= 8)) {
            result = -errno;
            goto out;
        }
    }
    /* fchmod after fchown: the mode is not subject to the umask. */
    if (s->group_access && (fchown(fd, (uid_t)-1, s->gid) != 0 || fchmod(fd, 0660) != 0)) {
        result = -errno;
        hm_warn(MOD, "cannot open a segment to group %u: %s", (unsigned)s->gid,
                strerror(errno));
        goto unlink;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        result = -errno;
        goto unlink;
    }
    int fr = posix_fallocate(fd, 0, (off_t)bytes);
    if (fr != 0 && fr != EOPNOTSUPP && fr != EINVAL) {
        result = -fr;
        goto unlink;
    }
    g->map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (g->map == MAP_FAILED) {
        g->map = NULL;
        result = -errno;
        goto unlink;
    }
    s->segs[s->n++] = g;
    s->total += bytes;
    *id_out = g->id;
    memcpy(name_out, g->name, HM_SHM_NAME_MAX);
    g = NULL;
    goto out;
unlink:
    shm_unlink(g->name);
out:
    if (fd >= 0)
        close(fd);
    free(g);
    return result;
}

int hm_shm_release(hm_shm *s, uint64_t owner, uint64_t id)
{
    size_t i = find(s, id);
    if (i == SIZE_MAX || s->segs[i]->released)
        return -ENOENT;
    seg *g = s->segs[i];
    if (g->owner != owner)
        return -EPERM;
    /* The name goes now, so no client maps a segment that is on its way out. */
    if (shm_unlink(g->name) != 0 && errno != ENOENT)
        hm_warn(MOD, "cannot unlink %s: %s", g->name, strerror(errno));
    g->released = 1;
    if (g->pins == 0)
        destroy_at(s, i);
    return 0;
}

void hm_shm_release_owner(hm_shm *s, uint64_t owner)
{
    /* Walk backwards: destroy_at moves the last segment into the hole. */
    for (size_t i = s->n; i-- > 0;) {
        seg *g = s->segs[i];
        if (g->owner == owner && !g->released)
            hm_shm_release(s, owner, g->id);
    }
}

int hm_shm_get(hm_shm *s, uint64_t id, uint64_t offset, uint64_t bytes, void **ptr_out)
{
    size_t i = find(s, id);
    if (i == SIZE_MAX || s->segs[i]->released)
        return -ENOENT;
    seg *g = s->segs[i];
    if ((offset % 4) != 0 || offset > g->bytes || bytes > g->bytes - offset)
        return -ERANGE;
    g->pins++;
    *ptr_out = (char *)g->map + offset;
    return 0;
}

void hm_shm_put(hm_shm *s, uint64_t id)
{
    size_t i = find(s, id);
    if (i == SIZE_MAX || s->segs[i]->pins == 0) {
        hm_warn(MOD, "unbalanced put of segment %llu", (unsigned long long)id);
        return;
    }
    seg *g = s->segs[i];
    if (--g->pins == 0 && g->released)
        destroy_at(s, i);
}

size_t hm_shm_owned(const hm_shm *s, uint64_t owner)
{
    size_t n = 0;
    for (size_t i = 0; i < s->n; i++)
        n += s->segs[i]->owner == owner && !s->segs[i]->released;
    return n;
}

void hm_shm_stats(const hm_shm *s, size_t *segments_out, size_t *bytes_out)
{
    if (segments_out != NULL)
        *segments_out = s->n;
    if (bytes_out != NULL)
        *bytes_out = s->total;
}
