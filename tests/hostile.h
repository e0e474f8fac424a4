/*
 * hostile: the attacker's side of the tests in docs/security.md. Each
 * hostile test runs honest hivemindd processes (proc.h) on 127.0.0.1 and
 * plays the attacker in its own process, from other loopback addresses
 * (127.0.0.2 and up, each its own origin), with hivemindd's own libraries:
 * it speaks the protocol exactly, under as many identities as it likes.
 * These helpers parse a daemon's address, make attacker nodes and rpc
 * endpoints on a chosen address, drive their loop, and read the victim's
 * resident memory and CPU time from /proc.
 */
#ifndef HM_TEST_HOSTILE_H
#define HM_TEST_HOSTILE_H

#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>
#include <uv.h>

#include "src/base/crypto.h"
#include "src/base/util.h"
#include "src/net/rpc.h"
#include "src/node/node.h"

/* A daemon's printed address PEERID@HOST:PORT as key and socket address. */
static inline void hm_hostile_parse_peer(const char *addr, uint8_t pk[HM_PK_BYTES],
                                         struct sockaddr_storage *sa)
{
    const char *at = strchr(addr, '@');
    cr_assert_not_null(at, "address %s", addr);
    cr_assert_eq(hm_base32_decode(addr, (size_t)(at - addr), pk, HM_PK_BYTES), HM_PK_BYTES,
                 "peer id of %s", addr);
    cr_assert_eq(hm_parse_hostport(at + 1, sa), 0, "host:port of %s", addr);
}

/* An rpc endpoint (fresh identity unless id is given) listening on
 * ip:0, in swarm "default" as the daemons are unless told otherwise. */
static inline hm_rpc *hm_hostile_rpc(uv_loop_t *loop, const char *ip, hm_identity *id_out,
                                     const hm_transport_config *tc)
{
    static char listen[16][64];
    static unsigned next;
    char *l = listen[next++ % 16];
    snprintf(l, 64, "%s:0", ip);
    hm_identity id;
    cr_assert_eq(hm_identity_generate(&id), 0);
    uint8_t swarm[HM_SWARM_ID_BYTES];
    hm_swarm_id("default", NULL, 0, swarm);
    hm_transport_config cfg = {0};
    if (tc != NULL)
        cfg = *tc;
    cfg.listen = l;
    hm_rpc *r = NULL;
    cr_assert_eq(hm_rpc_new(loop, &id, swarm, &cfg, NULL, &r), 0, "attacker rpc on %s", ip);
    if (id_out != NULL)
        *id_out = id;
    return r;
}

/* A whole node (peer table, DHT) on ip:0 that joins through peer. */
static inline hm_node *hm_hostile_node(uv_loop_t *loop, const char *ip, const char *peer)
{
    static char listen[16][64];
    static unsigned next;
    char *l = listen[next++ % 16];
    snprintf(l, 64, "%s:0", ip);
    hm_node_options o = {0};
    const char *peers[1] = {peer};
    signal(SIGPIPE, SIG_IGN);
    o.listen = l;
    o.ping_interval_ms = 1000;
    if (peer != NULL) {
        o.initial_peers = peers;
        o.n_initial_peers = 1;
    }
    hm_node *n = NULL;
    char err[256] = "";
    cr_assert_eq(hm_node_new(loop, &o, &n, err, sizeof(err)), 0, "attacker node: %s", err);
    return n;
}

static inline void hm_hostile_tick(uv_timer_t *t) { (void)t; }

/* Runs loop for ms milliseconds (a timer keeps it turning). */
static inline void hm_hostile_run_for(uv_loop_t *loop, uint64_t ms)
{
    uint64_t end = hm_now_ms() + ms;
    uv_timer_t tick;
    uv_timer_init(loop, &tick);
    uv_timer_start(&tick, hm_hostile_tick, 5, 5);
    while (hm_now_ms() < end)
        uv_run(loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
}

/* Resident memory of pid in KiB (VmRSS), or -1. */
static inline long hm_hostile_rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    long kib = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

/* CPU time (user + system) pid has used, in seconds, or -1. */
static inline double hm_hostile_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* Fields 14 and 15 (utime, stime) follow the ")" that ends the name. */
    char *p = strrchr(buf, ')');
    unsigned long ut, st;
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

#endif
