/*
 * main: the lifecycle of hivemindd. It reads the configuration (config.c),
 * starts one node (node.c), its averager, the shared-memory registry
 * (shm.c) and the control socket (control.c) on one libuv loop, lets each
 * command group register its commands (the list below, daemon.h), and
 * handles the process's signals: SIGTERM and SIGINT drain and exit 0,
 * SIGHUP re-reads the config file. It owns the loop, the node, the
 * averager, the shared-memory registry, the control server, the signal
 * handles and the order of the shutdown; the command groups own only
 * their commands in flight.
 *
 * Once the node listens and the control socket is up, the node's address
 * PEERID@HOST:PORT is written alone on the first line of standard output
 * (and flushed), so that scripts can read it with `head -n 1`. Logs go to
 * standard error.
 *
 * systemd readiness is told without libsystemd: when NOTIFY_SOCKET names a
 * socket (a path, or @name for an abstract one) the daemon sends READY=1
 * once listening, RELOADING=1 and READY=1 around a reload, and STOPPING=1
 * when it begins to shut down.
 */
#include "config.h"

#include "averaging/averager.h"
#include "src/base/crypto.h"
#include "src/base/util.h"
#include "src/daemon/cmd_experts.h"
#include "src/daemon/cmd_state.h"
#include "src/daemon/cmd_status.h"
#include "src/daemon/http.h"
#include "src/daemon/control.h"
#include "src/daemon/daemon.h"
#include "src/daemon/hm_config.h"
#include "src/daemon/shm.h"
#include "src/net/rpc.h"
#include "src/node/node.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#define MOD "hivemindd"

typedef struct daemon {
    hm_daemon pub;      /* what the command groups see (daemon.h) */
    uv_loop_t loop;
    hm_config cfg;      /* the configuration in force */
    hm_config_args args;
    hm_control *ctl;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t defer_close; /* close_node after the experts group, off its callback */
    int signals_open;
    int parts_open;     /* parts whose close callback has not come yet */
    int loop_open;      /* the loop was initialised */
    uint8_t swarm_key[32];
    int have_swarm_key;
    int lock_fd;        /* the state directory's lock, held until exit; -1 */
    hm_config_addrs addrs; /* cfg's addresses with their host names resolved at start */
    int start_exit;     /* the exit status of a failed start, when not HM_EXIT_FAILURE */
} daemon_t;

/*
 * The command groups, in the order they register. Each registers its own
 * commands (daemon.h); those with state of their own hang it on pub and
 * are closed by close_groups.
 */
static const struct {
    const char *name;
    hm_daemon_group_fn reg;
} groups[] = {
    {"node", hm_cmd_node_register},       {"dht", hm_cmd_dht_register},
    {"average", hm_cmd_average_register}, {"shm", hm_cmd_shm_register},
    {"experts", hm_cmd_experts_register}, {"state", hm_cmd_state_register},
    {"progress", hm_cmd_progress_register},
    {"status", hm_cmd_status_register},
};

/* The command groups that hold state of their own and have not closed. */
static int groups_open(const daemon_t *d)
{
    return (d->pub.experts != NULL) + (d->pub.average != NULL) + (d->pub.state != NULL) +
           (d->pub.progress != NULL) + (d->pub.status != NULL);
}

/* ---- systemd notification ---- */

static void sd_notify_msg(const char *msg)
{
    const char *e = getenv("NOTIFY_SOCKET");
    struct sockaddr_un sa;
    size_t n;

    if (e == NULL || (e[0] != '/' && e[0] != '@'))
        return;
    n = strlen(e);
    if (n >= sizeof(sa.sun_path))
        return;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, e, n);
    if (e[0] == '@')
        sa.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    if (sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (struct sockaddr *)&sa, len) < 0)
        hm_debug(MOD, "notify socket %s: %s", e, strerror(errno));
    close(fd);
}

