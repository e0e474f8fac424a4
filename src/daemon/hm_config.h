/*
 * config: the settings of hivemindd, from its config file and its command
 * line. One table of options (config.c) serves the config file, the
 * getopt_long flags, the --help text and the printing of the effective
 * configuration (hivemindd -t), so the four can never disagree.
 *
 * This header is called hm_config.h, not config.h, because every .c file
 * includes autoconf's "config.h" first and the compiler would find a
 * src/config.h next to the source file before the generated one.
 *
 * Config file: one "Keyword value" per line; keywords are case-insensitive;
 * blank lines and lines whose first non-blank character is '#' are ignored,
 * and so is everything after a '#' that follows a blank. Lines are capped at
 * HM_CONFIG_MAX_LINE bytes and the file at HM_CONFIG_MAX_FILE bytes. An
 * unknown keyword, a missing or bad value, or an overlong line is an error
 * that names the file and the line. InitialPeers may be repeated and takes
 * comma-separated lists; any other keyword given twice keeps the last value.
 *
 * Order of precedence: built-in defaults, then the file (-c), then flags.
 * A flag's value is checked before the file is read, so a bad flag is a
 * usage error (exit 64) whatever the file holds; a bad file exits 78.
 *
 * Defaults that depend on the user: StateDir is /var/lib/hivemindd for
 * root, else $XDG_STATE_HOME/hivemindd or ~/.local/state/hivemindd.
 * ControlSocket is /run/hivemindd/control.sock for root, else
 * $XDG_RUNTIME_DIR/hivemindd/control.sock, else STATEDIR/control.sock.
 * hivemindctl uses the same rules (src/base/paths.h).
 */
#ifndef HM_CONFIG_H
#define HM_CONFIG_H

#include "src/base/paths.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define HM_CONFIG_MAX_LINE 4096
#define HM_CONFIG_MAX_FILE (1024 * 1024)
#define HM_CONFIG_MAX_PEERS 64      /* matches HM_NODE_MAX_INITIAL_PEERS */
#define HM_CONFIG_PEER_LEN 320      /* PEERID@HOST:PORT, with room for a 253-octet host name */
#define HM_CONFIG_PATH_LEN 1024
#define HM_CONFIG_SOCKET_PATH_LEN HM_PATHS_SOCKET_LEN
#define HM_CONFIG_SWARM_LEN 64
#define HM_CONFIG_GROUP_LEN 64
/* StateTrustedDonors: up to 32 peer ids (52 characters) and their commas. */
#define HM_CONFIG_TRUSTED_LEN (32 * 53)

