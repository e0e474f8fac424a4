/*
 * cmd_status: the swarm snapshot behind /api/status, the swarm page and
 * `hivemindctl top` (the "status" command), the node summaries it
 * publishes in the DHT, and the metrics the HTTP /metrics adds to
 * "metrics" (cmd_status.c says how; docs/control-protocol.md, "status",
 * lists the fields). Loop thread only.
 */
#ifndef HM_DAEMON_CMD_STATUS_H
#define HM_DAEMON_CMD_STATUS_H

#include "src/daemon/daemon.h"
#include "src/daemon/status_rec.h"

#include <jansson.h>

/* The DHT key of the node summaries; one owned subkey per node. */
#define HM_STATUS_KEY "hivemindd.status"
/* Summaries shown at most (the DHT bounds a dictionary too). */
#define HM_STATUS_MAX_NODES 256

/* A finished snapshot: st is borrowed for the call. */
typedef void (*hm_status_cb)(void *ud, const json_t *st);

/*
 * Assembles a snapshot; cb fires exactly once (possibly before this
 * returns) unless this fails: 0, -ESHUTDOWN (closing) or -ENOMEM. Parts
 * that failed are named in the snapshot's "errors".
 */
int hm_cmd_status_build(hm_cmd_status *s, hm_status_cb cb, void *ud);

/* Appends process_*, averaging rounds by result and their duration,
 * connections by state and per hosted expert requests and latency. s may
 * be NULL (process_* only). */
void hm_cmd_status_metrics(hm_cmd_status *s, hm_strbuf *b);

/* Stops the timer; cb fires once the builds in flight have answered and
 * the group is freed. Call it before the control server closes. */
void hm_cmd_status_close(hm_cmd_status *s, void (*cb)(void *ud), void *ud);

#endif
