/*
 * hivemindctl: the command-line client of the control socket. It turns the
 * command line into one request, sends it to a running hivemindd through
 * libhivemind (hmc_call: the library's connection, deadlines and strict
 * reply parsing, so the tree has one control-socket client), and prints
 * the reply for people (info as "key: value" lines, peers as a table,
 * metrics as the Prometheus text) or, with --json, the reply line as it
 * came. Each command is one row of a table: its words, the daemon's
 * command, how its arguments are built from the command line and how its
 * result is printed.
 *
 * Exit status (sysexits.h where one fits): 0 the command succeeded; 1 the
 * daemon answered with an error (printed on stderr), or a lookup found
 * nothing; 64 usage error; 69 the daemon could not be reached (77 when
 * the socket's permissions refuse us); 75 no reply in time; 76 a reply
 * that is not the protocol.
 */
#include "config.h"

#include "lib/hivemind.h"
#include "src/cli/top.h"
#include "src/base/paths.h"
#include "src/base/util.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* A usage error gets one line and a pointer to --help, not the whole text. */
static void usage_hint(void)
{
    fputs("Usage: hivemindctl [-s SOCKET] [--json] [--timeout SECONDS] COMMAND [ARGS...]\n"
          "Try 'hivemindctl --help'.\n",
          stderr);
}

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: hivemindctl [-s SOCKET] [--json] [--timeout SECONDS] COMMAND\n"
            "Queries and controls a running hivemindd through its control socket.\n\n"
            "Commands:\n"
            "  info       peer id, address, swarm, version and uptime of the node\n"
            "  peers      the peer table: id, address, last seen, round-trip time, connected\n"
            "  metrics    metrics in Prometheus text format\n"
            "  shutdown   ask the daemon to shut down (it exits with status 0)\n"
            "  dht get KEY [SUBKEY]\n"
            "             look KEY up in the DHT and print its value(s); exit 1 if not found\n"
            "  dht put KEY VALUE [--subkey S] [--ttl SECONDS]\n"
            "             store VALUE under KEY (default ttl 3600 s, at most 86400)\n"
            "  dht info   routing table size and depth, records stored, bytes\n"
            "  average PREFIX --in FILE --out FILE [--weight W] [--target-group-size N]\n"
            "          [--min-group-size N] [--timeout S] [--round-timeout S]\n"
            "          [--matchmaking-time S] [--compression none|fp16|8bit] [--group-bits B]\n"
            "             average a raw little-endian float32 file with peers of the swarm\n"
            "             under PREFIX; the daemon reads FILE and writes the result to OUT\n"
            "             (atomically), and the round's report is printed. --timeout is how\n"
            "             long to look for a group (default 30), --round-timeout the\n"
            "             all-reduce's deadline (default 30); hivemindctl waits for both\n"
            "             plus 15 s. Exit 1 with the reason when no averaged result came\n"
            "             back\n"
            "  averaging  the rounds in progress and the recent rounds, as a table\n"
            "  experts list [PREFIX]\n"
            "             the experts this node hosts (requests served, mean batch size,\n"
            "             latency, optimizer steps) and those the swarm declares under\n"
            "             PREFIX (default: the grids this node hosts in): uid, host, expiry\n"
            "  experts host PATTERN [--type ffn|transformer] [--dim D] [--hidden H]\n"
            "          [--optimizer adam|sgd] [--lr RATE] [--heads N] [--max-seq S]\n"
            "             host more experts, e.g. 'ffn.[0:16].[0:4]' (64 experts); the\n"
            "             defaults are the daemon's Expert* settings; a transformer takes\n"
            "             [batch, seq, d] with seq at most S and N heads dividing d\n"
            "  experts call UID --in FILE --out FILE [--seq S] [--timeout S]\n"
            "             one forward pass of expert UID, wherever it is hosted, on a raw\n"
            "             float32 [batch, d] file ([batch, S, d] for a transformer); the\n"
            "             output is written to OUT (default timeout 30 s)\n"
            "  state share PREFIX --step N --in FILE [--chunk-size B] [--ttl S]\n"
            "             offer a state (a raw float32 file: parameters and optimizer state)\n"
            "             to newcomers under PREFIX, as donor for step N\n"
            "  state load PREFIX --out FILE [--min-agree N] [--timeout S]\n"
            "             download the newest state under PREFIX that N donors of different\n"
            "             origins agree on (default 2) into FILE, checked chunk by chunk\n"
            "             (default timeout 300 s)\n"
            "  state info PREFIX\n"
            "             what this node shares under PREFIX: step, size, hash, requests served\n"
            "  status     the swarm at a glance: its nodes (from their DHT summaries), the\n"
            "             expert grid with hosts, requests and latency, recent averaging\n"
            "             rounds and training progress\n"
            "  top        the same, live, refreshing every 2 s; q quits\n"
            "  progress RUN [--target N]\n"
            "             the swarm's progress in training run RUN: global epoch, samples\n"
            "             toward the target batch size N, throughput, time to the target\n"
            "             and each peer's report\n\n"
            "Options:\n"
            "  -s, --socket PATH    control socket (default: $HIVEMINDD_CONTROL_SOCKET, else\n"
            "                       the daemon's default for this user)\n"
            "  -j, --json           print the daemon's JSON reply as it is\n"
            "  -T, --timeout SECS   give up after this long without a reply (default 10);\n"
            "                       with average, see above\n"
            "      --subkey S       with dht put: store under this subkey of KEY\n"
            "      --ttl SECONDS    with dht put: how long the record lives\n"
            "  -V, --version        print the version and exit\n"
            "  -h, --help           print this help and exit\n\n"
            "Exit status: 0 ok, 1 the daemon reported an error or found nothing, 64 bad\n"
            "usage, 69 the daemon was not reached (77: permission denied), 75 no reply in\n"
            "time, 76 a malformed reply.\n");
}

static void print_info(const json_t *r)
{
    static const char *const keys[] = {"peer_id", "address", "swarm", "version", "uptime_s",
                                       "client_mode", "pid", "control_socket"};
    for (size_t i = 0; i < HM_ARRAY_LEN(keys); i++) {
        const json_t *v = json_object_get(r, keys[i]);
        if (v == NULL)
            continue;
        if (json_is_string(v))
            printf("%s: %s\n", keys[i], json_string_value(v));
        else if (json_is_boolean(v))
            printf("%s: %s\n", keys[i], json_is_true(v) ? "yes" : "no");
        else if (json_is_integer(v))
            printf("%s: %lld\n", keys[i], (long long)json_integer_value(v));
        else if (json_is_real(v))
            printf("%s: %g\n", keys[i], json_real_value(v));
    }
    /* Anything newer daemons add still shows up. */
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)r, key, v) {
        int known = 0;
        for (size_t i = 0; i < HM_ARRAY_LEN(keys); i++)
            known |= strcmp(key, keys[i]) == 0;
        if (known)
            continue;
        char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (s != NULL) {
            if (json_is_string(v))
                printf("%s: %s\n", key, json_string_value(v));
            else
                printf("%s: %s\n", key, s);
            free(s);
        }
    }
}

