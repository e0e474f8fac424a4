/*
 * config: the option table of hivemindd and everything driven by it: the
 * config-file reader, the command-line parser, the --help text, the printer
 * of the effective configuration and the comparison used on SIGHUP. See
 * hm_config.h for the file format and the precedence rules.
 */
#include "config.h"

#include "src/daemon/hm_config.h"
#include "src/base/crypto.h"
#include "src/base/paths.h"
#include "src/base/util.h"
#include "src/net/delay_rules.h" /* -- netlab -- */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

enum opt_type {
    T_HOSTPORT, /* HOST:PORT, numeric host or a DNS name (resolved at start) */
    T_PEERS,    /* list of PEERID@HOST:PORT */
    T_PATH,     /* file or directory path */
    T_SOCKET,   /* Unix socket path (fits sun_path) */
    T_GROUP,    /* group name or number */
    T_UINT,     /* unsigned integer within [min, max] */
    T_SWARM,    /* swarm name */
    T_BOOL,     /* yes/no */
    T_LEVEL,    /* log level */
    T_WORD,     /* one word of [A-Za-z0-9._:,[]-], checked further by its user */
    T_CIPHER,   /* -- aead: auto or a stream record cipher's name (crypto.h) -- */
};

struct opt {
    const char *keyword; /* config file keyword */
    const char *flag;    /* long flag, without the dashes */
    enum opt_type type;
    size_t off;          /* offset of the field in hm_config */
    size_t size;         /* size of a string field */
    unsigned min, max;   /* range of a T_UINT */
    int reloadable;      /* applied by a running daemon on SIGHUP */
    const char *metavar;
    const char *help;
};

#define FIELD(f) offsetof(hm_config, f), sizeof(((hm_config *)0)->f)

