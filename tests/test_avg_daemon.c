/*
 * test_avg_daemon: averaging across real hivemindd processes on
 * 127.0.0.1, driven through `hivemindctl average` as a script would. Four
 * daemons average known float32 files with known weights, concurrently,
 * and every output file is the weighted average. Then the failures, each
 * with real processes: a member SIGKILLed after its group formed and
 * before it sent anything, a member SIGKILLed while it reduces its span
 * (once the others' parts reached it, watched through its metrics), and
 * a member SIGSTOPped past the round's deadline. In all three, the
 * survivors finish within the round timeout plus one second, each span of
 * their result is the weighted average over exactly the members their
 * report names for it (and the victim is in none; for the member killed
 * while reducing, every span is over exactly the three survivors), and
 * the next round forms without the victim.
 *
 * How the victim gets into the group while it cannot take part: the group
 * target is 5 with 4 daemons, so the leader waits for its matchmaking
 * deadline; the victim starts last (a later deadline: it follows), and is
 * stopped once it has had time to join but before the leader's deadline.
 * The leader then begins with it, and the round runs without it.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "tests/proc.h"

#define N_DAEMONS 4
#define N_ELEMS 40000
#define ROUND_TIMEOUT_S 4

/* The vector's length and the round timeout; the killed-reducer case uses more of both. */
static size_t n_elems = N_ELEMS;
static int round_timeout_s = ROUND_TIMEOUT_S;