typedef struct hm_config {
    char listen[HM_CONFIG_PEER_LEN];
    char initial_peers[HM_CONFIG_MAX_PEERS][HM_CONFIG_PEER_LEN];
    size_t n_initial_peers;
    char state_dir[HM_CONFIG_PATH_LEN];
    /* Empty until hm_config_finish() fills in the default. */
    char control_socket[HM_CONFIG_SOCKET_PATH_LEN];
    char control_socket_group[HM_CONFIG_GROUP_LEN]; /* empty: none */
    unsigned control_max_clients;
    unsigned control_idle_timeout_s; /* 0: no idle timeout */
    char swarm[HM_CONFIG_SWARM_LEN + 1];
    char swarm_key_file[HM_CONFIG_PATH_LEN]; /* empty: none */
    int client_mode;
    int log_level; /* enum hm_log_level */
    unsigned ping_interval_s;
    unsigned max_connections;
    /* The expert server (moe/): patterns validated when the daemon starts. */
    char host_experts[512];          /* comma-separated patterns; empty: none */
    char expert_type[16];
    unsigned expert_dim, expert_hidden;
    char expert_optimizer[16];
    char expert_lr[32];              /* empty: the optimizer's default */
    unsigned expert_workers, expert_max_batch;
    /* -- transformer fields -- */
    unsigned expert_heads;            /* 0: the largest of 8, 4, 2, 1 dividing the dim */
    unsigned expert_max_seq;          /* longest sequence a transformer expert takes */
    unsigned checkpoint_interval_s;
    /* ---- limits against hostile members (docs/security.md), by floor ---- */
    /* transport: connections, handshakes; 0 where the default scales with
     * max_connections (hm_transport_config_defaults) */
    unsigned max_conns_per_origin, max_handshakes, max_handshakes_per_origin;
    unsigned max_conns_per_peer, reserved_outbound;
    unsigned handshake_rate_per_origin, dgram_new_key_rate_per_origin, dgram_new_key_rate;
    /* transport: reassembly, write queues */
    unsigned reassembly_max_mib, reassembly_origin_mib, reassembly_stall_timeout_s;
    unsigned write_queue_max_mib, write_queue_origin_mib;
    unsigned write_min_rate_kib; /* 0: no drain-rate rule */
    /* -- refusal notice fields -- */
    unsigned refusal_notice_origin_kib; /* notices queued per origin past the caps */
    /* dht: storage, peer table */
    unsigned dht_request_rate;        /* DHT requests per second per address; burst twice that */
    unsigned dht_store_entries;       /* records one node stores for others */
    unsigned dht_store_mib;           /* their total charge, MiB */
    unsigned dht_store_peer_kib;      /* charge per storing identity, KiB */
    unsigned dht_store_origin_share;  /* percent of entries and bytes per network origin */
    unsigned peer_table_size;
    unsigned peer_table_origin_cap;   /* places per network origin */
    unsigned ping_stream_peers;       /* peers pinged over a stream each round */
    /* experts */
    unsigned expert_max_queued;       /* samples queued per expert */
    unsigned expert_max_queued_mib;   /* request tensors held by the expert server */
    unsigned expert_record_max_ttl_s; /* declarations living longer are ignored */
    int expert_one_holder;            /* an open uid has one owner: its earliest live holder */
    char expert_hosts_file[HM_CONFIG_PATH_LEN]; /* per-prefix allow-list; empty: none */
    /* -- moe backoff fields -- */
    unsigned expert_backoff_s;        /* a stalled host is skipped this long at first */
    unsigned expert_backoff_max_s;    /* the cap of its doubling */
    /* averaging and state */
    unsigned average_workers;            /* averaging threads, 0: on the loop */
    unsigned average_weight_factor;      /* a part's weight <= this x the chunk's median */
    unsigned average_clip_weight_factor; /* the same under centered_clip */
    unsigned average_bandwidth_factor;   /* bandwidth <= this x the group's median */
    unsigned average_members_per_origin; /* 0: no cap */
    int average_cap_loopback;
    /* -- early parts fields -- */
    unsigned average_early_parts_mib;        /* held for rounds not started, in all */
    unsigned average_early_parts_origin_mib; /* the same, per origin */
    unsigned state_donors_per_origin;    /* donors of one origin counted toward min_agree */
    char state_trusted_donors[HM_CONFIG_TRUSTED_LEN]; /* comma-separated peer ids; empty: none */
    unsigned state_max_step_lead;        /* steps ahead of the most-vouched state; 0: none */
    /* -- progress fields -- */
    unsigned progress_max_runs;            /* progress reports published at once */
    unsigned progress_runs_per_connection; /* runs one control connection reports */
    /* -- progress origin fields -- */
    unsigned progress_epoch_origins;       /* origins that must reach an epoch to make it global */
    unsigned progress_origin_factor;       /* an origin's samples <= this x the median; 0: none */
    int progress_cap_loopback;             /* loopback daemons share their origin too */
    /* -- progress majority fields -- */
    int progress_epoch_majority;           /* the global epoch needs most voting origins too */
    /* -- netlab fields -- */
    unsigned test_delay_ms;              /* tests only: delay everything sent; 0: off */
    char test_delay[1024];               /* tests only: TestDelay ADDR[/BITS]=MS,...; empty: none */
    /* -- announce fields -- */
    char announce[HM_CONFIG_PEER_LEN]; /* HOST:PORT to declare; empty: detect */
    unsigned dialback_rate_per_origin; /* dial-backs run for one origin a minute */
    unsigned max_dialbacks;            /* dial-backs run at once */
    /* -- relay fields -- */
    /* -- http fields -- */
    char http_listen[HM_CONFIG_PEER_LEN]; /* HOST:PORT of the HTTP listener; empty: off */
    unsigned http_max_connections;        /* HTTP connections at once */
    unsigned http_max_conns_per_origin;   /* HTTP connections at once per origin */
    unsigned http_max_request_bytes;      /* request line and headers */
    unsigned http_timeout_s;              /* idle HTTP connections close */
    char status_grids[256];               /* comma-separated grid prefixes; empty: hosted */
    char status_runs[256];                /* comma-separated runs; empty: attached trainers' */
    int status_publish;                   /* publish the node summary record */
    /* -- aead fields -- */
    char stream_cipher[24]; /* auto, aes-256-gcm or chacha20-poly1305 */
    int relay;                          /* Relay: serve as a relay for NAT'd peers */
    char relay_via[8 * HM_CONFIG_PEER_LEN]; /* RelayVia: PEERID@HOST:PORT,...; empty: none */
    unsigned relay_max_reservations;    /* NAT'd peers we relay for at once */
    unsigned relay_reservations_per_origin;
    unsigned relay_max_circuits;        /* relayed connections open at once */
    unsigned relay_circuits_per_origin; /* ... dialled from one origin */
    unsigned relay_max_mib;             /* bytes one circuit may carry, both ways */
    unsigned relay_rate_kib;            /* KiB/s one circuit may carry */
    unsigned relay_circuit_lifetime_s;  /* a circuit is closed after this long */
} hm_config;

/*
 * The command line, parsed but not yet applied: what to do, the config file
 * to read, and the option flags in the order given (pointers into argv,
 * which must outlive this). Every value in it has already been checked.
 */