static const struct opt opts[] = {
    {"Listen", "listen", T_HOSTPORT, FIELD(listen), 0, 0, 0, "HOST:PORT",
     "UDP and TCP address to listen on, an IP address or a host name resolved once at start; "
     "port 0 picks a free port (default 0.0.0.0:31400)"},
    {"InitialPeers", "initial-peers", T_PEERS, FIELD(initial_peers), 0, 0, 1, "ADDR[,ADDR...]",
     "peers to join through, each PEERID@HOST:PORT, HOST an IP address or a name resolved "
     "at start (default none)"},
    {"StateDir", "state-dir", T_PATH, FIELD(state_dir), 0, 0, 0, "DIR",
     "where the identity key lives (default /var/lib/hivemindd for root, else "
     "$XDG_STATE_HOME/hivemindd or ~/.local/state/hivemindd)"},
    {"ControlSocket", "control-socket", T_SOCKET, FIELD(control_socket), 0, 0, 0, "PATH",
     "control socket (default /run/hivemindd/control.sock for root, else "
     "$XDG_RUNTIME_DIR/hivemindd/control.sock or STATEDIR/control.sock)"},
    {"ControlSocketGroup", "control-socket-group", T_GROUP, FIELD(control_socket_group), 0, 0, 0,
     "GROUP", "group allowed to use the control socket (mode 0660; default none: 0600)"},
    {"ControlMaxClients", "control-max-clients", T_UINT, FIELD(control_max_clients), 1, 1024, 0,
     "N", "control clients connected at once (default 32)"},
    {"ControlIdleTimeout", "control-idle-timeout", T_UINT, FIELD(control_idle_timeout_s), 0,
     86400, 0, "SECONDS", "close idle control clients after this long, 0 never (default 300)"},
    {"Swarm", "swarm", T_SWARM, FIELD(swarm), 0, 0, 0, "NAME",
     "swarm name, 1-64 of [A-Za-z0-9._-] (default \"default\")"},
    {"SwarmKeyFile", "swarm-key-file", T_PATH, FIELD(swarm_key_file), 0, 0, 0, "PATH",
     "pre-shared key of a private swarm, 64 hex digits (default none)"},
    {"ClientMode", "client-mode", T_BOOL, FIELD(client_mode), 0, 0, 0, "[yes|no]",
     "use the DHT as a client: query and store, but answer no DHT requests "
     "and stay out of others' routing tables (default no)"},
    {"LogLevel", "log-level", T_LEVEL, FIELD(log_level), 0, 0, 1, "error|warn|info|debug",
     "log verbosity (default info)"},
    {"PingInterval", "ping-interval", T_UINT, FIELD(ping_interval_s), 1, 3600, 0, "SECONDS",
     "how often each known peer is pinged (default 15)"},
    {"MaxConnections", "max-connections", T_UINT, FIELD(max_connections), 1, 65536, 0, "N",
     "TCP connections open at once (default 512)"},
    {"HostExperts", "host-experts", T_WORD, FIELD(host_experts), 0, 0, 0, "PATTERN[,PATTERN...]",
     "experts to host, e.g. ffn.[0:16].[0:4] for 64 experts ffn.0.0 to ffn.15.3 (default none)"},
    {"ExpertType", "expert-type", T_WORD, FIELD(expert_type), 0, 0, 0, "TYPE",
     "layer of the hosted experts: ffn, LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d) "
     "with a residual; or transformer, a pre-LN block of multi-head self-attention and that ffn "
     "over inputs [batch, seq, d] (default ffn)"},
    {"ExpertDim", "expert-dim", T_UINT, FIELD(expert_dim), 1, 8192, 0, "D",
     "input and output width d of the hosted experts (default 512)"},
    {"ExpertHidden", "expert-hidden", T_UINT, FIELD(expert_hidden), 0, 32768, 0, "H",
     "hidden width of the hosted experts, 0 for 4 d (default 0)"},
    {"ExpertOptimizer", "expert-optimizer", T_WORD, FIELD(expert_optimizer), 0, 0, 0, "adam|sgd",
     "optimizer each hosted expert steps on every backward call (default adam)"},
    {"ExpertLearningRate", "expert-lr", T_WORD, FIELD(expert_lr), 0, 0, 0, "RATE",
     "learning rate of the hosted experts (default 0.001 for adam, 0.01 for sgd)"},
    {"ExpertWorkers", "expert-workers", T_UINT, FIELD(expert_workers), 1, 256, 0, "N",
     "compute threads of the expert server (default 2)"},
    {"ExpertMaxBatch", "expert-max-batch", T_UINT, FIELD(expert_max_batch), 1, 4096, 0, "N",
     "samples in one expert batch (default 1024)"},
    /* -- transformer options -- */
    {"ExpertHeads", "expert-heads", T_UINT, FIELD(expert_heads), 0, 64, 0, "N",
     "attention heads of hosted transformer experts, dividing ExpertDim; 0 for the largest of "
     "8, 4, 2, 1 that does (default 0)"},
    {"ExpertMaxSeq", "expert-max-seq", T_UINT, FIELD(expert_max_seq), 1, 2048, 0, "N",
     "longest sequence a call may pass a hosted transformer expert; longer ones are refused "
     "(default 512)"},
    /* -- end transformer options -- */
    {"CheckpointInterval", "checkpoint-interval", T_UINT, FIELD(checkpoint_interval_s), 1, 86400,
     0, "SECONDS", "how often hosted experts that changed are checkpointed under "
     "STATEDIR/experts (default 60; also on shutdown)"},
    /* ---- limits against hostile members (docs/security.md), by floor ---- */
    /* transport: connections, handshakes */
    {"MaxConnectionsPerOrigin", "max-connections-per-origin", T_UINT, FIELD(max_conns_per_origin),
     0, 65536, 0, "N", "inbound TCP connections from one origin (an address, a public /24 or "
     "/48), 0 for MaxConnections / 8, at least 8 (default 0)"},
    {"MaxHandshakes", "max-handshakes", T_UINT, FIELD(max_handshakes), 0, 65536, 0, "N",
     "inbound connections still in their handshake, 0 for MaxConnections / 4, at least 16 "
     "(default 0)"},
    {"MaxHandshakesPerOrigin", "max-handshakes-per-origin", T_UINT,
     FIELD(max_handshakes_per_origin), 0, 65536, 0, "N",
     "inbound connections in their handshake from one origin, 0 for MaxHandshakes / 4, at "
     "least 4 (default 0)"},
    {"MaxConnectionsPerPeer", "max-connections-per-peer", T_UINT, FIELD(max_conns_per_peer), 1,
     64, 0, "N", "connections to one identity; a newer one replaces its oldest (default 4)"},
    {"ReservedOutbound", "reserved-outbound", T_UINT, FIELD(reserved_outbound), 0, 65535, 0, "N",
     "connections inbound ones never take, kept for our own dials, 0 for MaxConnections / 8 "
     "(default 0)"},
    {"HandshakeRatePerOrigin", "handshake-rate-per-origin", T_UINT,
     FIELD(handshake_rate_per_origin), 1, 100000, 0, "N",
     "inbound handshakes per second from one origin, bursts of 4 s worth (default 64)"},
    {"DgramNewKeyRatePerOrigin", "dgram-new-key-rate-per-origin", T_UINT,
     FIELD(dgram_new_key_rate_per_origin), 1, 1000000, 0, "N",
     "datagrams per second from one origin whose sender key is not cached yet (each costs an "
     "X25519), bursts of 4 s worth (default 64)"},
    {"DgramNewKeyRate", "dgram-new-key-rate", T_UINT, FIELD(dgram_new_key_rate), 1, 1000000, 0,
     "N", "datagrams per second, all origins, whose sender key is not cached yet, bursts of "
     "4 s worth (default 2048)"},
    /* transport: reassembly, write queues */
    {"ReassemblyMaxMiB", "reassembly-max-mib", T_UINT, FIELD(reassembly_max_mib), 80, 65536, 0,
     "MIB", "inbound messages in progress, all peers, charged by bytes received; when full a "
     "lighter origin's message sheds the heaviest origin's stalest one (default 512)"},
    {"ReassemblyOriginMiB", "reassembly-origin-mib", T_UINT, FIELD(reassembly_origin_mib), 80,
     65536, 0, "MIB", "inbound messages in progress from one origin; past it a new message is "
     "refused, not the connection (default 192)"},
    {"ReassemblyStallTimeout", "reassembly-stall-timeout", T_UINT,
     FIELD(reassembly_stall_timeout_s), 1, 3600, 0, "SECONDS",
     "drop an inbound message that got no chunk for this long (default 30)"},
    {"WriteQueueMaxMiB", "write-queue-max-mib", T_UINT, FIELD(write_queue_max_mib), 96, 65536, 0,
     "MIB", "bytes queued for all peers; when full the origin queueing the most loses its "
     "fullest connection first (default 256)"},
    {"WriteQueueOriginMiB", "write-queue-origin-mib", T_UINT, FIELD(write_queue_origin_mib), 1,
     65536, 0, "MIB", "bytes queued for one origin (one message always fits; default 32)"},
    {"WriteMinRate", "write-min-rate", T_UINT, FIELD(write_min_rate_kib), 0, 1048576, 0, "KIB/S",
     "under memory pressure, close a connection holding over 1 MiB queued that drains slower "
     "than this, 0 never "
     "(default 256)"},
    /* -- refusal notice options -- */
    {"RefusalNoticeOriginKiB", "refusal-notice-origin-kib", T_UINT,
     FIELD(refusal_notice_origin_kib), 1, 65536, 0, "KIB", "refusal notices (a refused "
     "reply's or request's short -ENOBUFS answer) queued for one origin past the write-queue "
     "caps (default 64)"},
    /* dht: storage, peer table */
    {"DhtRequestRate", "dht-request-rate", T_UINT, FIELD(dht_request_rate), 1, 1000000, 0, "N",
     "DHT requests served per second per address, with bursts of twice that; loopback "
     "addresses are metered per port (default 200)"},
    {"DhtStoreEntries", "dht-store-entries", T_UINT, FIELD(dht_store_entries), 16, 16777216, 0,
     "N", "DHT records stored for others (default 65536)"},
    {"DhtStoreMiB", "dht-store-mib", T_UINT, FIELD(dht_store_mib), 1, 65536, 0, "MIB",
     "total size of the DHT records stored for others (default 64)"},
    {"DhtStorePeerKiB", "dht-store-peer-kib", T_UINT, FIELD(dht_store_peer_kib), 1, 4194304, 0,
     "KIB", "size of the DHT records stored for one identity (default 1024)"},
    {"DhtStoreOriginShare", "dht-store-origin-share", T_UINT, FIELD(dht_store_origin_share), 1,
     100, 0, "PERCENT", "share of the DHT store's records and bytes one network origin "
     "(a /24, a /48, a local address) may hold; a full store evicts from the heaviest origin "
     "(default 12)"},
    {"PeerTableSize", "peer-table-size", T_UINT, FIELD(peer_table_size), 16, 1048576, 0, "N",
     "peers in the peer table (default 4096)"},
    {"PeerTableOriginCap", "peer-table-origin-cap", T_UINT, FIELD(peer_table_origin_cap), 1,
     1048576, 0, "N", "places one network origin may hold in the peer table (default 64)"},
    {"PingStreamPeers", "ping-stream-peers", T_UINT, FIELD(ping_stream_peers), 1, 65536, 0, "N",
     "verified peers, longest known first, also pinged over a stream connection each round "
     "(default 32)"},
    /* experts */
    {"ExpertMaxQueued", "expert-max-queued", T_UINT, FIELD(expert_max_queued), 1, 1048576, 0,
     "N", "samples waiting per hosted expert; when full, the origin with the most queued is "
     "shed first (default 16384)"},
    {"ExpertMaxQueuedBytes", "expert-max-queued-bytes", T_UINT, FIELD(expert_max_queued_mib), 1,
     65536, 0, "MIB", "request tensors the expert server holds, in MiB; when full, the origin "
     "holding the most is shed first (default 1024)"},
    {"ExpertRecordMaxTtl", "expert-record-max-ttl", T_UINT, FIELD(expert_record_max_ttl_s), 60,
     3600, 0, "SECONDS", "expert declarations that live longer than this are ignored; hosted "
     "experts are declared well inside it (default 300)"},
    {"ExpertOneHolder", "expert-one-holder", T_BOOL, FIELD(expert_one_holder), 0, 0, 0,
     "[yes|no]", "an expert uid no ExpertHostsFile line covers stays with the owner this "
     "daemon first used while that owner keeps refreshing it (a daemon that never used the uid "
     "takes the freshest declaration: open swarms should list hosts in ExpertHostsFile); no: "
     "always the freshest declaration of any owner (default yes)"},
    {"ExpertHostsFile", "expert-hosts-file", T_PATH, FIELD(expert_hosts_file), 0, 0, 0, "PATH",
     "allow-list of expert hosts: lines 'PREFIX PEERID...'; experts under PREFIX are taken only "
     "from the listed peers, which may all serve them (default none)"},
    /* -- moe backoff options -- */
    {"ExpertBackoff", "expert-backoff", T_UINT, FIELD(expert_backoff_s), 1, 86400, 0, "SECONDS",
     "an expert host that let a call wait is skipped by this daemon's calls for this long, "
     "then probed (default 15)"},
    {"ExpertBackoffMax", "expert-backoff-max", T_UINT, FIELD(expert_backoff_max_s), 1, 86400, 0,
     "SECONDS", "the back-off doubles at each further stall up to this (default 300)"},
    /* averaging and state */
    {"AverageWorkers", "average-workers", T_UINT, FIELD(average_workers), 0, 16, 0, "N",
     "threads that reduce and code the all-reduce's chunks off the loop thread, 0 to do it "
     "on the loop (default 0; on 2 cores the threads gained nothing)"},
    {"AverageWeightFactor", "average-weight-factor", T_UINT, FIELD(average_weight_factor), 1,
     1000000, 0, "F", "a reducer clamps each member's weight to F times the median weight of "
     "the chunk's parts (default 4)"},
    {"AverageClipWeightFactor", "average-clip-weight-factor", T_UINT,
     FIELD(average_clip_weight_factor), 1, 1000000, 0, "F",
     "the same under centered_clip, where one member must hold under half the weight "
     "(default 1)"},
    {"AverageBandwidthFactor", "average-bandwidth-factor", T_UINT,
     FIELD(average_bandwidth_factor), 1, 1000000, 0, "F",
     "each member's declared bandwidth counts at most F times the group's median when the "
     "vector is split among reducers: a leader clamps to it, a follower refuses a group past it "
     "(default 2)"},
    {"AverageMembersPerOrigin", "average-members-per-origin", T_UINT,
     FIELD(average_members_per_origin), 0, 64, 0, "N",
     "members of one network origin (a public /24 or /48, a local address) in an averaging "
     "group, 0 no cap (default 1; loopback origins only with AverageCapLoopback)"},
    {"AverageCapLoopback", "average-cap-loopback", T_BOOL, FIELD(average_cap_loopback), 0, 0, 0,
     "[yes|no]", "apply AverageMembersPerOrigin to loopback origins too, where one machine "
     "runs several daemons (default no)"},
    /* -- early parts options -- */
    {"AverageEarlyPartsMiB", "average-early-parts-mib", T_UINT, FIELD(average_early_parts_mib), 0,
     65536, 0, "MIB", "all-reduce parts and notices held for rounds this node has not started "
     "yet (answered once it starts, instead of refused and sent again), in all; 0 holds none "
     "(default 64)"},
    {"AverageEarlyPartsOriginMiB", "average-early-parts-origin-mib", T_UINT,
     FIELD(average_early_parts_origin_mib), 0, 65536, 0, "MIB",
     "the same, from one network origin (default 16)"},
    {"StateDonorsPerOrigin", "state-donors-per-origin", T_UINT, FIELD(state_donors_per_origin),
     1, 32, 0, "N", "donors of one network origin that count toward a state download's "
     "min_agree (default 1)"},
    {"StateTrustedDonors", "state-trusted-donors", T_WORD, FIELD(state_trusted_donors), 0, 0, 0,
     "PEERID[,PEERID...]", "when set, state downloads use only these donors, and one of them "
     "suffices (default none: any donors, agreeing by origin)"},
    {"StateMaxStepLead", "state-max-step-lead", T_UINT, FIELD(state_max_step_lead), 0,
     4294967295u, 0, "STEPS", "a state download takes no step more than STEPS ahead of the "
     "state most origins vouch for (default 0: no bound)"},
    /* -- progress options -- */
    {"ProgressMaxRuns", "progress-max-runs", T_UINT, FIELD(progress_max_runs), 1, 4096, 0, "N",
     "progress reports (runs of attached trainers) this daemon publishes at once (default 64)"},
    {"ProgressRunsPerConnection", "progress-runs-per-connection", T_UINT,
     FIELD(progress_runs_per_connection), 1, 64, 0, "N",
     "runs one control connection may report progress in (default 4)"},
    /* -- progress origin options -- */
    {"ProgressEpochOrigins", "progress-epoch-origins", T_UINT, FIELD(progress_epoch_origins), 1,
     64, 0, "N", "the swarm's global epoch is the largest that N network origins of trainers "
     "have reached (all of them when fewer report; default 2)"},
    {"ProgressOriginFactor", "progress-origin-factor", T_UINT, FIELD(progress_origin_factor), 0,
     1000000, 0, "F", "one network origin's samples and samples per second count at most F "
     "times the median origin's in the swarm's progress, 0 no bound (default 4)"},
    {"ProgressCapLoopback", "progress-cap-loopback", T_BOOL, FIELD(progress_cap_loopback), 0, 0,
     0, "[yes|no]", "count the progress reporters of one loopback address as one origin too, "
     "where one machine runs several daemons (default no: each counts apart)"},
    /* -- progress majority options -- */
    {"ProgressEpochMajority", "progress-epoch-majority", T_BOOL, FIELD(progress_epoch_majority),
     0, 0, 0, "[yes|no]", "the swarm's global epoch must also have been reached by more than "
     "half of the network origins of trainers, so that an attacker on fewer origins than the "
     "honest hosts cannot move it (default yes)"},
    /* -- netlab options -- */
    {"TestDelayMs", "test-delay-ms", T_UINT, FIELD(test_delay_ms), 0, 10000, 0, "MS",
     "for tests only, never in production: hold every datagram and stream message this "
     "daemon sends for MS milliseconds first, a one-way delay (default 0: off)"},
    {"TestDelay", "test-delay", T_WORD, FIELD(test_delay), 0, 0, 0, "ADDR[/BITS]=MS[,...]",
     "for tests only, never in production: hold what this daemon sends to addresses in "
     "ADDR/BITS for MS milliseconds first (the longest matching prefix decides; others get "
     "TestDelayMs), at most 16 rules (default none)"},
    /* -- announce options -- */
    {"Announce", "announce", T_HOSTPORT, FIELD(announce), 0, 0, 0, "HOST:PORT",
     "address to declare to others (expert, state and group records), an IP address or a "
     "name resolved once at start; not 0.0.0.0, "
     ":: or port 0 (default none: the address peers observe and dial back, else a "
     "specific Listen address)"},
    {"DialbackRatePerOrigin", "dialback-rate-per-origin", T_UINT,
     FIELD(dialback_rate_per_origin), 1, 600, 0, "N",
     "dial-back checks run for one network origin a minute, one at a time, bursts of 3 "
     "(default 6)"},
    {"MaxDialbacks", "max-dialbacks", T_UINT, FIELD(max_dialbacks), 1, 1024, 0, "N",
     "dial-back checks run for others at once (default 16)"},
    /* -- relay options -- */
    /* -- http options -- */
    {"HttpListen", "http-listen", T_HOSTPORT, FIELD(http_listen), 0, 0, 0, "HOST:PORT",
     "serve /metrics, /api/status and the swarm page over HTTP here, read-only; port 0 picks "
     "a free port (default none: off; keep it on 127.0.0.1 unless a proxy guards it)"},
    {"HttpMaxConnections", "http-max-connections", T_UINT, FIELD(http_max_connections), 1,
     1024, 0, "N", "HTTP connections open at once (default 32)"},
    {"HttpMaxConnectionsPerOrigin", "http-max-connections-per-origin", T_UINT,
     FIELD(http_max_conns_per_origin), 1, 1024, 0, "N",
     "HTTP connections open at once from one network origin (default 8)"},
    {"HttpMaxRequestBytes", "http-max-request-bytes", T_UINT, FIELD(http_max_request_bytes),
     1024, 65536, 0, "BYTES", "request line and headers of one HTTP request; a request with a "
     "body is refused too (default 8192)"},
    {"HttpTimeout", "http-timeout", T_UINT, FIELD(http_timeout_s), 1, 600, 0, "SECONDS",
     "close an HTTP connection idle this long (default 10)"},
    {"StatusGrids", "status-grids", T_WORD, FIELD(status_grids), 0, 0, 0, "PREFIX[,PREFIX...]",
     "expert grids the status page and `hivemindctl top` walk, at most 8, UTF-8 grid names as "
     "uids allow them (default: the grids this node hosts in)"},
    {"StatusRuns", "status-runs", T_WORD, FIELD(status_runs), 0, 0, 0, "RUN[,RUN...]",
     "training runs whose progress they show, at most 8 (default: the runs the attached "
     "trainers report)"},
    {"StatusPublish", "status-publish", T_BOOL, FIELD(status_publish), 0, 0, 0, "[yes|no]",
     "publish this node's summary (address, experts, rounds) as a signed DHT record every "
     "15 s, so that every node's status page shows it (default yes)"},
    /* -- aead options -- */
    {"StreamCipher", "stream-cipher", T_CIPHER, FIELD(stream_cipher), 0, 0, 0,
     "auto|aes-256-gcm|chacha20-poly1305",
     "record cipher of the encrypted streams; auto offers both, AES-256-GCM first where the CPU "
     "has AES instructions (faster there), else ChaCha20-Poly1305 first; a single cipher is the "
     "only one offered and accepted, so peers without it are refused (default auto)"},
    {"Relay", "relay", T_BOOL, FIELD(relay), 0, 0, 0, "[yes|no]",
     "relay streams for peers nobody can dial (behind a NAT), within the Relay* budgets; the "
     "relay copies ciphertext and never holds a session key (default no)"},
    {"RelayVia", "relay-via", T_WORD, FIELD(relay_via), 0, 0, 0, "PEERID@HOST:PORT[,...]",
     "relays to reserve with, in order, when dial-backs show nobody reaches this node; it then "
     "declares the relay's address and keeps hosting experts and serving state through it "
     "(default none: the relays advertised in the DHT)"},
    {"RelayMaxReservations", "relay-max-reservations", T_UINT, FIELD(relay_max_reservations), 1,
     65536, 0, "N", "peers a relay holds reservations for at once (default 128)"},
    {"RelayReservationsPerOrigin", "relay-reservations-per-origin", T_UINT,
     FIELD(relay_reservations_per_origin), 1, 65536, 0, "N",
     "reservations one network origin may hold on a relay (default 4)"},
    {"RelayMaxCircuits", "relay-max-circuits", T_UINT, FIELD(relay_max_circuits), 1, 65536, 0,
     "N", "relayed connections open at once (default 64)"},
    {"RelayCircuitsPerOrigin", "relay-circuits-per-origin", T_UINT,
     FIELD(relay_circuits_per_origin), 1, 65536, 0, "N",
     "relayed connections dialled from one network origin (default 8)"},
    {"RelayMaxMiB", "relay-max-mib", T_UINT, FIELD(relay_max_mib), 1, 1048576, 0, "MIB",
     "bytes one relayed connection may carry, both ways together, before it is closed "
     "(default 256)"},
    {"RelayRate", "relay-rate", T_UINT, FIELD(relay_rate_kib), 1, 16777216, 0, "KIB/S",
     "rate one relayed connection may carry; past it the copy pauses (default 16384)"},
    {"RelayCircuitLifetime", "relay-circuit-lifetime", T_UINT, FIELD(relay_circuit_lifetime_s),
     1, 604800, 0, "SECONDS", "a relayed connection is closed after this long (default 3600)"},
};

