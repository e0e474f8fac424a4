/*
 * cmd_state: state sharing in hivemindd. It owns the node's state
 * module (averaging/state.h: the blobs this node shares and the downloads
 * in progress) and registers the state.* control commands
 * (docs/control-protocol.md):
 *
 *   state.share  {prefix, step, data: SHMREF, bytes?, chunk_size?, ttl?}
 *                shares a copy of the bytes in shared memory as the state
 *                at step (the bytes are copied before the reply; "bytes"
 *                trims a blob that is not a whole number of floats)
 *   state.load   {prefix, data: SHMREF, timeout?, min_agree?}
 *                downloads the agreed state into the shared-memory range
 *                (which must be large enough) and answers with the report:
 *                step, hash, bytes, donors used and dropped with reasons
 *   state.info   {prefix} what this node shares under the prefix
 *
 * Shared-memory references are daemon.h's {"shm": ID, "offset": BYTES,
 * "elems": N}; N counts float32 slots, so a range holds 4 N bytes.
 *
 * hm_cmd_state_register (daemon.h) creates it and hangs it on the
 * hm_daemon. Shutdown: hm_cmd_state_close ends the downloads (their
 * commands are answered "stopping") and must run before the node closes,
 * in the same loop turn at the latest.
 */
#ifndef HM_DAEMON_CMD_STATE_H
#define HM_DAEMON_CMD_STATE_H

#include "src/daemon/daemon.h"

/* Ends the downloads, stops sharing and frees everything; cb fires from
 * the loop after that. */
void hm_cmd_state_close(hm_cmd_state *s, void (*cb)(void *ud), void *ud);

#endif
