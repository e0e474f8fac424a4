/*
 * fuzz_rpc_head: the envelope head parser the rpc layer runs on the first
 * bytes of an inbound message that reassembly refused (src/net/rpc.h,
 * hm_rpc_parse_head), against arbitrary bytes. It must never read past the
 * given length (ASan), and what it accepts must agree with msgpack: the
 * same bytes, completed into a whole envelope, decode to the same type and
 * id (an oracle: a mismatch aborts). The seeds are heads of a request and
 * a response.
 */
#include "config.h"

#include "src/net/rpc.h"

#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t type, id;
    /* A copy of exactly size bytes, so that ASan sees any read past it. */
    uint8_t *head = malloc(size > 0 ? size : 1);
    if (head == NULL)
        return 0;
    if (size > 0)
        memcpy(head, data, size);
    int rc = hm_rpc_parse_head(head, size, &type, &id);
    CHECK(rc == 0 || rc == -EPROTO);
    if (rc == 0) {
        /* The two integers after the array header, as msgpack reads them
         * from a complete array of two items. */
        size_t hdr = (head[0] & 0xf0) == 0x90 ? 1 : 3;
        uint8_t whole[32];
        size_t body = size - hdr < sizeof(whole) - 1 ? size - hdr : sizeof(whole) - 1;
        size_t off = 0;
        msgpack_unpacked r;
        whole[0] = 0x92;
        memcpy(whole + 1, head + hdr, body);
        msgpack_unpacked_init(&r);
        CHECK(msgpack_unpack_next(&r, (const char *)whole, body + 1, &off) ==
              MSGPACK_UNPACK_SUCCESS);
        CHECK(r.data.type == MSGPACK_OBJECT_ARRAY && r.data.via.array.size == 2);
        CHECK(r.data.via.array.ptr[0].type == MSGPACK_OBJECT_POSITIVE_INTEGER);
        CHECK(r.data.via.array.ptr[1].type == MSGPACK_OBJECT_POSITIVE_INTEGER);
        CHECK(r.data.via.array.ptr[0].via.u64 == type);
        CHECK(r.data.via.array.ptr[1].via.u64 == id);
        msgpack_unpacked_destroy(&r);
    }
    free(head);
    return 0;
}