#define N_OPTS HM_ARRAY_LEN(opts)

static char *field_str(hm_config *c, const struct opt *o) { return (char *)c + o->off; }
static const char *field_cstr(const hm_config *c, const struct opt *o)
{
    return (const char *)c + o->off;
}
static unsigned *field_uint(hm_config *c, const struct opt *o)
{
    return (unsigned *)(void *)((char *)c + o->off);
}
static unsigned field_cuint(const hm_config *c, const struct opt *o)
{
    return *(const unsigned *)(const void *)((const char *)c + o->off);
}
static int *field_int(hm_config *c, const struct opt *o)
{
    return (int *)(void *)((char *)c + o->off);
}
static int field_cint(const hm_config *c, const struct opt *o)
{
    return *(const int *)(const void *)((const char *)c + o->off);
}

static int is_blank(char ch) { return ch == ' ' || ch == '\t' || ch == '\r'; }

/*
 * Values must survive a trip through the config file: no control
 * characters, no blanks at either end (they would be trimmed) and no '#'
 * after a blank (it would start a comment).
 */
static int check_text(const char *v, char *why, size_t whylen)
{
    size_t n = strlen(v);
    if (n == 0) {
        hm_errf(why, whylen, "empty value");
        return -EINVAL;
    }
    if (is_blank(v[0]) || is_blank(v[n - 1])) {
        hm_errf(why, whylen, "value begins or ends with a blank");
        return -EINVAL;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)v[i];
        if ((ch < 0x20 && ch != '\t') || ch == 0x7f) {
            hm_errf(why, whylen, "value contains a control character");
            return -EINVAL;
        }
        if (ch == '#' && i > 0 && is_blank(v[i - 1])) {
            hm_errf(why, whylen, "value contains '#' after a blank, which starts a comment");
            return -EINVAL;
        }
    }
    return 0;
}