static void format_ago(double s, char *buf, size_t len)
{
    if (s < 0 || !isfinite(s))
        snprintf(buf, len, "-");
    else if (s < 60)
        snprintf(buf, len, "%.1fs ago", s);
    else if (s < 3600)
        snprintf(buf, len, "%.0fm ago", floor(s / 60));
    else
        snprintf(buf, len, "%.0fh ago", floor(s / 3600));
}

static void print_peers(const json_t *r)
{
    const json_t *list = json_object_get(r, "peers");
    size_t idw = strlen("PEER ID"), aw = strlen("ADDRESS");
    size_t i;
    const json_t *p;

    if (!json_is_array(list) || json_array_size(list) == 0) {
        printf("no peers\n");
        return;
    }
    json_array_foreach(list, i, p) {
        const char *id = json_string_value(json_object_get(p, "peer_id"));
        const char *a = json_string_value(json_object_get(p, "address"));
        idw = HM_MAX(idw, id ? strlen(id) : 1);
        aw = HM_MAX(aw, a ? strlen(a) : 1);
    }
    printf("%-*s  %-*s  %-10s  %9s  %s\n", (int)idw, "PEER ID", (int)aw, "ADDRESS", "LAST SEEN",
           "RTT", "CONN");
    json_array_foreach(list, i, p) {
        const char *id = json_string_value(json_object_get(p, "peer_id"));
        const char *a = json_string_value(json_object_get(p, "address"));
        const json_t *seen = json_object_get(p, "last_seen_s");
        const json_t *rtt = json_object_get(p, "rtt_ms");
        char ago[32], rtts[32];
        format_ago(json_is_number(seen) ? json_number_value(seen) : -1, ago, sizeof(ago));
        if (json_is_number(rtt))
            snprintf(rtts, sizeof(rtts), "%.1f ms", json_number_value(rtt));
        else
            snprintf(rtts, sizeof(rtts), "-");
        printf("%-*s  %-*s  %-10s  %9s  %s\n", (int)idw, id ? id : "?", (int)aw, a ? a : "-", ago,
               rtts, json_is_true(json_object_get(p, "connected")) ? "yes" : "no");
    }
}

static void print_dht_info(const json_t *r)
{
    const json_t *rt = json_object_get(r, "routing_table");
    printf("routing table: %lld contacts, depth %lld, %lld buckets, %lld cached\n",
           (long long)json_integer_value(json_object_get(rt, "size")),
           (long long)json_integer_value(json_object_get(rt, "depth")),
           (long long)json_integer_value(json_object_get(rt, "buckets")),
           (long long)json_integer_value(json_object_get(rt, "cached")));
    static const char *const fields[] = {"records", "record_bytes", "lookups_active",
                                         "requests_sent", "requests_received", "timeouts",
                                         "rate_limited"};
    for (size_t i = 0; i < HM_ARRAY_LEN(fields); i++)
        printf("%s: %lld\n", fields[i],
               (long long)json_integer_value(json_object_get(r, fields[i])));
}

static void print_dht_values(const json_t *r)
{
    const json_t *values = json_object_get(r, "values");
    size_t i;
    const json_t *v;
    double now = (double)time(NULL);
    json_array_foreach(values, i, v) {
        const char *sub = json_string_value(json_object_get(v, "subkey"));
        const char *sub_hex = json_string_value(json_object_get(v, "subkey_hex"));
        const char *val = json_string_value(json_object_get(v, "value"));
        const char *val_hex = json_string_value(json_object_get(v, "value_hex"));
        double exp = json_number_value(json_object_get(v, "expiration"));
        if (sub != NULL || sub_hex != NULL)
            printf("%s%s\t", sub_hex ? "hex:" : "", sub ? sub : sub_hex);
        printf("%s%s\t(expires in %.0f s)\n", val_hex ? "hex:" : "", val ? val : val_hex,
               exp > now ? exp - now : 0.0);
    }
}

static void format_bytes(double b, char *buf, size_t len)
{
    if (b < 1024)
        snprintf(buf, len, "%.0f B", b);
    else if (b < 1024 * 1024)
        snprintf(buf, len, "%.1f KiB", b / 1024);
    else if (b < 1024.0 * 1024 * 1024)
        snprintf(buf, len, "%.1f MiB", b / 1024 / 1024);
    else
        snprintf(buf, len, "%.2f GiB", b / 1024 / 1024 / 1024);
}

static const char *jstr(const json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "?";
}

