/*
 * daemon_moe: the experts of hivemindd. It owns the node's expert server
 * (moe/server.h: the experts this node hosts) and expert client
 * (moe/client.h: calls to experts elsewhere), hosts the experts the
 * configuration names, and registers the experts.* control commands
 * (docs/control-protocol.md):
 *
 *   experts.host      host more experts at run time
 *   experts.list      hosted experts with their statistics, and the experts
 *                     the swarm declares under a grid prefix
 *   experts.find      beam search over a grid with the trainer's gate scores
 *   experts.forward   forward on k experts at once (tensors in shared memory)
 *   experts.backward  backward on k experts at once (tensors in shared memory)
 *   experts.call      one forward on a raw float32 file (hivemindctl)
 *
 * Shutdown: hm_dmoe_close stops the server (final checkpoints, withdrawal
 * of the DHT declarations) while the node still runs, so the node must be
 * closed only after its callback.
 */
#ifndef HM_DAEMON_MOE_H
#define HM_DAEMON_MOE_H

#include "src/daemon/control.h"
#include "src/node/node.h"

#include <stddef.h>

struct daemon;
typedef struct hm_dmoe hm_dmoe;

typedef struct hm_dmoe_config {
    const char *state_dir;       /* checkpoints under STATE_DIR/experts */
    const char *host_experts;    /* comma-separated patterns, "" for none */
    const char *type;            /* "ffn" */
    unsigned dim, hidden;        /* hidden 0: 4 dim */
    const char *optimizer;       /* "adam" or "sgd" */
    const char *lr;              /* "" for the optimizer's default */
    unsigned workers, max_batch;
    unsigned checkpoint_interval_s;
} hm_dmoe_config;

/*
 * Checks a configuration without starting anything: the expert type,
 * sizes, optimizer, learning rate and every hosting pattern. 0, or
 * -EINVAL with a sentence in err (hivemindd exits 78 on it, also for -t).
 */
int hm_dmoe_check_config(const hm_dmoe_config *c, char *err, size_t errlen);

/*
 * Starts the expert server and client on node, hosts the configured
 * experts and registers the commands on ctl. On failure err holds a
 * sentence for the operator (a bad pattern or option is a configuration
 * error) and nothing is left running.
 */
int hm_dmoe_new(struct daemon *d, hm_node *node, hm_control *ctl, const hm_dmoe_config *c,
                hm_dmoe **out, char *err, size_t errlen);

/*
 * Cancels calls in flight (their commands are answered with an error),
 * closes the server (checkpoints, withdraws its declarations) and frees
 * everything once no command uses it any more; cb fires after that.
 */
void hm_dmoe_close(hm_dmoe *m, void (*cb)(void *ud), void *ud);

#endif
