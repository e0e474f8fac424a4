/*
 * test_shm: the daemon's shared-memory registry (src/daemon/shm.h). Segments are
 * real POSIX shared memory: a client's view (shm_open on the name) sees
 * the daemon's bytes; bounds, pins, owners and totals behave as promised.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "src/daemon/shm.h"

static int name_exists(const char *name)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0)
        return 0;
    close(fd);
    return 1;
}

Test(shm, alloc_maps_zeroed_memory_the_client_sees)
{
    hm_shm *s;
    uint64_t id;
    char name[HM_SHM_NAME_MAX];
    void *p;
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 7, 4096, &id, name), 0);
    cr_assert_neq(id, 0);
    cr_assert(strncmp(name, "/hivemindd-", 11) == 0, "name %s", name);

    cr_assert_eq(hm_shm_get(s, id, 0, 4096, &p), 0);
    for (size_t i = 0; i < 4096; i++)
        cr_assert_eq(((unsigned char *)p)[i], 0);
    /* A client maps the same object and writes; the daemon reads it. */
    int fd = shm_open(name, O_RDWR, 0);
    cr_assert(fd >= 0, "shm_open %s: %s", name, strerror(errno));
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    cr_assert_eq(st.st_size, 4096);
    cr_assert_eq(st.st_mode & 0777, 0600);
    float *c = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    cr_assert_neq(c, MAP_FAILED);
    close(fd);
    c[3] = 2.5f;
    cr_assert_eq(((float *)p)[3], 2.5f);
    ((float *)p)[5] = -1.0f;
    cr_assert_eq(c[5], -1.0f);
    munmap(c, 4096);
    hm_shm_put(s, id);

    size_t segs, bytes;
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 1);
    cr_assert_eq(bytes, 4096);
    cr_assert_eq(hm_shm_release(s, 7, id), 0);
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 0);
    cr_assert_eq(bytes, 0);
    cr_assert_eq(name_exists(name), 0, "the name is unlinked on release");
    hm_shm_free(s);
}

Test(shm, get_checks_bounds_and_alignment)
{
    hm_shm *s;
    uint64_t id;
    char name[HM_SHM_NAME_MAX];
    void *p;
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 1, 1000, &id, name), 0);
    cr_assert_eq(hm_shm_get(s, id, 0, 1000, &p), 0);
    hm_shm_put(s, id);
    cr_assert_eq(hm_shm_get(s, id, 996, 4, &p), 0);
    hm_shm_put(s, id);
    cr_assert_eq(hm_shm_get(s, id, 0, 1001, &p), -ERANGE);
    cr_assert_eq(hm_shm_get(s, id, 1000, 4, &p), -ERANGE);
    cr_assert_eq(hm_shm_get(s, id, 2, 4, &p), -ERANGE, "offset not a multiple of 4");
    cr_assert_eq(hm_shm_get(s, id, UINT64_MAX - 3, 8, &p), -ERANGE, "no wraparound");
    cr_assert_eq(hm_shm_get(s, id, 4, UINT64_MAX, &p), -ERANGE);
    cr_assert_eq(hm_shm_get(s, id + 1, 0, 4, &p), -ENOENT);
    cr_assert_eq(hm_shm_get(s, 0, 0, 4, &p), -ENOENT);
    hm_shm_free(s);
}

Test(shm, alloc_bounds)
{
    hm_shm *s;
    uint64_t id[4];
    char name[HM_SHM_NAME_MAX];
    hm_shm_config cfg = {.max_segment_bytes = 8192, .max_total_bytes = 12288};
    cr_assert_eq(hm_shm_new(&cfg, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 1, 0, &id[0], name), -EINVAL);
    cr_assert_eq(hm_shm_alloc(s, 1, 8193, &id[0], name), -ENOBUFS);
    cr_assert_eq(hm_shm_alloc(s, 1, 8192, &id[0], name), 0);
    cr_assert_eq(hm_shm_alloc(s, 2, 4097, &id[1], name), -ENOBUFS, "over the total");
    cr_assert_eq(hm_shm_alloc(s, 2, 4096, &id[1], name), 0);
    cr_assert_neq(id[0], id[1]);
    size_t segs, bytes;
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 2);
    cr_assert_eq(bytes, 12288);
    cr_assert_eq(hm_shm_release(s, 1, id[0]), 0);
    cr_assert_eq(hm_shm_alloc(s, 2, 8192, &id[2], name), 0, "room again after a release");
    hm_shm_free(s);
}

