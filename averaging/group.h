/*
 * group: what matchmaking hands to the all-reduce, shared by both. A group
 * is an ordered list of members that agreed to average together in one
 * round. The order is the same on every member (the leader decides it and
 * sends it to all), so that every member computes the same span layout
 * without further messages.
 */
#ifndef HM_AVG_GROUP_H
#define HM_AVG_GROUP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "src/base/crypto.h"

#define HM_AVG_MAX_GROUP 64
#define HM_AVG_GROUP_ID_BYTES 32

typedef struct hm_avg_member {
    uint8_t pk[HM_PK_BYTES];
    struct sockaddr_storage addr; /* listen address (datagrams and streams) */
    /*
     * Declared bandwidth in bytes per second: spans are sized in proportion.
     * 0 for a client-mode member, which sends and receives but reduces
     * nothing.
     */
    double bandwidth;
} hm_avg_member;

typedef struct hm_avg_group {
    uint8_t group_id[HM_AVG_GROUP_ID_BYTES]; /* random, chosen by the leader */
    size_t n;                                /* 1..HM_AVG_MAX_GROUP */
    hm_avg_member members[HM_AVG_MAX_GROUP];
    size_t self;                             /* our index in members */
    /*
     * Moshpit group bits for the next round (a string of '0'/'1'), derived
     * from this group so that members meet different partners next time.
     */
    char next_bits[33];
} hm_avg_group;

#endif
