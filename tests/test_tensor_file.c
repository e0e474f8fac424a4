/*
 * test_tensor_file: the daemon's one reader and writer of tensor files
 * (src/daemon/tensor_file.h). Real files in a fresh directory under /tmp:
 * a round trip through the threadpool, no temporary file left behind on
 * success or failure, an old file intact when a write fails, and clear
 * errors for files that are too large, not whole rows, not finite, not
 * regular or missing. Callbacks fire exactly once, and never when the call
 * itself failed.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uv.h>

#include "src/daemon/tensor_file.h"

static char dir[64];

static void make_dir(void)
{
    snprintf(dir, sizeof(dir), "/tmp/hm-tensor-file-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void remove_dir(void)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[PATH_MAX];
    if (d == NULL)
        return;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        if (unlink(p) != 0)
            rmdir(p);
    }
    closedir(d);
    rmdir(dir);
}

TestSuite(tensor_file, .init = make_dir, .fini = remove_dir);

static void path_of(char *out, const char *name)
{
    snprintf(out, PATH_MAX, "%s/%s", dir, name);
}

/* The names in the directory, as one string "a b c" in readdir order. */
static size_t entries(char *names, size_t len)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    size_t n = 0;
    names[0] = '\0';
    cr_assert_not_null(d);
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        n++;
        strncat(names, e->d_name, len - strlen(names) - 2);
        strcat(names, " ");
    }
    closedir(d);
    return n;
}

static void put_bytes(const char *path, const void *p, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, p, len), (ssize_t)len);
    close(fd);
}

/* ---- through the threadpool ---- */

typedef struct result {
    int calls;
    int status;
    float *data;
    size_t n;
    char msg[HM_TENSOR_FILE_MSG_MAX];
} result;

static void on_read(void *ud, int status, float *data, size_t n, const char *msg)
{
    result *r = ud;
    r->calls++;
    r->status = status;
    r->data = data;
    r->n = n;
    snprintf(r->msg, sizeof(r->msg), "%s", msg != NULL ? msg : "");
}

static void on_write(void *ud, int status, const char *msg)
{
    result *r = ud;
    r->calls++;
    r->status = status;
    snprintf(r->msg, sizeof(r->msg), "%s", msg != NULL ? msg : "");
}