Test(shm, segment_count_bound)
{
    hm_shm *s;
    uint64_t id;
    char name[HM_SHM_NAME_MAX];
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    for (int i = 0; i < HM_SHM_MAX_SEGMENTS; i++)
        cr_assert_eq(hm_shm_alloc(s, 1, 1, &id, name), 0, "segment %d", i);
    cr_assert_eq(hm_shm_alloc(s, 1, 1, &id, name), -ENOBUFS);
    hm_shm_release_owner(s, 1);
    size_t segs, bytes;
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 0);
    cr_assert_eq(bytes, 0);
    hm_shm_free(s);
}

Test(shm, owner_rules)
{
    hm_shm *s;
    uint64_t id;
    char name[HM_SHM_NAME_MAX];
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 1, 64, &id, name), 0);
    cr_assert_eq(hm_shm_release(s, 2, id), -EPERM);
    cr_assert_eq(hm_shm_release(s, 1, id + 1), -ENOENT);
    cr_assert_eq(hm_shm_owned(s, 1), 1);
    cr_assert_eq(hm_shm_owned(s, 2), 0);
    cr_assert_eq(hm_shm_release(s, 1, id), 0);
    cr_assert_eq(hm_shm_owned(s, 1), 0);
    cr_assert_eq(hm_shm_release(s, 1, id), -ENOENT, "released twice");
    hm_shm_free(s);
}

Test(shm, release_while_pinned_keeps_the_mapping_until_put)
{
    hm_shm *s;
    uint64_t id;
    char name[HM_SHM_NAME_MAX];
    void *p, *q;
    size_t segs, bytes;
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 1, 4096, &id, name), 0);
    cr_assert_eq(hm_shm_get(s, id, 0, 4096, &p), 0);
    cr_assert_eq(hm_shm_get(s, id, 8, 8, &q), 0);
    cr_assert_eq(hm_shm_release(s, 1, id), 0);
    /* Released: no new pins, no name, but the memory is still there. */
    cr_assert_eq(hm_shm_get(s, id, 0, 4, &q), -ENOENT);
    cr_assert_eq(name_exists(name), 0);
    memset(p, 0xab, 4096);
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 1);
    cr_assert_eq(bytes, 4096);
    hm_shm_put(s, id);
    ((unsigned char *)p)[100] = 1; /* one pin is left */
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 1);
    hm_shm_put(s, id);
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 0);
    cr_assert_eq(bytes, 0);
    hm_shm_free(s);
}

Test(shm, release_owner_frees_only_that_owners_segments)
{
    hm_shm *s;
    uint64_t a1, a2, b1;
    char n1[HM_SHM_NAME_MAX], n2[HM_SHM_NAME_MAX], n3[HM_SHM_NAME_MAX];
    void *p;
    size_t segs, bytes;
    cr_assert_eq(hm_shm_new(NULL, &s), 0);
    cr_assert_eq(hm_shm_alloc(s, 10, 100, &a1, n1), 0);
    cr_assert_eq(hm_shm_alloc(s, 10, 200, &a2, n2), 0);
    cr_assert_eq(hm_shm_alloc(s, 11, 300, &b1, n3), 0);
    cr_assert_eq(hm_shm_get(s, a2, 0, 200, &p), 0); /* another connection's round */
    /* What each connection holds decides whether it may be idle-closed. */
    cr_assert_eq(hm_shm_owned(s, 10), 2);
    cr_assert_eq(hm_shm_owned(s, 11), 1);
    cr_assert_eq(hm_shm_owned(s, 12), 0);
    hm_shm_release_owner(s, 10);
    cr_assert_eq(hm_shm_owned(s, 10), 0, "a released but pinned segment is not held");
    cr_assert_eq(hm_shm_owned(s, 11), 1);
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 2, "the pinned one stays until its put");
    cr_assert_eq(bytes, 500);
    cr_assert_eq(hm_shm_get(s, a1, 0, 4, &p), -ENOENT);
    cr_assert_eq(name_exists(n1), 0);
    cr_assert_eq(name_exists(n2), 0);
    cr_assert_eq(name_exists(n3), 1);
    hm_shm_put(s, a2);
    hm_shm_stats(s, &segs, &bytes);
    cr_assert_eq(segs, 1);
    cr_assert_eq(bytes, 300);
    /* Freeing the registry unlinks what is left. */
    hm_shm_free(s);
    cr_assert_eq(name_exists(n3), 0);
}
