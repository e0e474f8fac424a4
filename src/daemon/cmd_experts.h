/*
 * cmd_experts: the experts of hivemindd. It owns the node's expert server
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
 *   experts.call      one forward on a raw float32 file (hivemindctl); the
 *                     file is read and written off the loop thread and the
 *                     output written atomically (tensor_file.h)
 *
 * hm_cmd_experts_register (daemon.h) creates it from the configuration
 * and hangs it on the hm_daemon. Shutdown: hm_cmd_experts_close stops the
 * server (final checkpoints, withdrawal of the DHT declarations) while the
 * node still runs, so the node must be closed only after its callback.
 */
#ifndef HM_DAEMON_CMD_EXPERTS_H
#define HM_DAEMON_CMD_EXPERTS_H

#include "src/daemon/daemon.h"
#include "src/base/origin.h"

#include <stddef.h>

/*
 * Checks the expert settings of a configuration without starting
 * anything: the expert type, sizes, optimizer, learning rate and every
 * hosting pattern. 0, or -EINVAL with a sentence in err (hivemindd exits
 * 78 on it, also for -t).
 */
int hm_cmd_experts_check_config(const hm_config *c, char *err, size_t errlen);

/*
 * Cancels calls in flight (their commands are answered with an error),
 * closes the server (checkpoints, withdraws its declarations) and frees
 * everything once no command uses it any more; cb fires after that.
 */
void hm_cmd_experts_close(hm_cmd_experts *m, void (*cb)(void *ud), void *ud);

/* The hosted experts with their statistics, as experts.list's "hosted"
 * (a new array; empty when m is NULL or closing, NULL without memory), for
 * the status snapshot (cmd_status.c). */
json_t *hm_cmd_experts_hosted(hm_cmd_experts *m);

/* What the expert server's queue bounds and the client's record policy
 * refused, under their config keywords (docs/security.md); m may be NULL. */
void hm_cmd_experts_limits(hm_cmd_experts *m, hm_limit_emit_fn emit, void *ud);

/* The expert client's back-off of stalled hosts, as Prometheus text; m may be NULL. */
void hm_cmd_experts_metrics(hm_cmd_experts *m, hm_strbuf *b);

#endif
