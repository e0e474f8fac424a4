#!/usr/bin/python3
"""OpenDHT's side of bench/dht_vs_opendht.sh: the same phases as
bench_dht --only latency, on OpenDHT 2.4 (Debian python3-opendht).

NODES OpenDHT nodes on 127.0.0.1 (port 0 each) in this process, each
bootstrapped through the first; once settled, a client node that joined
through three of them puts OPS distinct keys one after another, then gets
them one after another; then CHURN% of the nodes are stopped at once and
the client gets every key again, 8 at a time. Prints p50/p95 and success
counts in bench_dht's format. Nothing leaves 127.0.0.1.
"""
import argparse
import os
import random
import statistics
import sys
import threading
import time

import opendht as dht


def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def lat(what, v):
    print("%s latency: p50 %7.2f ms   p95 %7.2f ms   (max %.2f ms, %d ops)"
          % (what, pct(v, 0.5), pct(v, 0.95), max(v) if v else float("nan"), len(v)))


def start(bootstrap=None):
    r = dht.DhtRunner()
    r.run(port=0, ipv4="127.0.0.1", ipv6="")
    if bootstrap is not None:
        r.bootstrap("127.0.0.1", str(bootstrap.getBound().getPort()))
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--churn", type=int, default=30)
    a = ap.parse_args()
    if not (2 <= a.nodes <= 128 and 1 <= a.ops <= 100000 and 0 <= a.churn <= 90):
        ap.error("out of range")
    print("\n== latency: %d OpenDHT %s nodes on 127.0.0.1, %d puts then %d gets =="
          % (a.nodes, getattr(dht, "__version__", "2.4"), a.ops, a.ops))
    nodes = [start()]
    for _ in range(a.nodes - 1):
        nodes.append(start(nodes[0]))
    # OpenDHT has no routing-table size in its Python API; its nodes ping
    # and fill their tables within a few seconds on loopback.
    time.sleep(5)
    client = start(nodes[0])
    for n in (nodes[len(nodes) // 3], nodes[(2 * len(nodes)) // 3]):
        client.bootstrap("127.0.0.1", str(n.getBound().getPort()))
    time.sleep(3)
    tag = "%08x" % random.getrandbits(32)
    keys = ["bench-dht-%s-%d" % (tag, i) for i in range(a.ops)]
    vals = [os.urandom(64) for _ in range(a.ops)]
    put_ms, get_ms, put_ok, get_ok = [], [], 0, 0
    for k, v in zip(keys, vals):
        t = time.perf_counter()
        ok = client.put(dht.InfoHash.get(k), dht.Value(v))
        put_ms.append((time.perf_counter() - t) * 1000)
        put_ok += bool(ok)
    for k, v in zip(keys, vals):
        t = time.perf_counter()
        got = client.get(dht.InfoHash.get(k))
        get_ms.append((time.perf_counter() - t) * 1000)
        get_ok += any(bytes(x.data) == v for x in got)
    lat("put", put_ms)
    lat("get", get_ms)
    print("puts ok: %d of %d" % (put_ok, a.ops))
    print("gets ok: %d of %d found the value put" % (get_ok, a.ops))
    sys.stdout.flush()

    if a.churn > 0:
        nkill = (a.nodes * a.churn + 50) // 100
        victims = random.sample(range(a.nodes), nkill)
        for i in victims:
            nodes[i].join()
        print("\n== churn: %d of %d nodes stopped, then %d gets, 8 at a time =="
              % (nkill, a.nodes, a.ops))
        churn_ms, churn_ok = [], 0
        for i in range(0, a.ops, 8):
            batch = list(range(i, min(i + 8, a.ops)))
            done = {j: threading.Event() for j in batch}
            found = {j: False for j in batch}
            start_t = {}
            end_t = {}

            def get_cb(value, j):
                if bytes(value.data) == vals[j]:
                    found[j] = True
                return True

            def done_cb(ok, nodes_, j):
                end_t[j] = time.perf_counter()
                done[j].set()

            for j in batch:
                start_t[j] = time.perf_counter()
                client.get(dht.InfoHash.get(keys[j]),
                           get_cb=lambda v, j=j: get_cb(v, j),
                           done_cb=lambda ok, ns, j=j: done_cb(ok, ns, j))
            for j in batch:
                done[j].wait(30)
                churn_ms.append(((end_t.get(j) or time.perf_counter()) - start_t[j]) * 1000)
                churn_ok += found[j]
        lat("get after churn", churn_ms)
        print("gets after churn ok: %d of %d found the value put" % (churn_ok, a.ops))
        for i, n in enumerate(nodes):
            if i not in victims:
                n.join()
    client.join()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
