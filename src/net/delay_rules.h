/*
 * delay_rules: the parser of TestDelay, the network lab's per-address
 * one-way delays (tests/netlab/, hivemindd.conf(5)). A test option, never
 * for production: the transport holds what it sends to a matching address
 * (transport.h, hm_transport_faults) for the rule's milliseconds.
 */
#ifndef HM_NET_DELAY_RULES_H
#define HM_NET_DELAY_RULES_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* -- netlab: per-address delays (TestDelay) -- */
#define HM_TRANSPORT_DELAY_RULES_MAX 16
#define HM_TRANSPORT_DELAY_MS_MAX 10000
/* Sends to addresses within addr/prefix (the port is not compared) wait delay_ms. */
typedef struct hm_transport_delay_rule {
    struct sockaddr_storage addr;
    unsigned prefix; /* leading bits compared: 0..32 (IPv4), 0..128 (IPv6) */
    uint64_t delay_ms;
} hm_transport_delay_rule;
/*
 * Parses a TestDelay value, "ADDR[/BITS]=MS[,ADDR[/BITS]=MS...]" (IPv4 or
 * IPv6 addresses, MS 0..HM_TRANSPORT_DELAY_MS_MAX, at most max rules), into
 * out (out may be NULL to check only). Returns the number of rules, or
 * -EINVAL with the reason in why.
 */
int hm_transport_delay_parse(const char *spec, hm_transport_delay_rule *out, size_t max,
                             char *why, size_t whylen);

#endif
