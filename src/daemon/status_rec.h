/*
 * status_rec: one node of the swarm view from its summary record, as
 * "dht.get" returns it ({"subkey": "[owner:PEERID]", "value": JSON text,
 * "expiration": UNIX seconds, ...}); status_rec.c says what is kept.
 */
#ifndef HM_DAEMON_STATUS_REC_H
#define HM_DAEMON_STATUS_REC_H

#include <jansson.h>

/* The summary's value is JSON text of at most this many bytes. */
#define HM_STATUS_VALUE_MAX 900

/*
 * The node (a new object: peer_id, address, version, uptime_s, peers,
 * rounds_ok, rounds_failed, client_mode, experts [{uid, requests,
 * latency_p50_ms, latency_p99_ms}], n_experts, expires_in_s, self false)
 * or NULL for a record to ignore (not an owned subkey, too long, not a
 * JSON object). now is the reader's UNIX time.
 */
json_t *hm_status_node_of_record(const json_t *rec, double now);
/* (Also age_s: how old the record's figures are, 0 to 120 s, from its
 * "t"; uptime_s counts it in.) */

#endif