static void setup(void) { hm_proc_setup("avgd"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(avg_daemon, .init = setup, .fini = teardown, .timeout = 90);

/* AverageWorkers of the daemons start_swarm starts. */
static const char *avg_workers = "0";

static void start_swarm(struct node *nodes, size_t n)
{
    char name[16];
    start_node(&nodes[0], "n0", NULL, "--average-workers", avg_workers, NULL);
    for (size_t i = 1; i < n; i++) {
        snprintf(name, sizeof(name), "n%zu", i);
        start_node(&nodes[i], name, NULL, "--average-workers", avg_workers, "--initial-peers",
                   nodes[0].addr, NULL);
    }
    long deadline = hm_test_now_ms() + 20000;
    size_t ready = 0;
    while (ready < n && hm_test_now_ms() < deadline) {
        ready = 0;
        for (size_t i = 0; i < n; i++)
            ready += node_rt_size(&nodes[i]) >= (long)(n - 1);
        if (ready < n)
            usleep(200000);
    }
    cr_assert_eq(ready, n, "only %zu of %zu daemons know the others", ready, n);
}

/* Every daemon's input: distinct values per daemon and per round. */
static float *inputs[N_DAEMONS];
static double weights[N_DAEMONS] = {1.0, 2.5, 0.5, 4.0};

static void write_inputs(int round)
{
    for (int i = 0; i < N_DAEMONS; i++) {
        char path[128];
        free(inputs[i]);
        inputs[i] = malloc(n_elems * sizeof(float));
        cr_assert_not_null(inputs[i]);
        for (size_t k = 0; k < n_elems; k++)
            inputs[i][k] = (float)(sin((double)k * 0.001 * (i + 1) + round) * 3.0 + i - 1.5);
        snprintf(path, sizeof(path), "%s/in%d.%d", tmpdir, i, round);
        /* The file format is little-endian float32; so is every host we run on. */
        cr_assert_eq(hm_test_write_file(path, inputs[i], n_elems * sizeof(float), 0600), 0);
    }
}

typedef struct job {
    pid_t pid;
    char out[160], err[160];
    long started_ms;
} job;

/* Starts `hivemindctl --json average` on daemon i for this round. */
static void average_start(job *j, struct node *nodes, int i, int round, const char *prefix,
                          const char *target)
{
    static char in[N_DAEMONS][128], outp[N_DAEMONS][128], w[N_DAEMONS][32], rt[16];
    snprintf(in[i], sizeof(in[i]), "%s/in%d.%d", tmpdir, i, round);
    snprintf(outp[i], sizeof(outp[i]), "%s/out%d.%d", tmpdir, i, round);
    snprintf(w[i], sizeof(w[i]), "%.17g", weights[i]);
    snprintf(rt, sizeof(rt), "%d", round_timeout_s);
    char *argv[] = {bin_ctl,          "-s",        nodes[i].sock, "--json",
                    "average",        (char *)prefix, "--in",     in[i],
                    "--out",          outp[i],     "--weight",    w[i],
                    "--target-group-size", (char *)target, "--min-group-size", "2",
                    "--timeout",      "15",        "--round-timeout", rt,
                    "--matchmaking-time", "5",     NULL};
    snprintf(j->out, sizeof(j->out), "%s/avg%d.%d.out", tmpdir, i, round);
    snprintf(j->err, sizeof(j->err), "%s/avg%d.%d.err", tmpdir, i, round);
    j->started_ms = hm_test_now_ms();
    j->pid = spawn(bin_ctl, argv, j->out, j->err, NULL);
}

/* Waits for the job; returns the reply ("result" or "error" inside) and rc. */
static json_t *average_wait(job *j, int *rc)
{
    int st = wait_exit(j->pid, 45000);
    cr_assert(st != -1, "hivemindctl average did not finish");
    cr_assert(WIFEXITED(st));
    *rc = WEXITSTATUS(st);
    char *text = slurp(j->out);
    json_t *reply = json_loads(text, 0, NULL);
    if (reply == NULL) {
        char *e = slurp(j->err);
        cr_log_error("hivemindctl said: %s %s", text, e);
        free(e);
    }
    free(text);
    return reply;
}

static float *read_output(int i, int round)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/out%d.%d", tmpdir, i, round);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "no output file %s", path);
    float *x = malloc(n_elems * sizeof(float) + 4);
    cr_assert_not_null(x);
    size_t n = fread(x, sizeof(float), n_elems + 1, f);
    fclose(f);
    cr_assert_eq(n, n_elems, "output of %zu floats", n);
    return x;
}

/* Which daemon a report's member is. */
static int daemon_of(struct node *nodes, const json_t *member)
{
    const char *id = json_string_value(json_object_get(member, "peer_id"));
    for (int i = 0; i < N_DAEMONS; i++)
        if (id != NULL && strcmp(nodes[i].id, id) == 0)
            return i;
    cr_assert_fail("unknown member %s", id ? id : "?");
    return -1;
}

/*
 * Daemon i's output equals, on every span, the weighted average over the
 * members its report names as that span's contributors; returns the
 * union of those daemons as a mask. With `each` nonzero, every span's
 * contributors must be exactly those daemons.
 */
static unsigned check_output_each(struct node *nodes, int i, int round, const json_t *result,
                                  unsigned each)
{
    const json_t *members = json_object_get(result, "members");
    const json_t *spans = json_object_get(result, "spans");
    float *got = read_output(i, round);
    unsigned all = 0;
    size_t si;
    const json_t *span;
    size_t covered = 0;
    json_array_foreach(spans, si, span) {
        size_t off = (size_t)json_integer_value(json_object_get(span, "offset"));
        size_t cnt = (size_t)json_integer_value(json_object_get(span, "count"));
        const json_t *contrib = json_object_get(span, "contributors");
        cr_assert(json_array_size(json_object_get(span, "partial")) == 0,
                  "daemon %d span %zu partly averaged", i, si);
        unsigned mask = 0;
        size_t ci;
        const json_t *c;
        json_array_foreach(contrib, ci, c) {
            const json_t *m = json_array_get(members, (size_t)json_integer_value(c));
            mask |= 1u << daemon_of(nodes, m);
        }
        cr_assert(cnt == 0 || mask != 0);
        if (each != 0 && cnt > 0)
            cr_assert_eq(mask, each, "daemon %d span %zu averaged over %#x, not %#x", i, si, mask,
                         each);
        all |= mask;
        covered += cnt;
        for (size_t k = off; k < off + cnt; k++) {
            double s = 0, w = 0;
            for (int d = 0; d < N_DAEMONS; d++)
                if (mask & (1u << d)) {
                    s += weights[d] * inputs[d][k];
                    w += weights[d];
                }
            double e = s / w;
            if (fabs(got[k] - e) > 1e-6 * fabs(e) + 1e-7)
                cr_assert_fail("daemon %d element %zu: %.9g, expected %.9g over mask %#x", i, k,
                               (double)got[k], e, mask);
        }
    }
    cr_assert_eq(covered, n_elems);
    free(got);
    return all;
}

static unsigned check_output(struct node *nodes, int i, int round, const json_t *result)
{
    return check_output_each(nodes, i, round, result, 0);
}

Test(avg_daemon, four_daemons_average_exactly)
{
    struct node nodes[N_DAEMONS];
    job jobs[N_DAEMONS];
    start_swarm(nodes, N_DAEMONS);
    write_inputs(0);
    for (int i = 0; i < N_DAEMONS; i++)
        average_start(&jobs[i], nodes, i, 0, "daemon.exact", "4");
    for (int i = 0; i < N_DAEMONS; i++) {
        int rc;
        json_t *reply = average_wait(&jobs[i], &rc);
        cr_assert_eq(rc, 0, "daemon %d: average failed", i);
        const json_t *result = json_object_get(reply, "result");
        cr_assert_eq(json_integer_value(json_object_get(result, "group_size")), N_DAEMONS);
        cr_assert_eq(json_array_size(json_object_get(result, "left_out")), 0);
        cr_assert_gt(json_integer_value(json_object_get(result, "bytes_sent")), 0);
        unsigned all = check_output(nodes, i, 0, result);
        cr_assert_eq(all, (1u << N_DAEMONS) - 1, "daemon %d: averaged over %#x", i, all);
        json_decref(reply);
    }
    /* The operator's view of it. */
    char *out, *err;
    cr_assert_eq(ctl(nodes[2].sock, "averaging", 0, &out, &err), 0);
    cr_assert(strstr(out, "daemon.exact") != NULL && strstr(out, " ok ") != NULL, "%s", out);
    free(out);
    free(err);
    for (int i = 0; i < N_DAEMONS; i++)
        stop_node(&nodes[i]);
}

/*
 * The victim (daemon 3) joins a round and is stopped before its group
 * begins; then `kill_it` SIGKILLs it once the others run the all-reduce,
 * or it stays stopped past their deadline. Either way the survivors finish
 * in time with the average over themselves, and round 1 forms without it.
 */
static void victim_case(int kill_it)
{
    struct node nodes[N_DAEMONS];
    job jobs[N_DAEMONS];
    const int victim = N_DAEMONS - 1;
    start_swarm(nodes, N_DAEMONS);
    write_inputs(0);
    for (int i = 0; i < victim; i++)
        average_start(&jobs[i], nodes, i, 0, "daemon.fail", "5");
    usleep(300000);
    average_start(&jobs[victim], nodes, victim, 0, "daemon.fail", "5");
    /* Joins take a DHT read or two (every 1.25 s with a 5 s attempt); the
     * margins are wide so that a loaded machine still puts the victim in
     * the group before the leader's deadline at about 5 s. */
    usleep(3300000);
    cr_assert_eq(kill(nodes[victim].pid, SIGSTOP), 0);
    if (kill_it) {
        /* Past the leader's deadline the group has begun, with the victim in it. */
        usleep(2500000);
        cr_assert_eq(kill(nodes[victim].pid, SIGKILL), 0);
        cr_assert_neq(wait_exit(nodes[victim].pid, 5000), -1);
    }
    for (int i = 0; i < victim; i++) {
        int rc;
        json_t *reply = average_wait(&jobs[i], &rc);
        cr_assert_eq(rc, 0, "survivor %d: average failed", i);
        const json_t *result = json_object_get(reply, "result");
        cr_assert_eq(json_integer_value(json_object_get(result, "group_size")), N_DAEMONS,
                     "survivor %d: the victim did not get into the group", i);
        double ar_s = json_number_value(json_object_get(result, "allreduce_s"));
        cr_assert_leq(ar_s, ROUND_TIMEOUT_S + 1.0, "survivor %d took %.2f s", i, ar_s);
        /* The victim is named left out, and why. */
        const json_t *left = json_object_get(result, "left_out");
        cr_assert_eq(json_array_size(left), 1, "survivor %d: %zu left out", i,
                     json_array_size(left));
        cr_assert_str_eq(json_string_value(json_object_get(json_array_get(left, 0), "peer_id")),
                         nodes[victim].id);
        unsigned all = check_output(nodes, i, 0, result);
        cr_assert_eq(all, (1u << victim) - 1, "survivor %d: averaged over %#x", i, all);
        json_decref(reply);
    }
    if (!kill_it) {
        /* Resumed, the victim ends its own round without holding anyone up. */
        cr_assert_eq(kill(nodes[victim].pid, SIGCONT), 0);
        int rc;
        json_t *reply = average_wait(&jobs[victim], &rc);
        json_decref(reply);
        /* It stays out of the next round: it does not ask to average. */
    } else {
        forget_child(jobs[victim].pid);
        kill(jobs[victim].pid, SIGKILL);
        waitpid(jobs[victim].pid, NULL, 0);
    }
    /* The next round forms among the survivors only. */
    write_inputs(1);
    for (int i = 0; i < victim; i++)
        average_start(&jobs[i], nodes, i, 1, "daemon.fail", "5");
    for (int i = 0; i < victim; i++) {
        int rc;
        json_t *reply = average_wait(&jobs[i], &rc);
        cr_assert_eq(rc, 0, "survivor %d: second round failed", i);
        const json_t *result = json_object_get(reply, "result");
        cr_assert_eq(json_integer_value(json_object_get(result, "group_size")), victim);
        cr_assert_eq(json_array_size(json_object_get(result, "left_out")), 0);
        cr_assert_eq(check_output(nodes, i, 1, result), (1u << victim) - 1);
        json_decref(reply);
    }
    for (int i = 0; i < N_DAEMONS; i++)
        if (kill_it ? i != victim : 1)
            stop_node(&nodes[i]);
}

Test(avg_daemon, killed_member_is_left_out) { victim_case(1); }

Test(avg_daemon, stopped_member_is_left_out) { victim_case(0); }

Test(avg_daemon, bad_input_is_refused)
{
    struct node n;
    char path[128], *out, *err;
    start_node(&n, "solo", NULL, NULL);
    snprintf(path, sizeof(path), "%s/odd", tmpdir);
    cr_assert_eq(hm_test_write_file(path, "abcde", 5, 0600), 0);
    char *argv[] = {bin_ctl, "-s", n.sock, "average", "x", "--in", path, "--out", "/tmp/none",
                    "--timeout", "1", NULL};
    cr_assert_eq(run_prog(bin_ctl, argv, &out, &err), 1);
    cr_assert(strstr(err, "multiple of 4") != NULL, "%s", err);
    free(out);
    free(err);
    float nan_file[2] = {1.0f, NAN};
    cr_assert_eq(hm_test_write_file(path, nan_file, sizeof(nan_file), 0600), 0);
    cr_assert_eq(run_prog(bin_ctl, argv, &out, &err), 1);
    cr_assert(strstr(err, "not a finite number") != NULL, "%s", err);
    free(out);
    free(err);
    /* Alone, nobody to average with: a clear failure within the timeout. */
    float ok_file[2] = {1.0f, 2.0f};
    cr_assert_eq(hm_test_write_file(path, ok_file, sizeof(ok_file), 0600), 0);
    cr_assert_eq(run_prog(bin_ctl, argv, &out, &err), 1);
    cr_assert(strstr(err, "no group formed") != NULL, "%s", err);
    free(out);
    free(err);
    char *argv2[] = {bin_ctl, "-s", n.sock, "average", "x", "--in", path, NULL};
    cr_assert_eq(run_prog(bin_ctl, argv2, &out, &err), 64);
    free(out);
    free(err);
    stop_node(&n);
}

/*
 * The daemon's received bytes (its metrics), asked over its control socket
 * directly: a poll takes about a millisecond, so that the test can act at a
 * precise point of a running round. -1 when it cannot be read.
 */
static long long rx_bytes(struct node *n)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    static char buf[256 * 1024];
    size_t got = 0;
    long long v = -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (strlen(n->sock) >= sizeof(sa.sun_path))
        goto out;
    memcpy(sa.sun_path, n->sock, strlen(n->sock) + 1);
    const char *req = "{\"cmd\": \"metrics\"}\n";
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        write(fd, req, strlen(req)) != (ssize_t)strlen(req))
        goto out;
    while (got < sizeof(buf) - 1) {
        ssize_t r = read(fd, buf + got, sizeof(buf) - 1 - got);
        if (r <= 0)
            break;
        got += (size_t)r;
        if (memchr(buf, '\n', got) != NULL)
            break;
    }
    buf[got] = '\0';
    json_t *j = json_loads(buf, JSON_DISABLE_EOF_CHECK, NULL);
    const char *text = json_string_value(json_object_get(json_object_get(j, "result"), "text"));
    const char *line = text != NULL ? strstr(text, "\nhivemindd_received_bytes_total ") : NULL;
    if (line != NULL)
        v = strtoll(line + strlen("\nhivemindd_received_bytes_total "), NULL, 10);
    json_decref(j);