#define HM_CONFIG_MAX_FLAGS 256
typedef struct hm_config_args {
    const char *config_file; /* -c, NULL if none */
    int test_config;         /* -t */
    int version;             /* -V */
    int help;                /* -h */
    size_t n_flags;
    struct {
        int opt;             /* index into the option table */
        const char *value;   /* NULL for a boolean flag given bare */
    } flags[HM_CONFIG_MAX_FLAGS];
} hm_config_args;

/* Fills the built-in defaults (reads the environment and the euid). */
void hm_config_defaults(hm_config *c);

/*
 * Parses argv with getopt_long. Returns 0, or -EINVAL with a sentence in
 * err (unknown flag, missing or bad value, stray argument): exit 64.
 */
int hm_config_parse_args(int argc, char **argv, hm_config_args *out, char *err, size_t errlen);

/*
 * Reads a config file into c (on top of what c holds). Returns 0 or a
 * negative errno with "FILE:LINE: message" (or "FILE: reason") in err.
 */
int hm_config_load_file(hm_config *c, const char *path, char *err, size_t errlen);
/* The same for a buffer; name is used in messages. Never reads past len. */
int hm_config_load_buffer(hm_config *c, const char *name, const char *buf, size_t len, char *err,
                          size_t errlen);

/* Applies the flags of a parsed command line. Returns 0 or -EINVAL. */
int hm_config_apply_args(hm_config *c, const hm_config_args *a, char *err, size_t errlen);

/*
 * Fills the defaults that depend on other options (the control socket
 * under the state dir). Returns 0 or -ENAMETOOLONG with a sentence.
 */
int hm_config_finish(hm_config *c, char *err, size_t errlen);

/*
 * The whole sequence hivemindd runs (at start and on SIGHUP): defaults,
 * the file named by -c if any, the flags, finish. Returns 0 or a negative
 * errno with a sentence in err; since the flags were checked when they were
 * parsed, a failure here is the config file's (exit 78).
 */
int hm_config_build(hm_config *c, const hm_config_args *a, char *err, size_t errlen);

/*
 * Renders the configuration in config-file syntax, one line per option
 * (options that are unset appear as comments), so that loading the output
 * gives the same configuration. Returns a malloc'd string or NULL.
 */
char *hm_config_format(const hm_config *c);

/* Prints the --help text, generated from the option table. */
void hm_config_usage(FILE *f, const char *prog);

/* 1 if the two configurations have the same value for every option. */
int hm_config_equal(const hm_config *a, const hm_config *b);

/*
 * Lists the keywords of the options whose values differ between a and b,
 * up to max of them; returns how many differ. reloadable_out (may be NULL)
 * receives, per listed keyword, whether a running daemon applies the change
 * on SIGHUP (LogLevel, InitialPeers) or needs a restart.
 */
size_t hm_config_diff(const hm_config *a, const hm_config *b, const char **keywords_out,
                      int *reloadable_out, size_t max);

/*
 * Checks the syntax of PEERID@HOST:PORT (52 base32 characters, numeric
 * host). Whether the id is a valid public key is left to the node.
 */
int hm_config_check_peer(const char *s);

/*
 * The addresses of a configuration with its host names resolved, for the
 * node to bind, dial and declare; the configuration keeps the names as
 * written, so a reload compares like with like. Every field is numeric
 * (HOST:PORT as hm_parse_hostport takes it), or empty where the
 * configuration's is.
 */
#define HM_CONFIG_ADDR_LEN 64 /* HM_ADDRSTRLEN */
#define HM_CONFIG_NUMERIC_PEER_LEN (52 + 1 + HM_CONFIG_ADDR_LEN)
typedef struct hm_config_addrs {
    char listen[HM_CONFIG_ADDR_LEN];
    char announce[HM_CONFIG_ADDR_LEN];
    char initial_peers[HM_CONFIG_MAX_PEERS][HM_CONFIG_NUMERIC_PEER_LEN];
    size_t n_initial_peers;
} hm_config_addrs;

/*
 * Resolves the host names of c's Listen, Announce and InitialPeers into
 * out, with getaddrinfo, which blocks: the daemon calls it once at start,
 * before its loop runs. A Listen or Announce name that does not resolve is
 * an error (-EHOSTUNREACH, err says which and why); an initial peer whose
 * name does not resolve is left out and named in skipped (one sentence per
 * peer, at most skippedlen bytes), since the others may still lead into
 * the swarm.
 */
int hm_config_resolve(const hm_config *c, hm_config_addrs *out, char *skipped, size_t skippedlen,
                      char *err, size_t errlen);
/* One PEERID@HOST:PORT resolved into out (HM_CONFIG_NUMERIC_PEER_LEN); as hm_config_resolve. */
int hm_config_resolve_peer(const char *peer, char *out, size_t outlen, char *err, size_t errlen);

/*
 * Creates dir (and missing parents) with the given mode; an existing
 * directory is left as it is. Returns 0 or a negative errno with err.
 */
int hm_config_make_dir(const char *dir, unsigned mode, char *err, size_t errlen);

#endif