int hm_config_check_peer(const char *s)
{
    const char *at = strchr(s, '@');
    uint8_t pk[32];
    struct sockaddr_storage ss;

    if (at == NULL || (size_t)(at - s) != 52)
        return -EINVAL;
    /* Peer ids are lowercase; hm_base32_decode would also take uppercase. */
    for (const char *p = s; p < at; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '2' && *p <= '7')))
            return -EINVAL;
    if (hm_base32_decode(s, 52, pk, sizeof(pk)) != 32)
        return -EINVAL;
    if (strlen(at + 1) >= HM_CONFIG_PEER_LEN - 53)
        return -EINVAL;
    if (hm_parse_hostport(at + 1, &ss) == 0)
        return 0;
    /* A host name is taken as it is written; the daemon resolves it at
     * start, off the loop (src/daemon/resolve.c). */
    char host[HM_HOSTNAME_MAX + 2];
    unsigned port;
    return hm_split_hostport(at + 1, host, sizeof(host), &port);
}

static int parse_uint(const char *v, unsigned min, unsigned max, unsigned *out)
{
    if (*v < '0' || *v > '9')
        return -EINVAL;
    errno = 0;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno != 0 || *end != '\0' || x < min || x > max)
        return -EINVAL;
    *out = (unsigned)x;
    return 0;
}

