/*
 * test_dht_swarm: the DHT across real hivemindd processes on 127.0.0.1,
 * driven through hivemindctl as an operator would. Ten daemons join from
 * one bootstrap node; a value put through one node is read through another;
 * the three nodes closest to the key are killed with SIGKILL and the value
 * is still found; a node frozen with SIGSTOP for 30 s is dropped by the
 * others and taken back once it resumes.
 */
#include "config.h"

#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <sodium.h>
#include <string.h>

#include "src/base/crypto.h"
#include "tests/proc.h"

#define N_NODES 10

static void setup(void) { hm_proc_setup("dhtswarm"); }
static void teardown(void) { hm_proc_teardown(); }

TestSuite(dht_swarm, .init = setup, .fini = teardown, .timeout = 180);

/* The value stored under key as read through n, or NULL (caller frees). */
static char *dht_get(struct node *n, const char *key)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "get", key, NULL);
    char *v = NULL;
    const json_t *values = json_object_get(json_object_get(j, "result"), "values");
    if (rc == 0 && json_array_size(values) > 0) {
        const char *s = json_string_value(json_object_get(json_array_get(values, 0), "value"));
        if (s != NULL)
            v = strdup(s);
    }
    json_decref(j);
    return v;
}

static long dht_put(struct node *n, const char *key, const char *value)
{
    int rc;
    json_t *j = ctl_json(n, &rc, "dht", "put", key, value, "--ttl", "600", NULL);
    long stored = rc == 0 ? (long)json_integer_value(json_object_get(json_object_get(j, "result"),
                                                                     "stored"))
                          : -1;
    json_decref(j);
    return stored;
}

static void start_swarm(struct node *nodes, size_t n)
{
    char name[16];
    start_node(&nodes[0], "n0", NULL, NULL);
    for (size_t i = 1; i < n; i++) {
        snprintf(name, sizeof(name), "n%zu", i);
        start_node(&nodes[i], name, NULL, "--initial-peers", nodes[0].addr, NULL);
    }
    /* Every node knows a good part of the swarm before the test reads and writes. */
    long deadline = hm_test_now_ms() + 30000;
    size_t ready = 0;
    while (ready < n && hm_test_now_ms() < deadline) {
        ready = 0;
        for (size_t i = 0; i < n; i++)
            ready += node_rt_size(&nodes[i]) >= (long)(n / 2);
        if (ready < n)
            usleep(300000);
    }
    cr_assert_eq(ready, n, "only %zu of %zu nodes filled their routing tables", ready, n);
}

typedef struct ranked {
    size_t idx;
    uint8_t dist[32];
} ranked;

static int cmp_ranked(const void *a, const void *b)
{
    return memcmp(((const ranked *)a)->dist, ((const ranked *)b)->dist, 32);
}

Test(dht_swarm, value_survives_the_death_of_the_closest_nodes)
{
    struct node nodes[N_NODES];
    start_swarm(nodes, N_NODES);

    const char *key = "dht-swarm-test-key";
    long stored = dht_put(&nodes[2], key, "hello swarm");
    cr_assert_geq(stored, 3, "put reached %ld replicas", stored);
    char *v = dht_get(&nodes[7], key);
    cr_assert_not_null(v, "get through another node found nothing");
    cr_assert_str_eq(v, "hello swarm");
    free(v);

    /* Rank the nodes by XOR distance of their DHT ids to the key's id. */
    uint8_t key_id[32];
    crypto_generichash(key_id, 32, (const uint8_t *)key, strlen(key), NULL, 0);
    ranked r[N_NODES];
    for (size_t i = 0; i < N_NODES; i++) {
        uint8_t pk[HM_PK_BYTES], id[HM_NODE_ID_BYTES];
        cr_assert_eq(hm_peer_id_decode(nodes[i].id, strlen(nodes[i].id), pk), 0);
        hm_node_id_from_pk(pk, id);
        r[i].idx = i;
        for (size_t b = 0; b < 32; b++)
            r[i].dist[b] = id[b] ^ key_id[b];
    }
    qsort(r, N_NODES, sizeof(r[0]), cmp_ranked);

    /* Kill the three closest without warning. */
    int dead[N_NODES] = {0};
    for (size_t i = 0; i < 3; i++) {
        struct node *victim = &nodes[r[i].idx];
        cr_assert_eq(kill(victim->pid, SIGKILL), 0);
        cr_assert_neq(wait_exit(victim->pid, 5000), -1);
        dead[r[i].idx] = 1;
    }
    /* Read through every survivor: each finds the value from the replicas left. */
    size_t found = 0, asked = 0;
    for (size_t i = 0; i < N_NODES; i++) {
        if (dead[i])
            continue;
        asked++;
        char *got = dht_get(&nodes[i], key);
        if (got != NULL && strcmp(got, "hello swarm") == 0)
            found++;
        free(got);
    }
    cr_assert_eq(found, asked, "value found through %zu of %zu surviving nodes", found, asked);

    for (size_t i = 0; i < N_NODES; i++)
        if (!dead[i])
            stop_node(&nodes[i]);
}

Test(dht_swarm, stopped_node_is_dropped_and_taken_back)
{
    struct node nodes[4];
    start_swarm(nodes, 4);
    struct node *frozen = &nodes[3];
    for (size_t i = 0; i < 3; i++)
        cr_assert(peers_show(&nodes[i], frozen->id));

    cr_assert_eq(kill(frozen->pid, SIGSTOP), 0);
    long stop_at = hm_test_now_ms();
    /* Lookups during the freeze send requests to it that time out, so the
     * DHT's routing tables drop it too. */
    int dropped = 0;
    while (hm_test_now_ms() - stop_at < 30000) {
        for (size_t i = 0; i < 3; i++) {
            char key[32];
            snprintf(key, sizeof(key), "probe-%zu-%ld", i, hm_test_now_ms());
            free(dht_get(&nodes[i], key));
        }
        dropped = 1;
        for (size_t i = 0; i < 3; i++)
            dropped &= !peers_show(&nodes[i], frozen->id) && node_rt_size(&nodes[i]) <= 2;
        if (dropped)
            break;
    }
    cr_assert(dropped, "the frozen node was not dropped by every peer within 30 s");
    /* Hold it frozen for the full 30 s before letting it go. */
    while (hm_test_now_ms() - stop_at < 30000)
        usleep(200000);
    cr_assert_eq(kill(frozen->pid, SIGCONT), 0);

    long deadline = hm_test_now_ms() + 20000;
    int back = 0;
    while (!back && hm_test_now_ms() < deadline) {
        back = 1;
        for (size_t i = 0; i < 3; i++)
            back &= peers_show(&nodes[i], frozen->id) && node_rt_size(&nodes[i]) == 3;
        if (!back)
            usleep(300000);
    }
    cr_assert(back, "the resumed node was not taken back within 20 s");
    for (size_t i = 0; i < 4; i++)
        stop_node(&nodes[i]);
}