Test(tensor_file, round_trip_off_the_loop_leaves_only_the_file)
{
    uv_loop_t loop;
    char path[PATH_MAX], names[512];
    float v[1000];
    result w = {0}, r = {0};
    struct stat st;
    for (size_t i = 0; i < 1000; i++)
        v[i] = (float)i * 0.25f - 7.0f;
    path_of(path, "t.f32");
    cr_assert_eq(uv_loop_init(&loop), 0);

    cr_assert_eq(hm_tensor_file_write(&loop, path, v, 1000, on_write, &w), 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(w.calls, 1);
    cr_assert_eq(w.status, 0, "%s", w.msg);
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 4000);
    cr_assert_eq(st.st_mode & 0777, 0644);
    cr_assert_eq(entries(names, sizeof(names)), 1, "left: %s", names);

    hm_tensor_file_read_opts o = {.row = 10, .max_bytes = 4000, .finite = 1};
    cr_assert_eq(hm_tensor_file_read(&loop, path, &o, on_read, &r), 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(r.calls, 1);
    cr_assert_eq(r.status, 0, "%s", r.msg);
    cr_assert_eq(r.n, 1000);
    cr_assert_eq(memcmp(r.data, v, sizeof(v)), 0);
    free(r.data);

    /* A second write replaces the file whole. */
    w.calls = 0;
    cr_assert_eq(hm_tensor_file_write(&loop, path, v + 500, 500, on_write, &w), 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(w.calls, 1);
    cr_assert_eq(w.status, 0, "%s", w.msg);
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 2000);
    cr_assert_eq(entries(names, sizeof(names)), 1, "left: %s", names);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

Test(tensor_file, a_call_that_fails_never_calls_back)
{
    uv_loop_t loop;
    char longpath[PATH_MAX + 8];
    float v[4] = {1, 2, 3, 4};
    result r = {0};
    hm_tensor_file_read_opts o = {.max_bytes = 64};
    memset(longpath, 'a', sizeof(longpath) - 1);
    longpath[0] = '/';
    longpath[sizeof(longpath) - 1] = '\0';
    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(hm_tensor_file_read(&loop, longpath, &o, on_read, &r), -ENAMETOOLONG);
    cr_assert_eq(hm_tensor_file_write(&loop, longpath, v, 4, on_write, &r), -ENAMETOOLONG);
    cr_assert_eq(hm_tensor_file_write(&loop, "/tmp/x", v, 0, on_write, &r), -EINVAL);
    /* A read without a bound on the size is refused. */
    hm_tensor_file_read_opts unbounded = {0};
    cr_assert_eq(hm_tensor_file_read(&loop, "/tmp/x", &unbounded, on_read, &r), -EINVAL);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(r.calls, 0);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

Test(tensor_file, errors_reach_the_callback_once)
{
    uv_loop_t loop;
    char path[PATH_MAX];
    result r = {0};
    hm_tensor_file_read_opts o = {.max_bytes = 64};
    path_of(path, "missing.f32");
    cr_assert_eq(uv_loop_init(&loop), 0);
    cr_assert_eq(hm_tensor_file_read(&loop, path, &o, on_read, &r), 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(r.calls, 1);
    cr_assert_eq(r.status, -ENOENT);
    cr_assert_null(r.data);
    cr_assert(strstr(r.msg, "cannot open") != NULL && strstr(r.msg, path) != NULL, "%s", r.msg);
    cr_assert_eq(uv_loop_close(&loop), 0);
}

/* ---- bounds and format ---- */

Test(tensor_file, over_the_bound_is_refused_with_the_callers_words)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX];
    float v[17] = {0}, *data = NULL;
    size_t n = 0;
    path_of(path, "big.f32");
    put_bytes(path, v, sizeof(v));
    hm_tensor_file_read_opts o = {.max_bytes = 64, .expect = "at most 16 floats"};
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EFBIG);
    cr_assert_null(data);
    cr_assert(strstr(msg, "holds 68 bytes: expected at most 16 floats") != NULL, "%s", msg);
    /* At the bound it is fine. */
    put_bytes(path, v, 64);
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), 0, "%s", msg);
    cr_assert_eq(n, 16);
    free(data);
}

Test(tensor_file, truncated_or_partial_rows_are_refused)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX];
    float v[6] = {1, 2, 3, 4, 5, 6}, *data = NULL;
    size_t n = 0;
    path_of(path, "rows.f32");
    hm_tensor_file_read_opts o = {.row = 3, .max_bytes = 1024};
    /* A float cut in half. */
    put_bytes(path, v, 10);
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EINVAL);
    cr_assert(strstr(msg, "holds 10 bytes") != NULL, "%s", msg);
    /* Whole floats, but not whole rows of 3. */
    put_bytes(path, v, 16);
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EINVAL);
    cr_assert(strstr(msg, "rows of 3 float32") != NULL, "%s", msg);
    /* Empty. */
    put_bytes(path, v, 0);
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EINVAL);
    /* Two rows. */
    put_bytes(path, v, 24);
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), 0, "%s", msg);
    cr_assert_eq(n, 6);
    cr_assert_eq(data[5], 6.0f);
    free(data);
}

Test(tensor_file, non_finite_values_are_refused_when_asked)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX];
    float v[4] = {1, 2, NAN, 4}, *data = NULL;
    size_t n = 0;
    path_of(path, "nan.f32");
    put_bytes(path, v, sizeof(v));
    hm_tensor_file_read_opts o = {.finite = 1, .max_bytes = 1024};
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EDOM);
    cr_assert(strstr(msg, "element 2 is not a finite number") != NULL, "%s", msg);
    o.finite = 0;
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), 0, "%s", msg);
    cr_assert(isnan(data[2]));
    free(data);
}

Test(tensor_file, a_fifo_is_refused_without_hanging)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX];
    float *data = NULL;
    size_t n = 0;
    path_of(path, "fifo");
    cr_assert_eq(mkfifo(path, 0600), 0);
    hm_tensor_file_read_opts o = {.max_bytes = 1024};
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), -EINVAL);
    cr_assert(strstr(msg, "is not a regular file") != NULL, "%s", msg);
}