static int parse_bool(const char *v, int *out)
{
    static const char *const yes[] = {"yes", "true", "on", "1"};
    static const char *const no[] = {"no", "false", "off", "0"};
    for (size_t i = 0; i < HM_ARRAY_LEN(yes); i++) {
        if (strcasecmp(v, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcasecmp(v, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -EINVAL;
}

static int add_peers(hm_config *c, const char *v, char *why, size_t whylen)
{
    const char *p = v;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t n = comma ? (size_t)(comma - p) : strlen(p);
        char one[HM_CONFIG_PEER_LEN];
        while (n > 0 && is_blank(*p)) {
            p++;
            n--;
        }
        while (n > 0 && is_blank(p[n - 1]))
            n--;
        if (n == 0) {
            hm_errf(why, whylen, "empty peer address in the list");
            return -EINVAL;
        }
        if (n >= sizeof(one)) {
            hm_errf(why, whylen, "peer address too long");
            return -EINVAL;
        }
        memcpy(one, p, n);
        one[n] = '\0';
        if (hm_config_check_peer(one) != 0) {
            hm_errf(why, whylen, "bad peer address '%s': expected PEERID@HOST:PORT (52-character "
                    "peer id; an IP address or a host name)", one);
            return -EINVAL;
        }
        if (c->n_initial_peers >= HM_CONFIG_MAX_PEERS) {
            hm_errf(why, whylen, "more than %d initial peers", HM_CONFIG_MAX_PEERS);
            return -EINVAL;
        }
        memcpy(c->initial_peers[c->n_initial_peers++], one, n + 1);
        if (comma == NULL)
            return 0;
        p = comma + 1;
    }
}

/* ---- host names ---- */

static int resolve_hostport(const char *what, const char *v, char *out, size_t outlen, char *err,
                            size_t errlen)
{
    struct sockaddr_storage ss;
    char why[320];
    int r = hm_resolve_hostport(v, &ss, why, sizeof(why));
    if (r != 0) {
        hm_errf(err, errlen, "%s %s: %s", what, v, why);
        return r;
    }
    if (hm_format_addr((const struct sockaddr *)&ss, out, outlen) < 0) {
        hm_errf(err, errlen, "%s %s: the address does not fit", what, v);
        return -ENAMETOOLONG;
    }
    return 0;
}

int hm_config_resolve_peer(const char *peer, char *out, size_t outlen, char *err, size_t errlen)
{
    const char *at = strchr(peer, '@');
    if (at == NULL || (size_t)(at - peer) != 52 || outlen < HM_CONFIG_NUMERIC_PEER_LEN) {
        hm_errf(err, errlen, "initial peer %s: expected PEERID@HOST:PORT", peer);
        return -EINVAL;
    }
    memcpy(out, peer, 53);
    return resolve_hostport("initial peer", at + 1, out + 53, outlen - 53, err, errlen) == 0
               ? 0
               : -EHOSTUNREACH;
}

int hm_config_resolve(const hm_config *c, hm_config_addrs *out, char *skipped, size_t skippedlen,
                      char *err, size_t errlen)
{
    int r;
    memset(out, 0, sizeof(*out));
    if (skippedlen > 0)
        skipped[0] = '\0';
    if (c->listen[0] != '\0' &&
        (r = resolve_hostport("Listen", c->listen, out->listen, sizeof(out->listen), err,
                              errlen)) != 0)
        return r;
    if (c->announce[0] != '\0' &&
        (r = resolve_hostport("Announce", c->announce, out->announce, sizeof(out->announce), err,
                              errlen)) != 0)
        return r;
    for (size_t i = 0; i < c->n_initial_peers; i++) {
        char why[512];
        char *dst = out->initial_peers[out->n_initial_peers];
        if (hm_config_resolve_peer(c->initial_peers[i], dst, HM_CONFIG_NUMERIC_PEER_LEN, why,
                                   sizeof(why)) == 0) {
            out->n_initial_peers++;
            continue;
        }
        size_t used = strlen(skipped);
        if (used + 1 < skippedlen)
            snprintf(skipped + used, skippedlen - used, "%s%s", used > 0 ? "; " : "", why);
    }
    return 0;
}

/* Parses value for option o into c; on failure writes the reason into why. */
/* Says which half of a refused HOST:PORT is wrong. */
static void hostport_why(const char *v, char *why, size_t whylen)
{
    const char *colon = v[0] == '[' ? strstr(v, "]:") : strrchr(v, ':');
    if (colon == NULL) {
        hm_errf(why, whylen, "expected HOST:PORT or [V6HOST]:PORT");
        return;
    }
    const char *port = colon + (v[0] == '[' ? 2 : 1);
    size_t digits = strspn(port, "0123456789");
    if (*port == '\0' || port[digits] != '\0' || digits > 5 || strtoul(port, NULL, 10) > 65535) {
        hm_errf(why, whylen, "the port '%.16s' is not a number from 0 to 65535", port);
        return;
    }
    hm_errf(why, whylen, "the host '%.*s' is neither an IPv4 or IPv6 address nor a host name",
            (int)(colon - v), v);
}

/* -- status grids -- */
/* The length of the UTF-8 character at s (n bytes left), 0 when malformed or overlong. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    size_t l = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3
             : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
    if (l == 0 || l > n)
        return 0;
    uint32_t cp = l == 1 ? s[0] : s[0] & (0x7f >> l);
    for (size_t i = 1; i < l; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[l] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return l;
}

/*
 * StatusGrids: 1 to 8 comma-separated grid names, each as an expert uid's
 * grid part allows it (moe/proto.h: UTF-8 without '.', control characters
 * or spaces; this list also takes no ','), optionally with Hivemind's
 * trailing '.', at most 63 bytes each (what the status page keeps).
 */
static int check_status_grids(const char *v, char *why, size_t whylen)
{
    size_t n = 0;
    for (const char *p = v; *p != '\0'; n++) {
        size_t len = strcspn(p, ","), name = len;
        if (n == 8 || len == 0 || len > 63) {
            hm_errf(why, whylen, "expected 1 to 8 grid names of 1 to 63 bytes, comma-separated");
            return -EINVAL;
        }
        if (p[len - 1] == '.')
            name--;
        if (name == 0) {
            hm_errf(why, whylen, "an empty grid name");
            return -EINVAL;
        }
        for (size_t i = 0; i < name;) {
            const unsigned char *q = (const unsigned char *)p + i;
            size_t l = utf8_len(q, name - i);
            if (l == 0 || *q <= 0x20 || *q == 0x7f || *q == '.' ||
                (l == 2 && q[0] == 0xc2 && q[1] < 0xa0)) {
                hm_errf(why, whylen, "grid name %zu holds a '.' (a sub-grid is not a grid), a "
                        "space, a control character or bytes that are not UTF-8", n + 1);
                return -EINVAL;
            }
            i += l;
        }
        p += len;
        if (*p == ',' && *++p == '\0') {
            hm_errf(why, whylen, "a trailing comma");
            return -EINVAL;
        }
    }
    return 0;
}

static int set_value(const struct opt *o, hm_config *c, const char *v, char *why, size_t whylen)
{
    int result = check_text(v, why, whylen);
    if (result != 0)
        return result;

    switch (o->type) {
    case T_HOSTPORT: {
        struct sockaddr_storage ss;
        char host[HM_HOSTNAME_MAX + 2];
        unsigned port;
        int numeric = strlen(v) < o->size && hm_parse_hostport(v, &ss) == 0;
        if (!numeric && (strlen(v) >= o->size ||
                         hm_split_hostport(v, host, sizeof(host), &port) != 0)) {
            hostport_why(v, why, whylen);
            return -EINVAL;
        }
        if (!numeric && o->off == offsetof(hm_config, announce) && port == 0) {
            hm_errf(why, whylen, "an announced address must be dialable: not port 0");
            return -EINVAL;
        }
        if (numeric && o->off == offsetof(hm_config, announce) && hm_addr_dialable(&ss) != 0) {
            hm_errf(why, whylen, "an announced address must be dialable: not 0.0.0.0, :: or "
                                 "port 0");
            return -EINVAL;
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    }
    case T_PEERS:
        return add_peers(c, v, why, whylen);
    case T_PATH:
    case T_SOCKET:
        if (strlen(v) >= o->size) {
            hm_errf(why, whylen, "path longer than %zu bytes%s", o->size - 1,
                    o->type == T_SOCKET ? " (the limit of a Unix socket path)" : "");
            return -EINVAL;
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    case T_GROUP:
        if (strlen(v) >= o->size) {
            hm_errf(why, whylen, "group name too long");
            return -EINVAL;
        }
        for (const char *p = v; *p; p++) {
            if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                  (*p >= '0' && *p <= '9') || *p == '_' || *p == '-' || *p == '.')) {
                hm_errf(why, whylen, "expected a group name or number");
                return -EINVAL;
            }
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    case T_UINT:
        if (parse_uint(v, o->min, o->max, field_uint(c, o)) != 0) {
            hm_errf(why, whylen, "expected a whole number from %u to %u", o->min, o->max);
            return -EINVAL;
        }
        return 0;
    case T_SWARM: {
        size_t n = strlen(v);
        if (n < 1 || n > HM_CONFIG_SWARM_LEN) {
            hm_errf(why, whylen, "swarm name must be 1 to %d characters", HM_CONFIG_SWARM_LEN);
            return -EINVAL;
        }
        for (const char *p = v; *p; p++) {
            if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                  (*p >= '0' && *p <= '9') || *p == '_' || *p == '-' || *p == '.')) {
                hm_errf(why, whylen, "swarm name may only hold A-Z a-z 0-9 . _ -");
                return -EINVAL;
            }
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    }
    case T_BOOL:
        if (parse_bool(v, field_int(c, o)) != 0) {
            hm_errf(why, whylen, "expected yes or no");
            return -EINVAL;
        }
        return 0;
    case T_WORD:
        if (strlen(v) >= o->size) {
            hm_errf(why, whylen, "value longer than %zu bytes", o->size - 1);
            return -EINVAL;
        }
        /* -- netlab -- TestDelay: the transport's parser checks it. */
        if (o->off == offsetof(hm_config, test_delay)) {
            if (hm_transport_delay_parse(v, NULL, HM_TRANSPORT_DELAY_RULES_MAX, why, whylen) < 0)
                return -EINVAL;
            hm_strlcpy(field_str(c, o), v, o->size);
            return 0;
        }
        /* -- relay -- RelayVia: peer addresses, each checked as an initial peer is. */
        if (o->off == offsetof(hm_config, relay_via)) {
            char one[HM_CONFIG_PEER_LEN];
            size_t n = 0;
            for (const char *p = v; *p != '\0'; n++) {
                size_t len = strcspn(p, ",");
                if (n == 8 || len == 0 || len >= sizeof(one)) {
                    hm_errf(why, whylen, "expected 1 to 8 relays PEERID@HOST:PORT, comma-separated");
                    return -EINVAL;
                }
                memcpy(one, p, len);
                one[len] = '\0';
                if (hm_config_check_peer(one) != 0) {
                    hm_errf(why, whylen, "bad relay '%s': expected PEERID@HOST:PORT", one);
                    return -EINVAL;
                }
                p += len;
                if (*p == ',' && *++p == '\0') {
                    hm_errf(why, whylen, "a trailing comma");
                    return -EINVAL;
                }
            }
            hm_strlcpy(field_str(c, o), v, o->size);
            return 0;
        }
        /* -- uid grammar -- HostExperts: expert uids follow Hivemind's grammar, whose
         * grid names may hold any character but '.'; the patterns are checked
         * in full (and their errors named) when the daemon starts. */
        if (o->off == offsetof(hm_config, host_experts)) {
            for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
                if (*p <= 0x20 || *p == 0x7f) {
                    hm_errf(why, whylen, "a space or control character (byte 0x%02x)", *p);
                    return -EINVAL;
                }
            }
            hm_strlcpy(field_str(c, o), v, o->size);
            return 0;
        }
        /* -- status grids -- StatusGrids: grid names as uids allow them. */
        if (o->off == offsetof(hm_config, status_grids)) {
            if (check_status_grids(v, why, whylen) < 0)
                return -EINVAL;
            hm_strlcpy(field_str(c, o), v, o->size);
            return 0;
        }
        for (const char *p = v; *p; p++) {
            if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                  (*p >= '0' && *p <= '9') || strchr("._:,[]-", *p) != NULL)) {
                hm_errf(why, whylen, "unexpected character '%c'", *p);
                return -EINVAL;
            }
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    case T_CIPHER:
        if (strcmp(v, "auto") != 0 && hm_rec_cipher_parse(v) < 0) {
            hm_errf(why, whylen, "expected auto, aes-256-gcm or chacha20-poly1305");
            return -EINVAL;
        }
        hm_strlcpy(field_str(c, o), v, o->size);
        return 0;
    case T_LEVEL: {
        char low[16];
        size_t n = strlen(v);
        if (n >= sizeof(low))
            n = sizeof(low) - 1;
        for (size_t i = 0; i < n; i++)
            low[i] = (char)((v[i] >= 'A' && v[i] <= 'Z') ? v[i] - 'A' + 'a' : v[i]);
        low[n] = '\0';
        int level = strlen(v) < sizeof(low) ? hm_log_parse_level(low) : -EINVAL;
        if (level < 0) {
            hm_errf(why, whylen, "expected error, warn, info or debug");
            return -EINVAL;
        }
        *field_int(c, o) = level;
        return 0;
    }
    }
    return -EINVAL;
}

static const struct opt *find_keyword(const char *kw)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (strcasecmp(kw, opts[i].keyword) == 0)
            return &opts[i];
    return NULL;
}