out:
    close(fd);
    return v;
}

/*
 * A member SIGKILLed while it reduces its span: the others' parts have
 * reached it, and its own parts are already in averages that the other
 * reducers handed out. The survivors undo those averages and average
 * again without it: each survivor finishes within the round timeout plus
 * one second, every span of its output is the weighted average over the
 * three survivors exactly (its report says so for every span), the dead
 * member's span went to a survivor, and the next round forms without it.
 */
static void killed_while_reducing(void)
{
    struct node nodes[N_DAEMONS];
    job jobs[N_DAEMONS];
    const int victim = N_DAEMONS - 1;
    const unsigned survivors = (1u << victim) - 1;
    /* 16 MiB per member: each receives 12 MiB of parts, so a poll lands mid-round. */
    n_elems = 4u << 20;
    round_timeout_s = 8;
    start_swarm(nodes, N_DAEMONS);
    write_inputs(0);
    long long base = rx_bytes(&nodes[victim]);
    cr_assert_geq(base, 0, "metrics of the victim");
    for (int i = 0; i < N_DAEMONS; i++)
        average_start(&jobs[i], nodes, i, 0, "daemon.killed", "4");
    /*
     * Kill it once 2 MiB of parts have come in (a sixth of what it gets):
     * it has chunks to reduce, and has sent parts of its own in every
     * reducer's first chunks (tasks go chunk-major, 8 in flight).
     */
    long long rx = base, limit = hm_test_now_ms() + 30000;
    while (rx - base < (2ll << 20) && hm_test_now_ms() < limit) {
        usleep(1000);
        long long v = rx_bytes(&nodes[victim]);
        if (v >= 0)
            rx = v;
    }
    cr_assert_eq(kill(nodes[victim].pid, SIGKILL), 0);
    long long parts_in = rx - base;
    cr_assert_geq(parts_in, 2ll << 20, "the round never reached the victim");
    /* Mid-round: its `average` had not returned (its round had not ended). */
    cr_assert_eq(waitpid(jobs[victim].pid, NULL, WNOHANG), 0, "killed after its round");
    cr_assert_neq(wait_exit(nodes[victim].pid, 5000), -1);
    cr_log_info("victim killed with %lld bytes in", parts_in);

    for (int i = 0; i < victim; i++) {
        int rc;
        json_t *reply = average_wait(&jobs[i], &rc);
        cr_assert_eq(rc, 0, "survivor %d: average failed", i);
        const json_t *result = json_object_get(reply, "result");
        cr_assert_eq(json_integer_value(json_object_get(result, "group_size")), N_DAEMONS);
        double ar_s = json_number_value(json_object_get(result, "allreduce_s"));
        cr_assert_leq(ar_s, round_timeout_s + 1.0, "survivor %d took %.2f s", i, ar_s);
        const json_t *left = json_object_get(result, "left_out");
        cr_assert_eq(json_array_size(left), 1, "survivor %d: %zu left out", i,
                     json_array_size(left));
        const json_t *gone = json_array_get(left, 0);
        cr_assert_str_eq(json_string_value(json_object_get(gone, "peer_id")), nodes[victim].id);
        cr_assert_str_eq(json_string_value(json_object_get(gone, "reason")), "dead");
        /* The dead member's own span was reduced by a survivor in the end. */
        json_int_t vi = json_integer_value(json_object_get(gone, "index"));
        const json_t *vspan = json_array_get(json_object_get(result, "spans"), (size_t)vi);
        json_int_t fr = json_integer_value(json_object_get(vspan, "final_reducer"));
        cr_assert(fr >= 0 && fr != vi, "survivor %d: span %lld reduced by %lld", i,
                  (long long)vi, (long long)fr);
        cr_assert_eq(check_output_each(nodes, i, 0, result, survivors), survivors);
        json_decref(reply);
    }
    forget_child(jobs[victim].pid);
    kill(jobs[victim].pid, SIGKILL);
    waitpid(jobs[victim].pid, NULL, 0);

    /* The next round forms among the survivors only (at the leader's deadline). */
    write_inputs(1);
    for (int i = 0; i < victim; i++)
        average_start(&jobs[i], nodes, i, 1, "daemon.killed", "4");
    for (int i = 0; i < victim; i++) {
        int rc;
        json_t *reply = average_wait(&jobs[i], &rc);
        cr_assert_eq(rc, 0, "survivor %d: second round failed", i);
        const json_t *result = json_object_get(reply, "result");
        cr_assert_eq(json_integer_value(json_object_get(result, "group_size")), victim);
        cr_assert_eq(json_array_size(json_object_get(result, "left_out")), 0);
        cr_assert_eq(check_output_each(nodes, i, 1, result, survivors), survivors);
        json_decref(reply);
    }
    for (int i = 0; i < victim; i++)
        stop_node(&nodes[i]);
    for (int i = 0; i < N_DAEMONS; i++)
        free(inputs[i]);
}

Test(avg_daemon, member_killed_while_reducing_is_undone_everywhere) { killed_while_reducing(); }

/* Threads of process pid named name (/proc/PID/task/TID/comm). */
static int threads_named(pid_t pid, const char *name)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char comm[384], line[32] = "";
        if (e->d_name[0] == '.')
            continue;
        snprintf(comm, sizeof(comm), "%s/%s/comm", path, e->d_name);
        FILE *f = fopen(comm, "r");
        if (f == NULL)
            continue;
        if (fgets(line, sizeof(line), f) != NULL)
            line[strcspn(line, "\n")] = '\0';
        fclose(f);
        n += strcmp(line, name) == 0;
    }
    closedir(d);
    return n;
}

/* The same with the chunk work on two averaging threads per daemon (AverageWorkers). */
Test(avg_daemon, member_killed_while_reducing_on_workers_is_undone_everywhere)
{
    struct node n;
    start_node(&n, "w", NULL, "--average-workers", "2", NULL);
    cr_assert_eq(threads_named(n.pid, "hm-avg"), 2, "AverageWorkers 2 starts two threads");
    stop_node(&n);
    avg_workers = "2";
    killed_while_reducing();
}