static void sd_notify_reloading(void)
{
    char msg[96];
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* systemd 253+ wants the time of the reload with RELOADING=1. */
    snprintf(msg, sizeof(msg), "RELOADING=1\nMONOTONIC_USEC=%llu",
             (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000);
    sd_notify_msg(msg);
}

/* ---- shutdown ---- */

static void on_part_closed(void *ud)
{
    daemon_t *d = ud;
    d->parts_open--;
}

static void close_node(daemon_t *d);

/* The progress group ties reports to connections, so it closes once the
 * control server (and with it every connection) has. */
static void on_ctl_closed(void *ud)
{
    daemon_t *d = ud;
    d->parts_open--;
    if (d->pub.progress != NULL) {
        hm_cmd_progress *p = d->pub.progress;
        d->pub.progress = NULL;
        hm_cmd_progress_close(p, on_part_closed, d);
    }
}

static void on_defer_close(uv_timer_t *t)
{
    daemon_t *d = t->data;
    uv_close((uv_handle_t *)t, NULL);
    close_node(d);
}

static void on_experts_closed(void *ud)
{
    daemon_t *d = ud;
    d->parts_open--;
    /* The experts group may settle from inside a DHT callback (an
     * experts.list walk that ends, such as the status snapshot's), and the
     * node must not be freed under its own DHT: the rest closes on the
     * next turn of the loop. */
    uv_timer_init(&d->loop, &d->defer_close);
    d->defer_close.data = d;
    uv_timer_start(&d->defer_close, on_defer_close, 0, 0);
}

static void begin_shutdown(daemon_t *d, const char *why)
{
    if (d->pub.stopping)
        return;
    d->pub.stopping = 1;
    sd_notify_msg("STOPPING=1");
    hm_info(MOD, "shutting down (%s)", why);
    /* With the handlers gone a second SIGTERM or SIGINT kills the process
     * outright, which is the way out of a drain that hangs. */
    if (d->signals_open) {
        uv_close((uv_handle_t *)&d->sig_term, NULL);
        uv_close((uv_handle_t *)&d->sig_int, NULL);
        uv_close((uv_handle_t *)&d->sig_hup, NULL);
        d->signals_open = 0;
    }
    /* The control socket closes last but the node, so that commands ended
     * by the shutdown are still answered ("stopping"). The expert server
     * checkpoints and withdraws its DHT declarations while the node still
     * runs; the rest closes after it. */
    if (d->pub.experts != NULL) {
        hm_cmd_experts *m = d->pub.experts;
        d->pub.experts = NULL;
        hm_cmd_experts_close(m, on_experts_closed, d);
        return;
    }
    close_node(d);
}

/* The "shutdown" command's way in (hm_daemon.stop). */
static void stop_daemon(hm_daemon *pub, const char *why)
{
    begin_shutdown((daemon_t *)((char *)pub - offsetof(daemon_t, pub)), why);
}

static void close_node(daemon_t *d)
{
    /* The HTTP listener and the status snapshot first: they run commands
     * of the groups below through the control server. */
    if (d->pub.http != NULL) {
        hm_http_close(d->pub.http, on_part_closed, d);
        d->pub.http = NULL;
        d->pub.http_address[0] = '\0';
    }
    if (d->pub.status != NULL) {
        hm_cmd_status_close(d->pub.status, on_part_closed, d);
        d->pub.status = NULL;
    }
    if (d->pub.state != NULL) {
        hm_cmd_state_close(d->pub.state, on_part_closed, d);
        d->pub.state = NULL;
    }
    /* Rounds end (-ECANCELED) and are answered before the socket closes;
     * "average" commands whose files are being read or written answer when
     * that work is over, and their group is freed after the last. */
    if (d->pub.av != NULL) {
        hm_averager_close(d->pub.av, on_part_closed, d);
        d->pub.av = NULL;
    }
    if (d->pub.average != NULL) {
        hm_cmd_average_close(d->pub.average, on_part_closed, d);
        d->pub.average = NULL;
    }
    if (d->ctl != NULL) {
        hm_control_close(d->ctl, on_ctl_closed, d);
        d->ctl = NULL;
    }
    if (d->pub.node != NULL) {
        hm_node_close(d->pub.node, on_part_closed, d);
        d->pub.node = NULL;
    }
}

/* ---- reload ---- */

static int has_peer(const hm_config *c, const char *addr)
{
    for (size_t i = 0; i < c->n_initial_peers; i++)
        if (strcmp(c->initial_peers[i], addr) == 0)
            return 1;
    return 0;
}

/*
 * A peer added by a reload whose host is a name: resolved on libuv's
 * threadpool (uv_getaddrinfo), never on the loop, and added when the
 * answer comes, unless the daemon is stopping by then. The request keeps
 * the loop alive until its callback, so d outlives it.
 */
typedef struct reload_peer {
    uv_getaddrinfo_t req;
    daemon_t *d;
    char peer[HM_CONFIG_PEER_LEN];
    unsigned port;
} reload_peer;

static void on_reload_peer_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    reload_peer *rp = req->data;
    daemon_t *d = rp->d;
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *ai = res; status == 0 && ai != NULL; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
        if (ai->ai_family == AF_INET6 && pick == NULL)
            pick = ai;
    }
    if (d->pub.node == NULL) {
        /* stopping: nothing to add to */
    } else if (pick == NULL) {
        hm_warn(MOD, "SIGHUP: initial peer %s not added: cannot resolve its host: %s", rp->peer,
                status != 0 ? uv_strerror(status) : "no IPv4 or IPv6 address");
    } else {
        struct sockaddr_storage ss;
        char num[HM_CONFIG_NUMERIC_PEER_LEN];
        memset(&ss, 0, sizeof(ss));
        memcpy(&ss, pick->ai_addr, pick->ai_addrlen);
        if (pick->ai_family == AF_INET)
            ((struct sockaddr_in *)&ss)->sin_port = htons((uint16_t)rp->port);
        else
            ((struct sockaddr_in6 *)&ss)->sin6_port = htons((uint16_t)rp->port);
        memcpy(num, rp->peer, 53);
        hm_format_addr((const struct sockaddr *)&ss, num + 53, sizeof(num) - 53);
        int r = hm_node_add_peer(d->pub.node, num);
        if (r < 0)
            hm_warn(MOD, "SIGHUP: initial peer %s (%s) not added: %s", rp->peer, num + 53,
                    hm_strerror(r));
        else
            hm_info(MOD, "SIGHUP: added initial peer %s at %s", rp->peer, num + 53);
    }
    uv_freeaddrinfo(res);
    free(rp);
}