/* ---- defaults ---- */

void hm_config_defaults(hm_config *c)
{
    memset(c, 0, sizeof(*c));
    hm_strlcpy(c->listen, "0.0.0.0:31400", sizeof(c->listen));
    c->announce[0] = '\0';
    c->dialback_rate_per_origin = 6;
    c->max_dialbacks = 16;
    /* -- relay defaults -- */
    c->relay_max_reservations = 128;
    c->relay_reservations_per_origin = 4;
    c->relay_max_circuits = 64;
    c->relay_circuits_per_origin = 8;
    c->relay_max_mib = 256;
    c->relay_rate_kib = 16384;
    c->relay_circuit_lifetime_s = 3600;
    /* An unknown home leaves StateDir empty; hm_config_finish reports it. */
    if (hm_paths_default_state_dir(c->state_dir, sizeof(c->state_dir)) != 0)
        c->state_dir[0] = '\0';
    c->control_max_clients = 32;
    c->control_idle_timeout_s = 300;
    hm_strlcpy(c->swarm, "default", sizeof(c->swarm));
    c->client_mode = 0;
    c->log_level = HM_LOG_INFO;
    c->ping_interval_s = 15;
    c->max_connections = 512;
    c->max_conns_per_peer = 4;
    c->handshake_rate_per_origin = 64;
    c->dgram_new_key_rate_per_origin = 64;
    c->dgram_new_key_rate = 2048;
    c->dht_request_rate = 200;
    c->dht_store_entries = 65536;
    c->dht_store_mib = 64;
    c->dht_store_peer_kib = 1024;
    c->dht_store_origin_share = 12;
    c->peer_table_size = 4096;
    c->peer_table_origin_cap = 64;
    c->ping_stream_peers = 32;
    c->reassembly_max_mib = 512;
    c->reassembly_origin_mib = 192;
    c->reassembly_stall_timeout_s = 30;
    c->write_queue_max_mib = 256;
    c->write_queue_origin_mib = 32;
    c->write_min_rate_kib = 256;
    c->refusal_notice_origin_kib = 64;
    hm_strlcpy(c->expert_type, "ffn", sizeof(c->expert_type));
    c->expert_dim = 512;
    hm_strlcpy(c->expert_optimizer, "adam", sizeof(c->expert_optimizer));
    c->expert_workers = 2;
    c->expert_max_batch = 1024;
    c->checkpoint_interval_s = 60;
    /* -- transformer defaults -- */
    c->expert_max_seq = 512;
    c->average_weight_factor = 4;
    c->average_clip_weight_factor = 1;
    c->average_bandwidth_factor = 2;
    c->average_members_per_origin = 1;
    /* -- early parts defaults -- */
    c->average_early_parts_mib = 64;
    c->average_early_parts_origin_mib = 16;
    c->state_donors_per_origin = 1;
    c->progress_max_runs = 64;
    c->progress_runs_per_connection = 4;
    /* -- http defaults -- */
    c->http_max_connections = 32;
    c->http_max_conns_per_origin = 8;
    c->http_max_request_bytes = 8192;
    c->http_timeout_s = 10;
    c->status_publish = 1;
    c->progress_epoch_origins = 2;
    c->progress_origin_factor = 4;
    c->progress_epoch_majority = 1; /* -- progress majority default -- */
    c->expert_max_queued = 16384;
    c->expert_max_queued_mib = 1024;
    c->expert_record_max_ttl_s = 300;
    /* -- moe backoff defaults -- */
    c->expert_backoff_s = 15;
    c->expert_backoff_max_s = 300;
    c->expert_one_holder = 1;
    /* -- aead defaults -- */
    hm_strlcpy(c->stream_cipher, "auto", sizeof(c->stream_cipher));
}