/* ---- failed writes ---- */

Test(tensor_file, a_failed_write_keeps_the_old_file_and_no_temporary)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX], names[512];
    float old[4] = {9, 8, 7, 6}, *data = NULL, big[4096] = {0};
    size_t n = 0;
    struct rlimit rl, small;
    path_of(path, "keep.f32");
    cr_assert_eq(hm_tensor_file_store(path, old, 4, msg, sizeof(msg)), 0, "%s", msg);

    /* A file-size limit makes write() fail with EFBIG even for root (who
     * ignores permissions); the signal it would raise is ignored. */
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    small = rl;
    small.rlim_cur = 1024;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &small), 0);
    int r = hm_tensor_file_store(path, big, 4096, msg, sizeof(msg));
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    cr_assert_eq(r, -EFBIG, "%d %s", r, msg);
    cr_assert(strstr(msg, "writing") != NULL && strstr(msg, path) != NULL, "%s", msg);
    cr_assert_eq(entries(names, sizeof(names)), 1, "left: %s", names);

    hm_tensor_file_read_opts o = {.max_bytes = 1024};
    cr_assert_eq(hm_tensor_file_load(path, &o, &data, &n, msg, sizeof(msg)), 0, "%s", msg);
    cr_assert_eq(n, 4);
    cr_assert_eq(memcmp(data, old, sizeof(old)), 0);
    free(data);
}

Test(tensor_file, a_write_that_cannot_be_renamed_leaves_no_temporary)
{
    char path[PATH_MAX], inner[PATH_MAX + 8], msg[HM_TENSOR_FILE_MSG_MAX], names[512];
    float v[4] = {1, 2, 3, 4};
    /* The target is a directory that is not empty: rename() refuses. */
    path_of(path, "adir");
    cr_assert_eq(mkdir(path, 0700), 0);
    snprintf(inner, sizeof(inner), "%s/x", path);
    put_bytes(inner, v, 4);
    int r = hm_tensor_file_store(path, v, 4, msg, sizeof(msg));
    cr_assert_lt(r, 0);
    cr_assert(strstr(msg, path) != NULL, "%s", msg);
    cr_assert_eq(entries(names, sizeof(names)), 1, "left: %s", names);
    unlink(inner);
}

Test(tensor_file, a_missing_directory_is_a_clear_error)
{
    char path[PATH_MAX], msg[HM_TENSOR_FILE_MSG_MAX];
    float v[1] = {1};
    path_of(path, "nodir/out.f32");
    cr_assert_eq(hm_tensor_file_store(path, v, 1, msg, sizeof(msg)), -ENOENT);
    cr_assert(strstr(msg, "cannot create a file next to") != NULL, "%s", msg);
}

/*
 * A directory the daemon may write but not read (mode 0733) cannot be
 * opened to fsync it after the rename. The file is in place by then, so the
 * write must count as done: an error would tell the caller the old file is
 * still there. Run in a child as an unprivileged user, since root reads any
 * directory; skipped when no such user can be taken.
 */
Test(tensor_file, an_unreadable_directory_still_counts_the_written_file)
{
    char p[PATH_MAX];
    path_of(p, "out.bin");
    cr_assert_eq(chmod(dir, 0733), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0))
            _exit(77);
        if (geteuid() == 0)
            _exit(77);
        float v[3] = {1, 2, 3};
        char msg[HM_TENSOR_FILE_MSG_MAX];
        int r = hm_tensor_file_store(p, v, 3, msg, sizeof(msg));
        _exit(r == 0 ? 0 : 1);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    chmod(dir, 0700);
    cr_assert(WIFEXITED(st));
    if (WEXITSTATUS(st) == 77)
        cr_skip_test("cannot run as an unprivileged user here");
    cr_assert_eq(WEXITSTATUS(st), 0, "the store reported an error for a file it wrote");
    struct stat sb;
    cr_assert_eq(stat(p, &sb), 0);
    cr_assert_eq(sb.st_size, 12);
}