/* Adds one initial peer named by a reload: at once when its host is numeric. */
static void reload_add_peer(daemon_t *d, const char *p)
{
    struct sockaddr_storage ss;
    const char *at = strchr(p, '@');
    char host[HM_HOSTNAME_MAX + 2];
    unsigned port;
    if (at == NULL || hm_parse_hostport(at + 1, &ss) == 0) {
        int r = hm_node_add_peer(d->pub.node, p);
        if (r < 0)
            hm_warn(MOD, "SIGHUP: initial peer %s not added: %s", p, hm_strerror(r));
        else
            hm_info(MOD, "SIGHUP: added initial peer %s", p);
        return;
    }
    reload_peer *rp = calloc(1, sizeof(*rp));
    if (rp == NULL || hm_split_hostport(at + 1, host, sizeof(host), &port) != 0) {
        hm_warn(MOD, "SIGHUP: initial peer %s not added: %s", p,
                rp == NULL ? "out of memory" : "bad address");
        free(rp);
        return;
    }
    rp->d = d;
    rp->port = port;
    hm_strlcpy(rp->peer, p, sizeof(rp->peer));
    rp->req.data = rp;
    struct addrinfo hints;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    int r = uv_getaddrinfo(&d->loop, &rp->req, on_reload_peer_resolved, host, NULL, &hints);
    if (r != 0) {
        hm_warn(MOD, "SIGHUP: initial peer %s not added: %s", p, uv_strerror(r));
        free(rp);
    }
}