int hm_config_finish(hm_config *c, char *err, size_t errlen)
{
    if (c->state_dir[0] == '\0') {
        hm_errf(err, errlen, "cannot tell the home directory; set StateDir (--state-dir)");
        return -ENOENT;
    }
    if (c->control_socket[0] == '\0' &&
        hm_paths_default_control_socket(c->state_dir, c->control_socket,
                                         sizeof(c->control_socket)) != 0) {
        c->control_socket[0] = '\0';
        hm_errf(err, errlen, "set ControlSocket (--control-socket): the default path under "
                "StateDir is too long for a Unix socket (StateDir is '%s')", c->state_dir);
        return -ENAMETOOLONG;
    }
    return 0;
}

/* ---- config file ---- */

int hm_config_load_buffer(hm_config *c, const char *name, const char *buf, size_t len, char *err,
                          size_t errlen)
{
    size_t pos = 0;
    unsigned lineno = 0;
    char line[HM_CONFIG_MAX_LINE + 1];
    char why[256];

    while (pos < len) {
        lineno++;
        const char *start = buf + pos;
        const char *nl = memchr(start, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - start) : len - pos;
        pos += n + (nl ? 1 : 0);
        if (n > 0 && start[n - 1] == '\r')
            n--;
        if (n > HM_CONFIG_MAX_LINE) {
            hm_errf(err, errlen, "%s:%u: line too long (more than %d bytes)", name, lineno,
                    HM_CONFIG_MAX_LINE);
            return -EINVAL;
        }
        if (memchr(start, '\0', n) != NULL) {
            hm_errf(err, errlen, "%s:%u: NUL byte in the line", name, lineno);
            return -EINVAL;
        }
        memcpy(line, start, n);
        line[n] = '\0';

        /* Strip a comment: '#' at the start or after a blank. */
        for (size_t i = 0; i < n; i++) {
            if (line[i] == '#' && (i == 0 || is_blank(line[i - 1]))) {
                line[i] = '\0';
                n = i;
                break;
            }
        }
        char *p = line;
        while (is_blank(*p))
            p++;
        char *end = p + strlen(p);
        while (end > p && is_blank(end[-1]))
            *--end = '\0';
        if (*p == '\0')
            continue;

        char *kw = p;
        while (*p && !is_blank(*p))
            p++;
        if (*p)
            *p++ = '\0';
        while (is_blank(*p))
            p++;

        const struct opt *o = find_keyword(kw);
        if (o == NULL) {
            hm_errf(err, errlen, "%s:%u: unknown keyword '%s'", name, lineno, kw);
            return -EINVAL;
        }
        if (*p == '\0') {
            hm_errf(err, errlen, "%s:%u: missing value for %s", name, lineno, o->keyword);
            return -EINVAL;
        }
        if (set_value(o, c, p, why, sizeof(why)) != 0) {
            hm_errf(err, errlen, "%s:%u: bad value '%s' for %s: %s", name, lineno, p, o->keyword,
                    why);
            return -EINVAL;
        }
    }
    return 0;
}

