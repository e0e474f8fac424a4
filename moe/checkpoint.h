/*
 * checkpoint: durable files for expert state (and anything else that must
 * survive a crash). Owns nothing between calls.
 *
 * File format: "HMCK" (4 bytes), u32 format version (1), u64 payload
 * length, 32-byte BLAKE2b-256 of the payload, then the payload (integers
 * big-endian). A file whose length, version or hash does not match is
 * corrupt.
 *
 * Writing is atomic: the payload goes to PATH.tmp, which is fsync'd; the
 * current PATH (if any) is renamed to PATH.prev only when it verifies in
 * full (header, size and payload hash: a broken PATH would only displace a
 * good PATH.prev), which reads PATH back once on every write; PATH.tmp is
 * renamed to PATH; the directory is fsync'd. A crash at any point leaves PATH or
 * PATH.prev (or both) holding a complete, verified checkpoint.
 *
 * Reading tries PATH, then PATH.prev, and says which one it used.
 */
#ifndef HM_MOE_CHECKPOINT_H
#define HM_MOE_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#define HM_CKPT_HEADER_BYTES 48

/* 0 or -errno of the failing system call (-ENOSPC, -EACCES, ...). */
int hm_ckpt_write(const char *path, const void *payload, size_t len);

/*
 * Reads the newest good checkpoint of at most max_len payload bytes into a
 * malloc'd buffer. *used_prev_out (may be NULL) is 1 when PATH was missing
 * or corrupt and PATH.prev was used. Returns 0, -ENOENT (neither exists),
 * -EBADMSG (what exists is corrupt), -EMSGSIZE (over max_len) or -ENOMEM.
 */
int hm_ckpt_read(const char *path, size_t max_len, uint8_t **payload_out, size_t *len_out,
                 int *used_prev_out);

/*
 * Reads and verifies exactly the file at path, with no fallback (for a
 * caller that found PATH's content unusable and wants PATH.prev itself).
 * Returns 0, -ENOENT, -EBADMSG, -EMSGSIZE, -ENOMEM or -errno.
 */
int hm_ckpt_read_file(const char *path, size_t max_len, uint8_t **payload_out, size_t *len_out);

/*
 * The pure check, for the fuzz target: verifies a whole file image and
 * points *payload_out into it. 0, -EBADMSG or -EMSGSIZE.
 */
int hm_ckpt_parse(const uint8_t *file, size_t len, size_t max_len, const uint8_t **payload_out,
                  size_t *payload_len_out);

#endif