static double jnum(const json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

static void print_mask(const json_t *list)
{
    size_t i;
    const json_t *v;
    if (json_array_size(list) == 0)
        printf("-");
    json_array_foreach(list, i, v) printf("%s%lld", i ? "," : "", (long long)json_integer_value(v));
}

static void print_report(const json_t *r)
{
    char sent[32], recv[32];
    format_bytes(jnum(r, "bytes_sent"), sent, sizeof(sent));
    format_bytes(jnum(r, "bytes_received"), recv, sizeof(recv));
    printf("round %lld under '%s' (bits '%s'): %s\n", (long long)jnum(r, "round"),
           jstr(r, "prefix"), jstr(r, "group_bits"), jstr(r, "status"));
    printf("group: %lld members, group id %.16s, next bits '%s'\n", (long long)jnum(r, "group_size"),
           jstr(r, "group_id"), jstr(r, "next_bits"));
    printf("elements: %lld, weight %g, compression %s\n", (long long)jnum(r, "elements"),
           jnum(r, "weight"), jstr(r, "compression"));
    printf("duration: %.3f s (matchmaking %.3f s, all-reduce %.3f s)\n", jnum(r, "duration_s"),
           jnum(r, "matchmaking_s"), jnum(r, "allreduce_s"));
    printf("bytes: sent %s, received %s\n", sent, recv);
    const json_t *members = json_object_get(r, "members");
    size_t i;
    const json_t *m;
    printf("members:\n");
    json_array_foreach(members, i, m) {
        printf("  %2lld  %s  %-21s  %-5s%s\n", (long long)jnum(m, "index"), jstr(m, "peer_id"),
               jstr(m, "address"), jstr(m, "state"),
               json_is_true(json_object_get(m, "self")) ? "  (this node)" : "");
    }
    const json_t *left = json_object_get(r, "left_out");
    if (json_array_size(left) == 0) {
        printf("left out: nobody\n");
    } else {
        printf("left out:");
        json_array_foreach(left, i, m) printf(" %.12s (%s)", jstr(m, "peer_id"), jstr(m, "reason"));
        printf("\n");
    }
    const json_t *spans = json_object_get(r, "spans");
    printf("spans:\n");
    json_array_foreach(spans, i, m) {
        if (jnum(m, "count") == 0)
            continue;
        printf("  [%lld, +%lld) reduced by %lld, averaged over ", (long long)jnum(m, "offset"),
               (long long)jnum(m, "count"), (long long)jnum(m, "final_reducer"));
        print_mask(json_object_get(m, "contributors"));
        if (json_array_size(json_object_get(m, "partial")) > 0) {
            printf(", partly ");
            print_mask(json_object_get(m, "partial"));
        }
        printf("\n");
    }
    if (json_object_get(r, "out") != NULL)
        printf("wrote %s\n", jstr(r, "out"));
}

static void print_averaging(const json_t *r)
{
    const json_t *active = json_object_get(r, "active");
    const json_t *rounds = json_object_get(r, "rounds");
    size_t i;
    const json_t *e;
    json_array_foreach(active, i, e) {
        printf("in progress: round %lld under '%s', %s, %lld elements\n",
               (long long)jnum(e, "round"), jstr(e, "prefix"), jstr(e, "stage"),
               (long long)jnum(e, "elements"));
    }
    if (json_array_size(rounds) == 0) {
        printf("no averaging rounds yet\n");
        return;
    }
    printf("%5s  %-20s  %-24s  %5s  %-28s  %10s  %10s  %8s\n", "ROUND", "PREFIX", "STATUS",
           "GROUP", "LEFT OUT", "SENT", "RECEIVED", "TIME");
    json_array_foreach(rounds, i, e) {
        char sent[32], recv[32], left[64] = "-", status[64];
        format_bytes(jnum(e, "bytes_sent"), sent, sizeof(sent));
        format_bytes(jnum(e, "bytes_received"), recv, sizeof(recv));
        size_t k, used = 0;
        const json_t *m;
        json_array_foreach(json_object_get(e, "left_out"), k, m) {
            if (used + 16 >= sizeof(left))
                break;
            used += (size_t)snprintf(left + used, sizeof(left) - used, "%s%.8s:%s", k ? " " : "",
                                     jstr(m, "peer_id"), jstr(m, "reason"));
        }
        if (json_is_true(json_object_get(e, "ok")))
            snprintf(status, sizeof(status), "ok");
        else
            snprintf(status, sizeof(status), "%s (%s)", jstr(e, "status"), jstr(e, "stage"));
        printf("%5lld  %-20.20s  %-24.24s  %5lld  %-28.28s  %10s  %10s  %7.2fs\n",
               (long long)jnum(e, "round"), jstr(e, "prefix"), status,
               (long long)jnum(e, "group_size"), left, sent, recv, jnum(e, "duration_s"));
    }
}

static void print_experts(const json_t *r)
{
    const json_t *hosted = json_object_get(r, "hosted"), *swarm = json_object_get(r, "swarm");
    size_t i;
    const json_t *e;
    printf("hosted here: %zu\n", json_array_size(hosted));
    if (json_array_size(hosted) > 0)
        printf("  %-20s %5s %9s %9s %7s %9s %9s %8s\n", "UID", "DIM", "FORWARD", "BACKWARD",
               "BATCH", "P50_MS", "P99_MS", "STEPS");
    json_array_foreach(hosted, i, e)
    {
        printf("  %-20s %5lld %9lld %9lld %7.1f %9.2f %9.2f %8lld\n", jstr(e, "uid"),
               (long long)jnum(e, "dim"), (long long)jnum(e, "forward_requests"),
               (long long)jnum(e, "backward_requests"), jnum(e, "mean_batch_size"),
               jnum(e, "latency_p50_ms"), jnum(e, "latency_p99_ms"), (long long)jnum(e, "steps"));
    }
    printf("declared in the swarm: %zu\n", json_array_size(swarm));
    double now = (double)time(NULL);
    const json_t *off = json_object_get(r, "backed_off");
    json_array_foreach(swarm, i, e)
    {
        /* A host this daemon's calls skip for now is marked. */
        const char *host = jstr(e, "host");
        const json_t *b, *hit = NULL;
        size_t k;
        json_array_foreach(off, k, b)
        {
            const char *id = jstr(b, "peer_id");
            if (id[0] != '\0' && strncmp(host, id, strlen(id)) == 0)
                hit = b;
        }
        printf("  %-20s %s  expires in %.0f s", jstr(e, "uid"), host, jnum(e, "expires") - now);
        if (hit != NULL)
            printf("  backed off (%.0f s left)", jnum(hit, "left_s"));
        printf("\n");
    }
    if (json_array_size(off) > 0)
        printf("hosts backed off: %zu\n", json_array_size(off));
    json_array_foreach(off, i, e)
    {
        printf("  %.12s  %.0f s left of %.0f s, %lld stalls in a row\n", jstr(e, "peer_id"),
               jnum(e, "left_s"), jnum(e, "backoff_s"), (long long)jnum(e, "stalls"));
    }
}

/* ---- the command line ---- */

enum {
    OPT_IN = 256,
    OPT_OUT,
    OPT_WEIGHT,
    OPT_TARGET,
    OPT_MIN,
    OPT_ROUND_TIMEOUT,
    OPT_MM_TIME,
    OPT_COMPRESSION,
    OPT_GROUP_BITS,
    OPT_TYPE,
    OPT_DIM,
    OPT_HIDDEN,
    OPT_OPTIMIZER,
    OPT_LR,
    OPT_HEADS,
    OPT_MAX_SEQ,
    OPT_SEQ,
    OPT_PROGRESS_TARGET,
    OPT_STEP,
    OPT_MIN_AGREE,
    OPT_CHUNK_SIZE,
};

/* The averaging options; --in and --out also serve experts call. */
typedef struct avg_flags {
    const char *in, *out, *weight, *target, *min, *round_timeout, *mm_time, *compression,
        *group_bits;
    int any; /* some average option was given */
} avg_flags;

typedef struct ex_flags {
    const char *type, *dim, *hidden, *optimizer, *lr;
    const char *heads, *max_seq; /* transformer experts */
    int any;
} ex_flags;

/* The state options; --in, --out and --ttl serve state share and load too. */
typedef struct st_flags {
    const char *step, *min_agree, *chunk_size;
    int any;
} st_flags;

/* What the command line says besides the command's name. */
typedef struct cli {
    char **pos; /* the words after the command's name */
    int npos;
    const char *subkey;
    double ttl; /* 0: not given */
    double timeout_s;
    int timeout_given;
    avg_flags avg;
    ex_flags ex;
    st_flags st;
    const char *progress_target; /* progress --target */
    const char *seq;             /* experts call --seq (transformer experts) */
} cli;

/*
 * What a command's builder returns: the request is ready, or the command
 * line is wrong and the builder said why, or its words do not have the
 * shape of the command (main then prints the command's expected shape).
 */
enum { BUILD_OK = 0, BUILD_BAD = -1, BUILD_SHAPE = -2 };

/* A request on its way: args to send and how long to wait for the reply. */
typedef struct request {
    json_t *args;
    double wait_s;
} request;

/* path made absolute against the current directory (the daemon's differs). */
static json_t *abs_path(const char *path)
{
    if (path[0] == '/')
        return json_string(path);
    char cwd[4096];
    if (getcwd(cwd, sizeof(cwd)) == NULL)
        return NULL;
    size_t len = strlen(cwd) + 1 + strlen(path) + 1;
    char *p = malloc(len);
    if (p == NULL)
        return NULL;
    snprintf(p, len, "%s/%s", cwd, path);
    json_t *j = json_string(p);
    free(p);
    return j;
}

static int parse_num(const char *opt, const char *s, double lo, double hi, int integer,
                     double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !(v >= lo) || v > hi ||
        (integer && v != floor(v))) {
        fprintf(stderr, "hivemindctl: bad %s '%s': expected %s from %g to %g\n", opt, s,
                integer ? "an integer" : "a number", lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* ---- building the requests ---- */

/*
 * Sets args[key] to the number the option opt gave (s; nothing when NULL),
 * after checking it as parse_num does; *out (may be NULL) gets it too.
 */
static int set_num(json_t *args, const char *key, const char *opt, const char *s, double lo,
                   double hi, int integer, double *out)
{
    double v;
    if (s == NULL)
        return 0;
    if (parse_num(opt, s, lo, hi, integer, &v) < 0)
        return -1;
    json_object_set_new(args, key, integer ? json_integer((json_int_t)v) : json_real(v));
    if (out != NULL)
        *out = v;
    return 0;
}

/* Commands with nothing to say but their name: info, peers, metrics, ... */
static int build_plain(const cli *c, request *rq)
{
    (void)c;
    rq->args = json_object();
    return BUILD_OK;
}

static int build_dht_info(const cli *c, request *rq)
{
    if (c->npos != 1 || c->subkey != NULL || c->ttl > 0)
        return BUILD_SHAPE;
    return build_plain(c, rq);
}

static int build_dht_get(const cli *c, request *rq)
{
    if ((c->npos != 2 && c->npos != 3) || c->subkey != NULL || c->ttl > 0)
        return BUILD_SHAPE;
    rq->args = json_pack("{s:s}", "key", c->pos[1]);
    if (rq->args != NULL && c->npos == 3)
        json_object_set_new(rq->args, "subkey", json_string(c->pos[2]));
    return BUILD_OK;
}

static int build_dht_put(const cli *c, request *rq)
{
    if (c->npos != 3)
        return BUILD_SHAPE;
    rq->args = json_pack("{s:s, s:s}", "key", c->pos[1], "value", c->pos[2]);
    if (rq->args != NULL && c->subkey != NULL)
        json_object_set_new(rq->args, "subkey", json_string(c->subkey));
    if (rq->args != NULL && c->ttl > 0)
        json_object_set_new(rq->args, "ttl", json_real(c->ttl));
    return BUILD_OK;
}

/*
 * The "average" args. The wait is the round's own timeouts plus a margin:
 * a round may take both in full before the daemon answers.
 */
static int build_average(const cli *c, request *rq)
{
    const avg_flags *a = &c->avg;
    double mm_timeout = c->timeout_given ? c->timeout_s : 30, round_timeout = 30;
    json_t *args;
    if (c->npos != 1 || a->in == NULL || a->out == NULL)
        return BUILD_SHAPE;
    if (strlen(c->pos[0]) == 0 || strlen(c->pos[0]) > 128) {
        fprintf(stderr, "hivemindctl: PREFIX must be 1 to 128 bytes\n");
        return BUILD_BAD;
    }
    args = json_pack("{s:s, s:o, s:o, s:f}", "prefix", c->pos[0], "in", abs_path(a->in), "out",
                     abs_path(a->out), "timeout", mm_timeout);
    if (args == NULL) {
        fprintf(stderr, "hivemindctl: cannot make the paths absolute\n");
        return BUILD_BAD;
    }
    rq->args = args;
    if (set_num(args, "weight", "--weight", a->weight, 0, 1e300, 0, NULL) < 0 ||
        set_num(args, "target_group_size", "--target-group-size", a->target, 1, 64, 1, NULL) <
            0 ||
        set_num(args, "min_group_size", "--min-group-size", a->min, 1, 64, 1, NULL) < 0 ||
        set_num(args, "round_timeout", "--round-timeout", a->round_timeout, 0.001, 3600, 0,
                &round_timeout) < 0 ||
        set_num(args, "matchmaking_time", "--matchmaking-time", a->mm_time, 0.001, 3600, 0,
                NULL) < 0)
        return BUILD_BAD;
    if (a->compression != NULL) {
        if (strcmp(a->compression, "none") != 0 && strcmp(a->compression, "fp16") != 0 &&
            strcmp(a->compression, "8bit") != 0) {
            fprintf(stderr, "hivemindctl: --compression must be none, fp16 or 8bit\n");
            return BUILD_BAD;
        }
        json_object_set_new(args, "compression", json_string(a->compression));
    }
    if (a->group_bits != NULL)
        json_object_set_new(args, "group_bits", json_string(a->group_bits));
    rq->wait_s = mm_timeout + round_timeout + 15;
    return BUILD_OK;
}

static int build_experts_list(const cli *c, request *rq)
{
    if (c->npos > 2 || c->ex.any || c->avg.in != NULL || c->avg.out != NULL)
        return BUILD_SHAPE;
    rq->args = json_object();
    if (rq->args != NULL && c->npos == 2)
        json_object_set_new(rq->args, "prefix", json_string(c->pos[1]));
    return BUILD_OK;
}

static int build_experts_host(const cli *c, request *rq)
{
    const ex_flags *e = &c->ex;
    if (c->npos != 2 || c->avg.in != NULL || c->avg.out != NULL)
        return BUILD_SHAPE;
    json_t *args = rq->args = json_pack("{s:s}", "pattern", c->pos[1]);
    if (args == NULL)
        return BUILD_BAD;
    if (e->type != NULL)
        json_object_set_new(args, "type", json_string(e->type));
    if (e->optimizer != NULL)
        json_object_set_new(args, "optimizer", json_string(e->optimizer));
    if (set_num(args, "dim", "--dim", e->dim, 1, 8192, 1, NULL) < 0 ||
        set_num(args, "hidden", "--hidden", e->hidden, 0, 32768, 1, NULL) < 0 ||
        set_num(args, "lr", "--lr", e->lr, 1e-12, 10, 0, NULL) < 0 ||
        set_num(args, "heads", "--heads", e->heads, 0, 64, 1, NULL) < 0 ||
        set_num(args, "max_seq", "--max-seq", e->max_seq, 1, 2048, 1, NULL) < 0)
        return BUILD_BAD;
    return BUILD_OK;
}

/* One forward pass; the daemon answers within the call's timeout, so the wait is that plus slack. */
static int build_experts_call(const cli *c, request *rq)
{
    if (c->npos != 2 || c->ex.any)
        return BUILD_SHAPE;
    if (c->avg.in == NULL || c->avg.out == NULL) {
        fprintf(stderr, "hivemindctl: experts call needs --in FILE and --out FILE\n");
        return BUILD_BAD;
    }
    json_t *ip = abs_path(c->avg.in), *op = abs_path(c->avg.out);
    double t = c->timeout_given ? c->timeout_s : 30;
    if (ip == NULL || op == NULL || t > 600) {
        if (ip != NULL && op != NULL)
            fprintf(stderr, "hivemindctl: experts call: --timeout is at most 600\n");
        json_decref(ip);
        json_decref(op);
        return BUILD_BAD;
    }
    rq->wait_s = t + 5;
    rq->args = json_pack("{s:s, s:o, s:o, s:f}", "uid", c->pos[1], "in", ip, "out", op,
                         "timeout", t);
    if (rq->args == NULL || set_num(rq->args, "seq", "--seq", c->seq, 1, 2048, 1, NULL) < 0)
        return BUILD_BAD;
    return BUILD_OK;
}

/* The words of a state command: 'state VERB PREFIX'; NULL when PREFIX is bad (said why). */
static const char *state_prefix(const cli *c)
{
    const char *p = c->pos[1];
    if (strlen(p) == 0 || strlen(p) > 128 || strstr(p, "[owner:") != NULL) {
        fprintf(stderr, "hivemindctl: PREFIX must be 1 to 128 bytes without '[owner:'\n");
        return NULL;
    }
    return p;
}

static int build_state_share(const cli *c, request *rq)
{
    if (c->npos != 2 || c->avg.out != NULL || c->st.min_agree != NULL)
        return BUILD_SHAPE;
    if (c->avg.in == NULL || c->st.step == NULL) {
        fprintf(stderr, "hivemindctl: state share needs --step N and --in FILE\n");
        return BUILD_BAD;
    }
    const char *prefix = state_prefix(c);
    if (prefix == NULL)
        return BUILD_BAD;
    json_t *in = abs_path(c->avg.in);
    if (in == NULL) {
        fprintf(stderr, "hivemindctl: cannot make the path absolute\n");
        return BUILD_BAD;
    }
    json_t *args = rq->args = json_pack("{s:s, s:o}", "prefix", prefix, "in", in);
    if (args == NULL)
        return BUILD_BAD;
    if (set_num(args, "step", "--step", c->st.step, 0, 9007199254740991.0, 1, NULL) < 0 ||
        set_num(args, "chunk_size", "--chunk-size", c->st.chunk_size, 1024, 1048576, 1, NULL) <
            0)
        return BUILD_BAD;
    if (c->ttl > 0)
        json_object_set_new(args, "ttl", json_real(c->ttl));
    return BUILD_OK;
}

/* The download's own timeout (--timeout, default 300 s) plus a margin is the wait. */
static int build_state_load(const cli *c, request *rq)
{
    if (c->npos != 2 || c->avg.in != NULL || c->st.step != NULL || c->st.chunk_size != NULL ||
        c->ttl > 0)
        return BUILD_SHAPE;
    if (c->avg.out == NULL) {
        fprintf(stderr, "hivemindctl: state load needs --out FILE\n");
        return BUILD_BAD;
    }
    const char *prefix = state_prefix(c);
    if (prefix == NULL)
        return BUILD_BAD;
    double t = c->timeout_given ? c->timeout_s : 300;
    if (t > 3600) {
        fprintf(stderr, "hivemindctl: state load: --timeout is at most 3600\n");
        return BUILD_BAD;
    }
    json_t *out = abs_path(c->avg.out);
    if (out == NULL) {
        fprintf(stderr, "hivemindctl: cannot make the path absolute\n");
        return BUILD_BAD;
    }
    json_t *args = rq->args = json_pack("{s:s, s:o, s:f}", "prefix", prefix, "out", out,
                                        "timeout", t);
    if (args == NULL)
        return BUILD_BAD;
    if (set_num(args, "min_agree", "--min-agree", c->st.min_agree, 1, 16, 1, NULL) < 0)
        return BUILD_BAD;
    rq->wait_s = t + 15;
    return BUILD_OK;
}

static int build_state_info(const cli *c, request *rq)
{
    if (c->npos != 2 || c->avg.in != NULL || c->avg.out != NULL || c->st.any || c->ttl > 0)
        return BUILD_SHAPE;
    const char *prefix = state_prefix(c);
    if (prefix == NULL)
        return BUILD_BAD;
    rq->args = json_pack("{s:s}", "prefix", prefix);
    return BUILD_OK;
}

static void print_state_share(const json_t *r)
{
    char b[32];
    format_bytes(jnum(r, "bytes"), b, sizeof(b));
    printf("sharing '%s' at step %lld: %s in %lld chunks\n", jstr(r, "prefix"),
           (long long)jnum(r, "step"), b, (long long)jnum(r, "chunks"));
}

static void print_state_load(const json_t *r)
{
    char b[32];
    format_bytes(jnum(r, "bytes"), b, sizeof(b));
    printf("loaded '%s' at step %lld: %s in %.1f s into %s\n", jstr(r, "prefix"),
           (long long)jnum(r, "step"), b, jnum(r, "duration_s"), jstr(r, "out"));
    printf("hash: %s\n", jstr(r, "hash"));
    const json_t *donors = json_object_get(r, "donors");
    size_t i;
    const json_t *d;
    printf("%-52s  %-21s  %7s  %s\n", "DONOR", "ADDRESS", "CHUNKS", "DROPPED");
    json_array_foreach(donors, i, d) {
        const char *why = jstr(d, "dropped");
        printf("%-52s  %-21s  %7lld  %s\n", jstr(d, "peer"), jstr(d, "addr"),
               (long long)jnum(d, "chunks"), strcmp(why, "none") == 0 ? "-" : why);
    }
}

static void print_state_info(const json_t *r)
{
    char b[32];
    format_bytes(jnum(r, "bytes"), b, sizeof(b));
    printf("prefix: %s\nstep: %lld\nbytes: %s (%lld chunks of %lld)\n", jstr(r, "prefix"),
           (long long)jnum(r, "step"), b, (long long)jnum(r, "chunks"),
           (long long)jnum(r, "chunk_size"));
    printf("ready: %s\n", json_is_true(json_object_get(r, "ready")) ? "yes" : "no (hashing)");
    if (json_object_get(r, "hash") != NULL)
        printf("hash: %s\n", jstr(r, "hash"));
    printf("declared: %lld times\nserved: %lld chunks, %lld manifests, %lld refused busy\n",
           (long long)jnum(r, "declared"), (long long)jnum(r, "chunks_served"),
           (long long)jnum(r, "manifests_served"), (long long)jnum(r, "refused_busy"));
}

static int build_progress(const cli *c, request *rq)
{
    if (c->npos != 1)
        return BUILD_SHAPE;
    if (strlen(c->pos[0]) == 0 || strlen(c->pos[0]) > 128) {
        fprintf(stderr, "hivemindctl: RUN must be 1 to 128 bytes\n");
        return BUILD_BAD;
    }
    rq->args = json_pack("{s:s}", "run", c->pos[0]);
    if (rq->args == NULL)
        return BUILD_BAD;
    if (set_num(rq->args, "target_batch_size", "--target", c->progress_target, 1,
                9007199254740991.0, 1, NULL) < 0)
        return BUILD_BAD;
    return BUILD_OK;
}

static void print_progress(const json_t *r)
{
    const json_t *target = json_object_get(r, "target_batch_size");
    const json_t *eta = json_object_get(r, "eta_s");
    printf("run: %s\n", jstr(r, "run"));
    printf("global epoch: %lld\n", (long long)json_integer_value(json_object_get(r, "global_epoch")));
    if (target != NULL)
        printf("samples: %lld of %lld\n", (long long)json_integer_value(json_object_get(r, "samples")),
               (long long)json_integer_value(target));
    else
        printf("samples: %lld\n", (long long)json_integer_value(json_object_get(r, "samples")));
    printf("samples per second: %.1f\n", jnum(r, "samples_per_second"));
    if (json_is_number(eta))
        printf("eta: %.1f s\n", json_number_value(eta));
    else
        printf("eta: unknown\n");
    printf("peers: %lld, clients: %lld, origins: %lld\n",
           (long long)json_integer_value(json_object_get(r, "n_peers")),
           (long long)json_integer_value(json_object_get(r, "n_clients")),
           (long long)json_integer_value(json_object_get(r, "n_origins")));
    /* What the origin rules set aside (docs/security.md, "Swarm progress records"). */
    if (json_integer_value(json_object_get(r, "unverified")) > 0 ||
        json_integer_value(json_object_get(r, "stale")) > 0 ||
        json_integer_value(json_object_get(r, "held_back")) > 0 ||
        json_integer_value(json_object_get(r, "clamped")) > 0)
        printf("set aside: %lld unverified records, %lld stale, %lld origins held back, "
               "%lld clamped\n",
               (long long)json_integer_value(json_object_get(r, "unverified")),
               (long long)json_integer_value(json_object_get(r, "stale")),
               (long long)json_integer_value(json_object_get(r, "held_back")),
               (long long)json_integer_value(json_object_get(r, "clamped")));
    const json_t *peers = json_object_get(r, "peers");
    if (json_array_size(peers) > 0)
        printf("%-12s %8s %12s %10s %6s\n", "PEER", "EPOCH", "SAMPLES", "SAMPLES/S", "CLIENT");
    size_t i;
    const json_t *p;
    json_array_foreach(peers, i, p) {
        printf("%-12.12s %8lld %12lld %10.1f %6s\n", jstr(p, "peer"),
               (long long)json_integer_value(json_object_get(p, "epoch")),
               (long long)json_integer_value(json_object_get(p, "samples")),
               jnum(p, "samples_per_second"),
               json_is_true(json_object_get(p, "client")) ? "yes" : "no");
    }
}

static void print_status(const json_t *r)
{
    hm_top_render(stdout, r, 80, 0, NULL);
}

static void print_metrics(const json_t *r)
{
    const char *text = json_string_value(json_object_get(r, "text"));
    fputs(text ? text : "", stdout);
}

static void print_shutdown(const json_t *r)
{
    (void)r;
    printf("hivemindd is shutting down\n");
}

static void print_dht_put(const json_t *r)
{
    printf("stored on %lld replicas\n", (long long)json_integer_value(json_object_get(r, "stored")));
}

static void print_experts_host(const json_t *r)
{
    printf("hosting %lld more experts, %lld in all\n",
           (long long)json_integer_value(json_object_get(r, "added")),
           (long long)json_integer_value(json_object_get(r, "hosted")));
}

static void print_experts_call(const json_t *r)
{
    printf("%s at %s: %lld x %lld in %.3f s\n", jstr(r, "uid"), jstr(r, "peer"),
           (long long)json_integer_value(json_object_get(r, "batch")),
           (long long)json_integer_value(json_object_get(r, "dim")), jnum(r, "duration"));
}

/* A get that found nothing is a failure for scripts, like grep. */
static int dht_found(const cli *c, const json_t *r)
{
    if (json_is_true(json_object_get(r, "found")))
        return HM_EXIT_OK;
    fprintf(stderr, "hivemindctl: %s: not found\n", c->pos[1]);
    return HM_EXIT_FAILURE;
}

/* ---- the commands ---- */

typedef struct command {
    const char *name; /* the first word */
    const char *sub;  /* the second word, or NULL */
    const char *wire; /* the daemon's command */
    int (*build)(const cli *c, request *rq);
    void (*print)(const json_t *result); /* the result for people (not with --json) */
    /* The exit status of an ok reply, when its result can still be a failure. */
    int (*verdict)(const cli *c, const json_t *result);
} command;

static const command commands[] = {
    {"info", NULL, "info", build_plain, print_info, NULL},
    {"peers", NULL, "peers", build_plain, print_peers, NULL},
    {"metrics", NULL, "metrics", build_plain, print_metrics, NULL},
    {"shutdown", NULL, "shutdown", build_plain, print_shutdown, NULL},
    {"dht", "get", "dht.get", build_dht_get, print_dht_values, dht_found},
    {"dht", "put", "dht.put", build_dht_put, print_dht_put, NULL},
    {"dht", "info", "dht.info", build_dht_info, print_dht_info, NULL},
    {"average", NULL, "average", build_average, print_report, NULL},
    {"averaging", NULL, "averaging", build_plain, print_averaging, NULL},
    {"experts", "list", "experts.list", build_experts_list, print_experts, NULL},
    {"experts", "host", "experts.host", build_experts_host, print_experts_host, NULL},
    {"experts", "call", "experts.call", build_experts_call, print_experts_call, NULL},
    {"progress", NULL, "progress", build_progress, print_progress, NULL},
    {"state", "share", "state.share", build_state_share, print_state_share, NULL},
    {"state", "load", "state.load", build_state_load, print_state_load, NULL},
    {"state", "info", "state.info", build_state_info, print_state_info, NULL},
    {"status", NULL, "status", build_plain, print_status, NULL},
};

/*
 * The commands that take words after their name, with the shape that
 * usage errors repeat; the others stand alone ("one command at a time").
 */
static const struct {
    const char *name, *shape;
} worded[] = {
    {"dht", "'dht get KEY [SUBKEY]', 'dht put KEY VALUE [--subkey S] [--ttl SECONDS]' or "
            "'dht info'"},
    {"average", "'average PREFIX --in FILE --out FILE ...'"},
    {"progress", "'progress RUN [--target N]'"},
    {"state", "'state share PREFIX --step N --in FILE [--chunk-size B] [--ttl S]', 'state load "
              "PREFIX --out FILE [--min-agree N] [--timeout S]' or 'state info PREFIX'"},
    {"experts", "'experts list [PREFIX]', 'experts host PATTERN [--type T] [--dim D] "
                "[--hidden H] [--optimizer O] [--lr R] [--heads N] [--max-seq S]' or 'experts "
                "call UID --in FILE --out FILE [--seq S] [--timeout S]'"},
};

static const char *shape_of(const char *name)
{
    for (size_t i = 0; i < HM_ARRAY_LEN(worded); i++)
        if (strcmp(name, worded[i].name) == 0)
            return worded[i].shape;
    return NULL;
}

/* The row for name and its first word; *known_out says whether name is a command at all. */
static const command *find_command(const char *name, const char *word, int *known_out)
{
    *known_out = 0;
    for (size_t i = 0; i < HM_ARRAY_LEN(commands); i++) {
        const command *c = &commands[i];
        if (strcmp(c->name, name) != 0)
            continue;
        *known_out = 1;
        if (c->sub == NULL || (word != NULL && strcmp(c->sub, word) == 0))
            return c;
    }
    return NULL;
}

/*
 * Prints why a request failed, from the daemon's reply when one came (an
 * error reply, or the notice with which it ended the connection) and from
 * the library's outcome otherwise.
 */
static void print_failure(const char *sock, const char *wire, const request *rq,
                          const json_t *reply, int r, const hmc *h)
{
    if (reply != NULL) {
        const json_t *e = json_object_get(reply, "error");
        const char *msg = json_string_value(json_object_get(e, "message"));
        const char *ecode = json_string_value(json_object_get(e, "code"));
        fprintf(stderr, "hivemindctl: %s: %s%s%s%s\n", wire, msg ? msg : "error",
                ecode ? " (" : "", ecode ? ecode : "", ecode ? ")" : "");
    } else if (r == -ETIMEDOUT) {
        fprintf(stderr, "hivemindctl: no reply from %s within %g s\n", sock, rq->wait_s);
    } else if (r == -EPIPE) {
        fprintf(stderr, "hivemindctl: %s closed the connection without a reply\n", sock);
    } else if (r == -EPROTO) {
        fprintf(stderr, "hivemindctl: malformed reply from %s\n", sock);
    } else {
        fprintf(stderr, "hivemindctl: %s: %s\n", wire, hmc_last_error(h));
    }
}

/* Sends the request to the daemon at sock and prints its reply; the exit status. */
static int run(const char *sock, const command *cmd, const cli *c, const request *rq,
               int json_out)
{
    char path[HM_PATHS_SOCKET_LEN], err[HMC_ERROR_MAX];
    char *args = NULL, *line = NULL;
    json_t *reply = NULL;
    hmc *h = NULL;
    int result = HM_EXIT_FAILURE;

    if (sock == NULL) {
        if (hm_paths_client_control_socket(path, sizeof(path)) != 0) {
            fprintf(stderr, "hivemindctl: cannot tell the default control socket; use -s\n");
            goto out;
        }
        sock = path;
    }
    /* The wait bounds the connect as well as the reply: a daemon whose
     * backlog is full, or that is stopped, must not hang a script. */
    double ms = rq->wait_s * 1000;
    int wait_ms = ms < 1 ? 1 : ms > INT_MAX ? INT_MAX : (int)ms;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int r = hmc_connect_timeout(sock, wait_ms, &h, err, sizeof(err));
    if (r == -ENAMETOOLONG) {
        fprintf(stderr, "hivemindctl: socket path too long: %s\n", sock);
        result = HM_EXIT_USAGE;
        goto out;
    }
    if (r != 0) {
        fprintf(stderr, "hivemindctl: cannot connect to %s: %s (is hivemindd running?)\n", sock,
                strerror(-r));
        result = r == -EACCES || r == -EPERM ? HM_EXIT_NOPERM : HM_EXIT_UNAVAILABLE;
        goto out;
    }
    args = json_dumps(rq->args, JSON_COMPACT);
    if (args == NULL) {
        fprintf(stderr, "hivemindctl: out of memory\n");
        goto out;
    }
    /* One deadline for both: the call gets what the connect left of it. */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double spent = (double)(now.tv_sec - start.tv_sec) * 1000 +
                   (double)(now.tv_nsec - start.tv_nsec) / 1e6;
    int left_ms = spent >= wait_ms - 1 ? 1 : wait_ms - (int)spent;
    r = hmc_call(h, cmd->wire, args, left_ms, NULL, &line);
    if (line != NULL) {
        reply = json_loads(line, 0, NULL);
        if (json_out)
            printf("%s\n", line);
    }
    if (r != 0) {
        print_failure(sock, cmd->wire, rq, reply, r, h);
        if (reply == NULL && r == -ETIMEDOUT)
            result = HM_EXIT_TEMPFAIL;
        else if (reply == NULL && r == -EPROTO)
            result = HM_EXIT_PROTOCOL;
        goto out;
    }
    const json_t *res = json_object_get(reply, "result");
    if (!json_out)
        cmd->print(res);
    result = cmd->verdict != NULL ? cmd->verdict(c, res) : HM_EXIT_OK;
    if (result == HM_EXIT_OK && fflush(stdout) != 0)
        result = HM_EXIT_FAILURE;
out:
    json_decref(reply);
    hmc_free_string(line);
    free(args);
    hmc_close(h);
    return result;
}

int main(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"socket", required_argument, NULL, 's'}, {"json", no_argument, NULL, 'j'},
        {"timeout", required_argument, NULL, 'T'}, {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},          {"subkey", required_argument, NULL, 'K'},
        {"ttl", required_argument, NULL, 'L'},
        {"in", required_argument, NULL, OPT_IN},
        {"out", required_argument, NULL, OPT_OUT},
        {"weight", required_argument, NULL, OPT_WEIGHT},
        {"target-group-size", required_argument, NULL, OPT_TARGET},
        {"min-group-size", required_argument, NULL, OPT_MIN},
        {"round-timeout", required_argument, NULL, OPT_ROUND_TIMEOUT},
        {"matchmaking-time", required_argument, NULL, OPT_MM_TIME},
        {"compression", required_argument, NULL, OPT_COMPRESSION},
        {"group-bits", required_argument, NULL, OPT_GROUP_BITS},
        {"type", required_argument, NULL, OPT_TYPE},
        {"dim", required_argument, NULL, OPT_DIM},
        {"hidden", required_argument, NULL, OPT_HIDDEN},
        {"optimizer", required_argument, NULL, OPT_OPTIMIZER},
        {"lr", required_argument, NULL, OPT_LR},
        {"heads", required_argument, NULL, OPT_HEADS},
        {"max-seq", required_argument, NULL, OPT_MAX_SEQ},
        {"seq", required_argument, NULL, OPT_SEQ},
        {"target", required_argument, NULL, OPT_PROGRESS_TARGET},
        {"step", required_argument, NULL, OPT_STEP},
        {"min-agree", required_argument, NULL, OPT_MIN_AGREE},
        {"chunk-size", required_argument, NULL, OPT_CHUNK_SIZE},
        {NULL, 0, NULL, 0},
    };
    cli c = {.timeout_s = 10};
    avg_flags *avg = &c.avg;
    ex_flags *ex = &c.ex;
    const char *sock = NULL;
    int json_out = 0;

    /* SIGPIPE is left alone: sends use MSG_NOSIGNAL, and `hivemindctl metrics |
     * head` should end quietly the way other tools do. */
    opterr = 0;
    for (;;) {
        int prev = optind;
        int ch = getopt_long(argc, argv, ":s:jT:Vh", longopts, NULL);
        if (ch == -1)
            break;
        switch (ch) {
        case 's':
            sock = optarg;
            break;
        case 'j':
            json_out = 1;
            break;
        case 'T': {
            char *end;
            errno = 0;
            c.timeout_s = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(c.timeout_s > 0) ||
                c.timeout_s > 86400) {
                fprintf(stderr, "hivemindctl: bad --timeout '%s': expected seconds, more than 0 "
                        "and at most 86400\n", optarg);
                return HM_EXIT_USAGE;
            }
            c.timeout_given = 1;
            break;
        }
        case OPT_IN:
            avg->in = optarg, avg->any = 1;
            break;
        case OPT_OUT:
            avg->out = optarg, avg->any = 1;
            break;
        case OPT_WEIGHT:
            avg->weight = optarg, avg->any = 1;
            break;
        case OPT_TARGET:
            avg->target = optarg, avg->any = 1;
            break;
        case OPT_MIN:
            avg->min = optarg, avg->any = 1;
            break;
        case OPT_ROUND_TIMEOUT:
            avg->round_timeout = optarg, avg->any = 1;
            break;
        case OPT_MM_TIME:
            avg->mm_time = optarg, avg->any = 1;
            break;
        case OPT_COMPRESSION:
            avg->compression = optarg, avg->any = 1;
            break;
        case OPT_GROUP_BITS:
            avg->group_bits = optarg, avg->any = 1;
            break;
        case OPT_TYPE:
            ex->type = optarg, ex->any = 1;
            break;
        case OPT_DIM:
            ex->dim = optarg, ex->any = 1;
            break;
        case OPT_HIDDEN:
            ex->hidden = optarg, ex->any = 1;
            break;
        case OPT_OPTIMIZER:
            ex->optimizer = optarg, ex->any = 1;
            break;
        case OPT_LR:
            ex->lr = optarg, ex->any = 1;
            break;
        case OPT_HEADS:
            ex->heads = optarg, ex->any = 1;
            break;
        case OPT_MAX_SEQ:
            ex->max_seq = optarg, ex->any = 1;
            break;
        case OPT_SEQ:
            c.seq = optarg;
            break;
        case OPT_PROGRESS_TARGET:
            c.progress_target = optarg;
            break;
        case OPT_STEP:
            c.st.step = optarg, c.st.any = 1;
            break;
        case OPT_MIN_AGREE:
            c.st.min_agree = optarg, c.st.any = 1;
            break;
        case OPT_CHUNK_SIZE:
            c.st.chunk_size = optarg, c.st.any = 1;
            break;
        case 'K':
            c.subkey = optarg;
            break;
        case 'L': {
            char *end;
            errno = 0;
            c.ttl = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(c.ttl > 0) || c.ttl > 86400) {
                fprintf(stderr, "hivemindctl: bad --ttl '%s': expected seconds, more than 0 and "
                        "at most 86400\n", optarg);
                return HM_EXIT_USAGE;
            }
            break;
        }
        case 'V':
            printf("hivemindctl %s\n", PACKAGE_VERSION);
            return HM_EXIT_OK;
        case 'h':
            usage(stdout);
            return HM_EXIT_OK;
        case ':':
            fprintf(stderr, "hivemindctl: option '%s' needs a value\n",
                    prev < argc ? argv[prev] : "?");
            usage_hint();
            return HM_EXIT_USAGE;
        default:
            fprintf(stderr, "hivemindctl: unknown option '%s'\n", prev < argc ? argv[prev] : "?");
            usage_hint();
            return HM_EXIT_USAGE;
        }
    }
    if (optind >= argc) {
        fprintf(stderr, "hivemindctl: no command given\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    const char *name = argv[optind];
    if (strcmp(name, "top") == 0) {
        char path[HM_PATHS_SOCKET_LEN];
        if (optind + 1 < argc || json_out) {
            fprintf(stderr, "hivemindctl: top takes no arguments (and no --json)\n");
            usage_hint();
            return HM_EXIT_USAGE;
        }
        if (sock == NULL) {
            if (hm_paths_client_control_socket(path, sizeof(path)) != 0) {
                fprintf(stderr, "hivemindctl: cannot tell the default control socket; use -s\n");
                return HM_EXIT_FAILURE;
            }
            sock = path;
        }
        return hm_top_run(sock, 2.0, 0);
    }
    c.pos = argv + optind + 1;
    c.npos = argc - optind - 1;
    const char *shape = shape_of(name);
    if (shape == NULL && c.npos > 0) {
        fprintf(stderr, "hivemindctl: one command at a time\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    int known;
    const command *cmd = find_command(name, c.npos > 0 ? c.pos[0] : NULL, &known);
    if (!known) {
        fprintf(stderr, "hivemindctl: unknown command '%s'\n", name);
        usage_hint();
        return HM_EXIT_USAGE;
    }
    if (ex->any && strcmp(name, "experts") != 0) {
        fprintf(stderr, "hivemindctl: --type, --dim, --hidden, --optimizer, --lr, --heads and "
                "--max-seq go with experts host\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    if (c.seq != NULL && strcmp(name, "experts") != 0) {
        fprintf(stderr, "hivemindctl: --seq goes with experts call\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    int in_out_only = avg->in != NULL || avg->out != NULL;
    if (avg->any && (strcmp(name, "experts") == 0 || strcmp(name, "state") == 0) &&
        in_out_only && avg->weight == NULL &&
        avg->target == NULL && avg->min == NULL && avg->round_timeout == NULL &&
        avg->mm_time == NULL && avg->compression == NULL && avg->group_bits == NULL) {
        /* --in and --out also go with experts call and state share / load. */
    } else if (avg->any && strcmp(name, "average") != 0) {
        fprintf(stderr, "hivemindctl: --in, --out, --weight and the other averaging options go "
                "with average\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    if ((c.subkey != NULL || c.ttl > 0) && strcmp(name, "dht") != 0 &&
        !(c.subkey == NULL && strcmp(name, "state") == 0)) {
        fprintf(stderr, "hivemindctl: --subkey and --ttl go with dht put (--ttl also with state "
                "share)\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    if (c.st.any && strcmp(name, "state") != 0) {
        fprintf(stderr, "hivemindctl: --step, --chunk-size and --min-agree go with state\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    if (c.progress_target != NULL && strcmp(name, "progress") != 0) {
        fprintf(stderr, "hivemindctl: --target goes with progress\n");
        usage_hint();
        return HM_EXIT_USAGE;
    }
    request rq = {.args = NULL, .wait_s = c.timeout_s};
    int b = cmd != NULL ? cmd->build(&c, &rq) : BUILD_SHAPE;
    if (b == BUILD_OK && rq.args == NULL)
        b = BUILD_BAD; /* out of memory, or words that are not UTF-8 */
    if (b == BUILD_SHAPE)
        fprintf(stderr, "hivemindctl: expected %s\n", shape);
    if (b != BUILD_OK) {
        json_decref(rq.args);
        usage_hint();
        return HM_EXIT_USAGE;
    }
    int code = run(sock, cmd, &c, &rq, json_out);
    json_decref(rq.args);
    return code;
}