int hm_config_load_file(hm_config *c, const char *path, char *err, size_t errlen)
{
    int result = 0;
    char *buf = NULL;
    size_t len = 0;
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);

    if (fd < 0) {
        result = -errno;
        hm_errf(err, errlen, "%s: cannot open: %s", path, strerror(-result));
        goto out;
    }
    if (fstat(fd, &st) != 0) {
        result = -errno;
        hm_errf(err, errlen, "%s: cannot stat: %s", path, strerror(-result));
        goto out;
    }
    if (S_ISDIR(st.st_mode)) {
        result = -EISDIR;
        hm_errf(err, errlen, "%s: is a directory", path);
        goto out;
    }
    /* Read at most one byte past the cap, whatever st_size claims. */
    buf = malloc(HM_CONFIG_MAX_FILE + 1);
    if (buf == NULL) {
        result = -ENOMEM;
        hm_errf(err, errlen, "%s: out of memory", path);
        goto out;
    }
    while (len <= HM_CONFIG_MAX_FILE) {
        ssize_t r = read(fd, buf + len, HM_CONFIG_MAX_FILE + 1 - len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            result = -errno;
            hm_errf(err, errlen, "%s: read error: %s", path, strerror(-result));
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    if (len > HM_CONFIG_MAX_FILE) {
        result = -EFBIG;
        hm_errf(err, errlen, "%s: file larger than %d bytes", path, HM_CONFIG_MAX_FILE);
        goto out;
    }
    result = hm_config_load_buffer(c, path, buf, len, err, errlen);
out:
    free(buf);
    if (fd >= 0)
        close(fd);
    return result;
}

/* ---- command line ---- */

#define FLAG_BASE 256

int hm_config_parse_args(int argc, char **argv, hm_config_args *out, char *err, size_t errlen)
{
    struct option longopts[N_OPTS + 5];
    size_t k = 0;
    hm_config *scratch = NULL;
    char why[256];
    int result = 0;

    memset(out, 0, sizeof(*out));
    for (size_t i = 0; i < N_OPTS; i++) {
        longopts[k].name = opts[i].flag;
        longopts[k].has_arg = opts[i].type == T_BOOL ? optional_argument : required_argument;
        longopts[k].flag = NULL;
        longopts[k].val = FLAG_BASE + (int)i;
        k++;
    }
    longopts[k++] = (struct option){"config", required_argument, NULL, 'c'};
    longopts[k++] = (struct option){"test-config", no_argument, NULL, 't'};
    longopts[k++] = (struct option){"version", no_argument, NULL, 'V'};
    longopts[k++] = (struct option){"help", no_argument, NULL, 'h'};
    longopts[k] = (struct option){NULL, 0, NULL, 0};

    /* Each flag value is tried on a scratch config, so that a bad flag is
     * reported as a usage error before any file is read. */
    scratch = calloc(1, sizeof(*scratch));
    if (scratch == NULL) {
        hm_errf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    optind = 0; /* glibc: start over, so that the parser can run again */
    opterr = 0;
    for (;;) {
        int prev = optind ? optind : 1;
        int ch = getopt_long(argc, argv, ":c:tVh", longopts, NULL);
        if (ch == -1)
            break;
        switch (ch) {
        case 'c':
            out->config_file = optarg;
            break;
        case 't':
            out->test_config = 1;
            break;
        case 'V':
            out->version = 1;
            break;
        case 'h':
            out->help = 1;
            break;
        case ':':
            hm_errf(err, errlen, "option '%s' needs a value",
                    prev < argc ? argv[prev] : argv[argc - 1]);
            result = -EINVAL;
            goto out;
        case '?': {
            const char *arg = prev < argc ? argv[prev] : "?";
            if (strncmp(arg, "--", 2) == 0 && optopt != 0)
                hm_errf(err, errlen, "option '%s' takes no value", arg);
            else if (strncmp(arg, "--", 2) == 0 || optopt == 0)
                hm_errf(err, errlen, "unknown option '%s'", arg);
            else
                hm_errf(err, errlen, "unknown option '-%c'", optopt);
            result = -EINVAL;
            goto out;
        }
        default: {
            const struct opt *o = &opts[ch - FLAG_BASE];
            if (out->n_flags >= HM_CONFIG_MAX_FLAGS) {
                hm_errf(err, errlen, "too many options");
                result = -EINVAL;
                goto out;
            }
            if (o->type != T_BOOL || optarg != NULL) {
                if (set_value(o, scratch, optarg, why, sizeof(why)) != 0) {
                    hm_errf(err, errlen, "bad value '%s' for --%s: %s", optarg, o->flag, why);
                    result = -EINVAL;
                    goto out;
                }
            }
            out->flags[out->n_flags].opt = ch - FLAG_BASE;
            out->flags[out->n_flags].value = optarg;
            out->n_flags++;
            break;
        }
        }
    }
    if (optind < argc) {
        hm_errf(err, errlen, "unexpected argument '%s'", argv[optind]);
        result = -EINVAL;
        goto out;
    }
out:
    free(scratch);
    return result;
}

int hm_config_apply_args(hm_config *c, const hm_config_args *a, char *err, size_t errlen)
{
    int peers_replaced = 0;
    char why[256];

    for (size_t i = 0; i < a->n_flags; i++) {
        const struct opt *o = &opts[a->flags[i].opt];
        const char *v = a->flags[i].value;
        /* Flags override the file: the first --initial-peers replaces the
         * file's list, later ones add to it. */
        if (o->type == T_PEERS && !peers_replaced) {
            c->n_initial_peers = 0;
            peers_replaced = 1;
        }
        if (o->type == T_BOOL && v == NULL) {
            *field_int(c, o) = 1;
            continue;
        }
        if (set_value(o, c, v, why, sizeof(why)) != 0) {
            hm_errf(err, errlen, "bad value '%s' for --%s: %s", v, o->flag, why);
            return -EINVAL;
        }
    }
    return 0;
}

int hm_config_build(hm_config *c, const hm_config_args *a, char *err, size_t errlen)
{
    int result;
    hm_config_defaults(c);
    if (a->config_file != NULL) {
        result = hm_config_load_file(c, a->config_file, err, errlen);
        if (result != 0)
            return result;
    }
    result = hm_config_apply_args(c, a, err, errlen);
    if (result != 0)
        return result;
    return hm_config_finish(c, err, errlen);
}

/* ---- printing and comparing ---- */

/*
 * An option left unset: its effective value is decided later (an expert's
 * learning rate follows its optimizer), so the line quotes the default
 * from the help text instead of claiming there is none.
 */
static void format_unset(hm_strbuf *b, const struct opt *o)
{
    const char *d = strstr(o->help, "(default ");
    if (d != NULL && strncmp(d, "(default none", 13) != 0) {
        d += 9;
        size_t n = strcspn(d, ")");
        hm_strbuf_printf(b, "# %s (unset: default %.*s)\n", o->keyword, (int)n, d);
        return;
    }
    hm_strbuf_printf(b, "# %s (none)\n", o->keyword);
}

char *hm_config_format(const hm_config *c)
{
    hm_strbuf b = {0};
    hm_strbuf_printf(&b, "# hivemindd configuration (keywords are case-insensitive)\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        const struct opt *o = &opts[i];
        switch (o->type) {
        case T_PEERS:
            if (c->n_initial_peers == 0)
                hm_strbuf_printf(&b, "# %s (none)\n", o->keyword);
            for (size_t j = 0; j < c->n_initial_peers; j++)
                hm_strbuf_printf(&b, "%s %s\n", o->keyword, c->initial_peers[j]);
            break;
        case T_HOSTPORT:
        case T_PATH:
        case T_SOCKET:
        case T_GROUP:
        case T_SWARM:
        case T_WORD:
        case T_CIPHER:
            if (field_cstr(c, o)[0] == '\0')
                format_unset(&b, o);
            else
                hm_strbuf_printf(&b, "%s %s\n", o->keyword, field_cstr(c, o));
            break;
        case T_UINT:
            hm_strbuf_printf(&b, "%s %u\n", o->keyword, field_cuint(c, o));
            break;
        case T_BOOL:
            hm_strbuf_printf(&b, "%s %s\n", o->keyword, field_cint(c, o) ? "yes" : "no");
            break;
        case T_LEVEL:
            hm_strbuf_printf(&b, "%s %s\n", o->keyword, hm_log_level_name(field_cint(c, o)));
            break;
        }
    }
    return hm_strbuf_finish(&b);
}

static int opt_equal(const struct opt *o, const hm_config *a, const hm_config *b)
{
    switch (o->type) {
    case T_PEERS:
        if (a->n_initial_peers != b->n_initial_peers)
            return 0;
        for (size_t j = 0; j < a->n_initial_peers; j++)
            if (strcmp(a->initial_peers[j], b->initial_peers[j]) != 0)
                return 0;
        return 1;
    case T_UINT:
        return field_cuint(a, o) == field_cuint(b, o);
    case T_BOOL:
    case T_LEVEL:
        return field_cint(a, o) == field_cint(b, o);
    default:
        return strcmp(field_cstr(a, o), field_cstr(b, o)) == 0;
    }
}

int hm_config_equal(const hm_config *a, const hm_config *b)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (!opt_equal(&opts[i], a, b))
            return 0;
    return 1;
}

size_t hm_config_diff(const hm_config *a, const hm_config *b, const char **keywords_out,
                      int *reloadable_out, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; i < N_OPTS; i++) {
        if (opt_equal(&opts[i], a, b))
            continue;
        if (n < max) {
            if (keywords_out)
                keywords_out[n] = opts[i].keyword;
            if (reloadable_out)
                reloadable_out[n] = opts[i].reloadable;
        }
        n++;
    }
    return n;
}

void hm_config_usage(FILE *f, const char *prog)
{
    fprintf(f,
            "Usage: %s [OPTIONS]\n"
            "Runs a hivemindd node: joins a swarm through its initial peers and serves\n"
            "a control socket for hivemindctl. Flags override the config file.\n\n"
            "  -c, --config FILE        read settings from FILE (Keyword value lines)\n"
            "  -t, --test-config        check the configuration, print it and exit\n"
            "  -V, --version            print the version and exit\n"
            "  -h, --help               print this help and exit\n\n",
            prog);
    for (size_t i = 0; i < N_OPTS; i++) {
        const struct opt *o = &opts[i];
        char left[64];
        if (o->type == T_BOOL)
            snprintf(left, sizeof(left), "--%s[=yes|no]", o->flag);
        else
            snprintf(left, sizeof(left), "--%s %s", o->flag, o->metavar);
        fprintf(f, "  %s\n      %s: %s\n", left, o->keyword, o->help);
    }
    fprintf(f, "\nExit status: 0 ok, 1 failure, 64 bad usage, 78 bad config file.\n"
               "At start the node prints its address, PEERID@HOST:PORT, as the first line\n"
               "on standard output.\n");
}

/* ---- directories ---- */

int hm_config_make_dir(const char *dir, unsigned mode, char *err, size_t errlen)
{
    char path[HM_CONFIG_PATH_LEN];
    struct stat st;

    if (hm_strlcpy(path, dir, sizeof(path)) != 0 || path[0] == '\0') {
        hm_errf(err, errlen, "bad directory path '%s'", dir);
        return -ENAMETOOLONG;
    }
    /* Create each missing component; existing ones are left alone. */
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(path, (mode_t)mode) != 0 && errno != EEXIST) {
            int e = errno;
            hm_errf(err, errlen, "cannot create directory '%s': %s", path, strerror(e));
            return -e;
        }
        *p = saved;
        if (saved == '\0')
            break;
    }
    if (stat(dir, &st) != 0) {
        int e = errno;
        hm_errf(err, errlen, "cannot use directory '%s': %s", dir, strerror(e));
        return -e;
    }
    if (!S_ISDIR(st.st_mode)) {
        hm_errf(err, errlen, "'%s' exists and is not a directory", dir);
        return -ENOTDIR;
    }
    return 0;
}