static void reload(daemon_t *d)
{
    hm_config *fresh = NULL;
    char err[512];
    const char *changed[32];
    int reloadable[32];

    sd_notify_reloading();
    if (d->args.config_file == NULL) {
        hm_info(MOD, "SIGHUP: no config file was given (-c), nothing to re-read");
        goto out;
    }
    fresh = malloc(sizeof(*fresh));
    if (fresh == NULL) {
        hm_error(MOD, "SIGHUP: out of memory; keeping the running configuration");
        goto out;
    }
    if (hm_config_build(fresh, &d->args, err, sizeof(err)) != 0) {
        hm_error(MOD, "SIGHUP: %s; keeping the running configuration", err);
        goto out;
    }
    size_t n = hm_config_diff(&d->cfg, fresh, changed, reloadable, HM_ARRAY_LEN(changed));
    if (n == 0)
        hm_info(MOD, "SIGHUP: %s re-read, nothing changed", d->args.config_file);
    for (size_t i = 0; i < n && i < HM_ARRAY_LEN(changed); i++) {
        if (!reloadable[i]) {
            hm_warn(MOD, "SIGHUP: %s changed; restart hivemindd to apply it", changed[i]);
            continue;
        }
        if (strcmp(changed[i], "LogLevel") == 0) {
            hm_log_set_level(fresh->log_level);
            hm_info(MOD, "SIGHUP: LogLevel is now %s", hm_log_level_name(fresh->log_level));
            d->cfg.log_level = fresh->log_level;
        } else if (strcmp(changed[i], "InitialPeers") == 0) {
            for (size_t j = 0; j < fresh->n_initial_peers; j++) {
                const char *p = fresh->initial_peers[j];
                if (has_peer(&d->cfg, p) || d->pub.node == NULL)
                    continue;
                reload_add_peer(d, p);
            }
            memcpy(d->cfg.initial_peers, fresh->initial_peers, sizeof(d->cfg.initial_peers));
            d->cfg.n_initial_peers = fresh->n_initial_peers;
        }
    }
out:
    free(fresh);
    sd_notify_msg("READY=1");
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_t *d = h->data;
    if (signum == SIGHUP)
        reload(d);
    else
        begin_shutdown(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* ---- start ---- */

/*
 * Takes the state directory's lock (DIR/lock, flock): the directory holds
 * the node's identity, so two daemons sharing it would be one peer id at
 * two addresses, and their peers' tables would swap between them without a
 * word. The lock goes with the process, so a crashed daemon never leaves
 * it behind; the file keeps the holder's pid for the message.
 */
static int lock_state_dir(daemon_t *d, char *err, size_t errlen)
{
    char path[HM_CONFIG_PATH_LEN + 8];
    int n = snprintf(path, sizeof(path), "%s/lock", d->cfg.state_dir);
    if (n < 0 || (size_t)n >= sizeof(path)) {
        snprintf(err, errlen, "state directory path too long: %.700s", d->cfg.state_dir);
        return -ENAMETOOLONG;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        int e = errno;
        snprintf(err, errlen, "cannot open the state directory's lock %.700s: %s", path,
                 strerror(e));
        return -e;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char pid[24] = "";
        ssize_t got = pread(fd, pid, sizeof(pid) - 1, 0);
        if (got > 0) {
            pid[got] = '\0';
            pid[strcspn(pid, "\n")] = '\0';
        }
        close(fd);
        if (e == EWOULDBLOCK) {
            snprintf(err, errlen,
                     "the state directory %.700s is in use by another hivemindd%s%s%s: each daemon "
                     "needs its own --state-dir (it holds the node's identity)",
                     d->cfg.state_dir, pid[0] ? " (pid " : "", pid, pid[0] ? ")" : "");
            /* EX_TEMPFAIL: it may start once the other daemon is gone. */
            d->start_exit = HM_EXIT_TEMPFAIL;
            return -EBUSY;
        }
        snprintf(err, errlen, "cannot lock %.700s: %s", path, strerror(e));
        return -e;
    }
    char line[24];
    int len = snprintf(line, sizeof(line), "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len)
        hm_warn(MOD, "cannot write the pid into %s: %s", path, strerror(errno));
    d->lock_fd = fd;
    return 0;
}

static int start(daemon_t *d, char *err, size_t errlen)
{
    const char *peers[HM_CONFIG_MAX_PEERS];
    int r;

    if (hm_crypto_init() != 0) {
        snprintf(err, errlen, "cannot initialise libsodium");
        return -EIO;
    }
    if (d->cfg.swarm_key_file[0] != '\0') {
        r = hm_swarm_key_load(d->cfg.swarm_key_file, d->swarm_key, err, errlen);
        if (r != 0)
            return r;
        d->have_swarm_key = 1;
    }
    r = hm_config_make_dir(d->cfg.state_dir, 0700, err, errlen);
    if (r != 0)
        return r;
    r = lock_state_dir(d, err, errlen);
    if (r != 0)
        return r;
    /* The control socket's directory is made when missing; one that exists
     * (such as systemd's RuntimeDirectory) is left as it is. */
    char sockdir[HM_CONFIG_SOCKET_PATH_LEN];
    hm_strlcpy(sockdir, d->cfg.control_socket, sizeof(sockdir));
    char *slash = strrchr(sockdir, '/');
    if (slash != NULL && slash != sockdir) {
        *slash = '\0';
        /* With a group, others may pass through the directory (0711) so
         * that the group's members reach the socket, which itself is 0660. */
        r = hm_config_make_dir(sockdir, d->cfg.control_socket_group[0] ? 0711 : 0700, err,
                               errlen);
        if (r != 0)
            return r;
    }

    r = uv_loop_init(&d->loop);
    if (r != 0) {
        snprintf(err, errlen, "cannot create the event loop: %s", uv_strerror(r));
        return r;
    }
    d->loop_open = 1;
    d->pub.loop = &d->loop;
    d->pub.cfg = &d->cfg;
    d->pub.stop = stop_daemon;

    for (size_t i = 0; i < d->addrs.n_initial_peers; i++)
        peers[i] = d->addrs.initial_peers[i];
    hm_node_options no;
    memset(&no, 0, sizeof(no));
    no.listen = d->addrs.listen;
    no.initial_peers = peers;
    no.n_initial_peers = d->addrs.n_initial_peers;
    no.state_dir = d->cfg.state_dir;
    no.swarm = d->cfg.swarm;
    no.swarm_key = d->have_swarm_key ? d->swarm_key : NULL;
    no.client_mode = d->cfg.client_mode;
    no.announce = d->addrs.announce;
    no.reach.dialback_rate_per_origin = d->cfg.dialback_rate_per_origin;
    no.reach.max_dialbacks = d->cfg.max_dialbacks;
    /* -- relay -- */
    no.relay.serve = d->cfg.relay;
    no.relay.max_reservations = d->cfg.relay_max_reservations;
    no.relay.reservations_per_origin = d->cfg.relay_reservations_per_origin;
    no.relay.max_circuits = d->cfg.relay_max_circuits;
    no.relay.circuits_per_origin = d->cfg.relay_circuits_per_origin;
    no.relay.max_circuit_bytes = (uint64_t)d->cfg.relay_max_mib << 20;
    no.relay.rate = (uint64_t)d->cfg.relay_rate_kib << 10;
    no.relay.circuit_lifetime_ms = (uint64_t)d->cfg.relay_circuit_lifetime_s * 1000u;
    if (d->cfg.relay_via[0] != '\0') {
        char rerr[256];
        if (hm_relay_parse_via(d->cfg.relay_via, no.relay.via, &no.relay.n_via, rerr,
                               sizeof(rerr)) != 0) {
            snprintf(err, errlen, "%s", rerr);
            return -EINVAL;
        }
    }
    no.ping_interval_ms = (uint64_t)d->cfg.ping_interval_s * 1000u;
    no.transport.max_connections = d->cfg.max_connections;
    no.transport.max_conns_per_origin = d->cfg.max_conns_per_origin;
    no.transport.max_handshakes = d->cfg.max_handshakes;
    no.transport.max_handshakes_per_origin = d->cfg.max_handshakes_per_origin;
    no.transport.max_conns_per_peer = d->cfg.max_conns_per_peer;
    no.transport.reserved_outbound = d->cfg.reserved_outbound;
    no.transport.handshake_rate_per_origin = d->cfg.handshake_rate_per_origin;
    no.transport.dgram_new_key_rate_per_origin = d->cfg.dgram_new_key_rate_per_origin;
    no.transport.dgram_new_key_rate = d->cfg.dgram_new_key_rate;
    no.dht.rate_per_s = d->cfg.dht_request_rate;
    no.dht.rate_burst = 2.0 * d->cfg.dht_request_rate;
    no.dht.store.max_entries = d->cfg.dht_store_entries;
    no.dht.store.max_bytes = (size_t)d->cfg.dht_store_mib << 20;
    no.dht.store.max_peer_bytes = (size_t)d->cfg.dht_store_peer_kib << 10;
    no.dht.store.max_origin_share = d->cfg.dht_store_origin_share / 100.0;
    no.max_peers = d->cfg.peer_table_size;
    no.max_peers_per_origin = d->cfg.peer_table_origin_cap;
    no.max_stream_pings = d->cfg.ping_stream_peers;
    /* transport: reassembly, write queues */
    no.transport.rasm_max_bytes = (size_t)d->cfg.reassembly_max_mib << 20;
    no.transport.rasm_origin_bytes = (size_t)d->cfg.reassembly_origin_mib << 20;
    no.transport.rasm_stall_ms = (uint64_t)d->cfg.reassembly_stall_timeout_s * 1000u;
    no.transport.wq_max_bytes = (size_t)d->cfg.write_queue_max_mib << 20;
    no.transport.wq_origin_bytes = (size_t)d->cfg.write_queue_origin_mib << 20;
    no.transport.write_min_rate =
        d->cfg.write_min_rate_kib == 0 ? SIZE_MAX : (size_t)d->cfg.write_min_rate_kib << 10;
    no.transport.notice_origin_bytes = (size_t)d->cfg.refusal_notice_origin_kib << 10;
    /* -- aead: StreamCipher (checked when parsed; auto is 0) -- */
    no.transport.stream_cipher =
        strcmp(d->cfg.stream_cipher, "auto") == 0 ? 0 : hm_rec_cipher_parse(d->cfg.stream_cipher);
    /* TestDelayMs, TestDelay: the network lab's latency, where netem is missing;
     * in force from the transport's start, so the first pings are held too. */
    hm_transport_delay_rule rules[HM_TRANSPORT_DELAY_RULES_MAX];
    hm_transport_faults faults = {.delay_ms = d->cfg.test_delay_ms, .delay_rules = rules};
    if (d->cfg.test_delay_ms > 0 || d->cfg.test_delay[0] != '\0') {
        char why[256];
        int nr = 0;
        if (d->cfg.test_delay[0] != '\0' &&
            (nr = hm_transport_delay_parse(d->cfg.test_delay, rules, HM_TRANSPORT_DELAY_RULES_MAX,
                                           why, sizeof(why))) < 0) {
            snprintf(err, errlen, "bad TestDelay: %s", why); /* checked when read: not reached */
            return -EINVAL;
        }
        faults.n_delay_rules = (size_t)nr;
        no.transport.faults = &faults;
        hm_warn(MOD, "TestDelayMs %u, TestDelay %s: what this daemon sends is delayed (a test "
                "option)", d->cfg.test_delay_ms, d->cfg.test_delay[0] ? d->cfg.test_delay : "none");
    }
    r = hm_node_new(&d->loop, &no, &d->pub.node, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;
    r = hm_averager_new(d->pub.node, &d->pub.av);
    if (r != 0) {
        snprintf(err, errlen, "cannot start the averager: %s", hm_strerror(r));
        return r;
    }
    d->parts_open++;
    hm_ar_limit_cfg lim = {.weight_factor = d->cfg.average_weight_factor,
                           .clip_weight_factor = d->cfg.average_clip_weight_factor,
                           .bandwidth_factor = d->cfg.average_bandwidth_factor,
                           .members_per_origin = d->cfg.average_members_per_origin,
                           .cap_loopback = d->cfg.average_cap_loopback,
                           /* -- early parts limits -- */
                           .early_bytes = (size_t)d->cfg.average_early_parts_mib << 20,
                           .early_origin_bytes =
                               (size_t)d->cfg.average_early_parts_origin_mib << 20};
    if ((r = hm_averager_set_limits(d->pub.av, &lim)) != 0) {
        snprintf(err, errlen, "cannot set the averaging limits: %s", hm_strerror(r));
        return r;
    }
    if (d->cfg.average_workers > 0 &&
        (r = hm_averager_set_workers(d->pub.av, d->cfg.average_workers)) != 0) {
        snprintf(err, errlen, "cannot start %u averaging workers: %s", d->cfg.average_workers,
                 hm_strerror(r));
        return r;
    }

    /* Trainers in the control socket's group map the segments too. */
    hm_shm_config sc = {0};
    if (d->cfg.control_socket_group[0] != '\0') {
        gid_t gid;
        r = hm_control_lookup_group(d->cfg.control_socket_group, &gid, err, errlen);
        if (r != 0)
            return r;
        sc.group_access = 1;
        sc.group_gid = (unsigned)gid;
    }
    r = hm_shm_new(&sc, &d->pub.shm);
    if (r != 0) {
        snprintf(err, errlen, "cannot set up shared memory: %s", hm_strerror(r));
        return r;
    }

    hm_control_config cc = {
        .path = d->cfg.control_socket,
        .group = d->cfg.control_socket_group[0] ? d->cfg.control_socket_group : NULL,
        .max_clients = d->cfg.control_max_clients,
        .idle_timeout_ms = d->cfg.control_idle_timeout_s
                               ? (uint64_t)d->cfg.control_idle_timeout_s * 1000u
                               : UINT64_MAX,
    };
    r = hm_control_new(&d->loop, &cc, &d->ctl, err, errlen);
    if (r != 0)
        return r;
    d->parts_open++;
    for (size_t i = 0; i < HM_ARRAY_LEN(groups); i++) {
        int before = groups_open(d);
        r = groups[i].reg(&d->pub, d->ctl, err, errlen);
        if (r != 0) {
            hm_debug(MOD, "the %s commands did not start", groups[i].name);
            return r;
        }
        /* A group with state of its own is a part that closes with a callback. */
        d->parts_open += groups_open(d) - before;
    }
    r = hm_http_new(&d->pub, d->ctl, &d->pub.http, d->pub.http_address,
                    sizeof(d->pub.http_address), err, errlen);
    if (r == -EHOSTUNREACH)
        d->start_exit = HM_EXIT_NOHOST;
    if (r != 0)
        return r;
    if (d->pub.http != NULL)
        d->parts_open++;

    uv_signal_init(&d->loop, &d->sig_term);
    uv_signal_init(&d->loop, &d->sig_int);
    uv_signal_init(&d->loop, &d->sig_hup);
    d->sig_term.data = d->sig_int.data = d->sig_hup.data = d;
    d->signals_open = 1;
    uv_signal_start(&d->sig_term, on_signal, SIGTERM);
    uv_signal_start(&d->sig_int, on_signal, SIGINT);
    uv_signal_start(&d->sig_hup, on_signal, SIGHUP);
    return 0;
}

int main(int argc, char **argv)
{
    daemon_t *d = NULL;
    char err[1024];
    int code = HM_EXIT_FAILURE;

    /* A control client that leaves while its reply is written must not
     * kill the daemon; the write fails with EPIPE instead. */
    signal(SIGPIPE, SIG_IGN);
    hm_log_detect_journal();

    d = calloc(1, sizeof(*d));
    if (d == NULL) {
        fprintf(stderr, "hivemindd: out of memory\n");
        return HM_EXIT_FAILURE;
    }
    d->lock_fd = -1;
    if (hm_config_parse_args(argc, argv, &d->args, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\nTry 'hivemindd --help'.\n", err);
        code = HM_EXIT_USAGE;
        goto out;
    }
    if (d->args.help) {
        hm_config_usage(stdout, "hivemindd");
        code = HM_EXIT_OK;
        goto out;
    }
    if (d->args.version) {
        printf("hivemindd %s\n", PACKAGE_VERSION);
        code = HM_EXIT_OK;
        goto out;
    }
    if (hm_config_build(&d->cfg, &d->args, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\n", err);
        code = HM_EXIT_CONFIG;
        goto out;
    }
    /* Expert patterns and settings are checked here, so that a bad one is a
     * configuration error (also for -t) rather than a failure to start. */
    if (hm_cmd_experts_check_config(&d->cfg, err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\n", err);
        code = HM_EXIT_CONFIG;
        goto out;
    }
    if (d->args.test_config) {
        char *text = hm_config_format(&d->cfg);
        if (text == NULL) {
            fprintf(stderr, "hivemindd: out of memory\n");
            goto out;
        }
        fputs(text, stdout);
        free(text);
        fprintf(stderr, "hivemindd: configuration ok\n");
        code = fflush(stdout) == 0 ? HM_EXIT_OK : HM_EXIT_FAILURE;
        goto out;
    }
    hm_log_set_level(d->cfg.log_level);

    /* Host names are resolved once, here, before the loop runs: a lookup
     * blocks, and a slow resolver must not hold up the DHT's replies. */
    char skipped[1024];
    if (hm_config_resolve(&d->cfg, &d->addrs, skipped, sizeof(skipped), err, sizeof(err)) != 0) {
        fprintf(stderr, "hivemindd: %s\n", err);
        code = HM_EXIT_NOHOST;
        goto out;
    }
    if (skipped[0] != '\0')
        hm_warn(MOD, "left out of the initial peers: %s", skipped);

    int r = start(d, err, sizeof(err));
    if (r != 0) {
        hm_error(MOD, "%s", err);
        fprintf(stderr, "hivemindd: %s\n", err);
        begin_shutdown(d, "start failed");
        code = d->start_exit != 0 ? d->start_exit : HM_EXIT_FAILURE;
    } else {
        char addr[HM_PEER_ID_LEN + HM_ADDRSTRLEN + 2];
        if (hm_node_address(d->pub.node, addr, sizeof(addr)) != 0) {
            hm_error(MOD, "cannot tell the node's own address");
            begin_shutdown(d, "start failed");
            code = HM_EXIT_FAILURE;
        } else {
            printf("%s\n", addr);
            fflush(stdout);
            hm_info(MOD, "hivemindd %s listening on %s, control socket %s", PACKAGE_VERSION, addr,
                    d->cfg.control_socket);
            char ready[64];
            snprintf(ready, sizeof(ready), "READY=1\nMAINPID=%ld", (long)getpid());
            sd_notify_msg(ready);
            code = HM_EXIT_OK;
        }
    }
    if (d->loop_open) {
        uv_run(&d->loop, UV_RUN_DEFAULT);
        if (d->parts_open != 0)
            hm_error(MOD, "the loop ended with parts still open");
        int cr = uv_loop_close(&d->loop);
        if (cr != 0)
            hm_warn(MOD, "event loop closed with handles left: %s", uv_strerror(cr));
    }
    if (code == HM_EXIT_OK)
        hm_info(MOD, "stopped");
out:
    if (d != NULL) {
        /* After the loop: rounds and connections that pinned or owned
         * segments are all over by now. */
        hm_shm_free(d->pub.shm);
        if (d->lock_fd >= 0)
            close(d->lock_fd);
        sodium_memzero(d->swarm_key, sizeof(d->swarm_key));
        free(d);
    }
    return code;
}
