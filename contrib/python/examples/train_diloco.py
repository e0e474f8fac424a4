#!/usr/bin/python3
"""Trains a Fashion-MNIST classifier with DiLoCo through the local hivemindd.

    image (784) -> Linear(784, hidden) -> ReLU -> Linear(hidden, 10)

Every trainer takes --inner-steps steps of AdamW on its own shard of the
training set (--shard I/N), then the swarm averages the pseudo-gradients
(the parameters at the last outer step minus the current ones) and every
trainer takes the same outer Nesterov SGD step (--outer-lr, 0.7;
--outer-momentum, 0.9): hivemindd.DiLoCo. Trainers that start together
start from the same parameters (--seed); one started later loads the run's
outer state from the others. A round that finds no group is applied with
the trainer's own pseudo-gradient and says so.

With --solo it trains the same model alone, without a daemon, for the
comparison in docs/benchmarks.md.

    hivemindd --listen 127.0.0.1:0 --state-dir /tmp/a --control-socket /tmp/a/ctl.sock
    hivemindd --listen 127.0.0.1:0 --state-dir /tmp/b --control-socket /tmp/b/ctl.sock \\
        --initial-peers ADDRESS_PRINTED_BY_THE_FIRST
    export HIVEMIND_LIB=build/lib/.libs/libhivemind.so PYTHONPATH=contrib/python
    /usr/bin/python3 contrib/python/examples/train_diloco.py --socket /tmp/a/ctl.sock \\
        --shard 0/2 --peers 2 &
    /usr/bin/python3 contrib/python/examples/train_diloco.py --socket /tmp/b/ctl.sock \\
        --shard 1/2 --peers 2

It prints "outer R t T acc A ..." after each outer step (A: accuracy of the
outer parameters on the first --eval-samples test images) and "test
accuracy A" at the end.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_fmnist import load  # noqa: E402  (the bounded IDX reader)


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="the daemon's control socket (default: its default path)")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--run-id", default="fmnist.diloco")
    ap.add_argument("--solo", action="store_true", help="train alone, without DiLoCo")
    ap.add_argument("--shard", default="0/1", help="I/N: train on every N-th sample from I")
    ap.add_argument("--peers", type=int, default=2, help="the group size each round waits for")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000, help="inner steps in all")
    ap.add_argument("--time-limit", type=float, default=0, help="stop after S seconds (0: none)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's")
    ap.add_argument("--inner-steps", type=int, default=50, help="H")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--compression", default="fp16", choices=["none", "fp16", "8bit"])
    ap.add_argument("--average-timeout", type=float, default=30.0)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="--solo: evaluate every N steps (0: --inner-steps)")
    ap.add_argument("--eval-samples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="the initial parameters' (same for all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    shard, n_shards = (int(v) for v in args.shard.split("/"))
    if not 0 <= shard < n_shards:
        ap.error("--shard I/N needs 0 <= I < N")
    x_train, y_train = load(args.data_dir, "train")
    x_test, y_test = load(args.data_dir, "t10k")
    x_train, y_train = x_train[shard::n_shards], y_train[shard::n_shards]
    x_eval, y_eval = x_test[:args.eval_samples], y_test[:args.eval_samples]

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = np.random.default_rng(1000 + shard)

    client = opt = None
    if args.solo:
        opt = inner
    else:
        from hivemindd import Client, DiLoCo

        client = Client(args.socket)
        opt = DiLoCo(model.parameters(), inner, run_id=args.run_id,
                     inner_steps=args.inner_steps, outer_lr=args.outer_lr,
                     outer_momentum=args.outer_momentum, compression=args.compression,
                     client=client, weight=1.0, target_group_size=args.peers,
                     min_group_size=min(2, args.peers), timeout=args.average_timeout,
                     matchmaking_time=min(5.0, args.average_timeout))
        s = opt.start_report
        print("attached to %s; %s at outer round %d" %
              (client.info()["address"], "loaded the run's state" if s["loaded"] else
               "starting the run", s["round"]), flush=True)

    eval_every = args.eval_every or args.inner_steps
    started = time.monotonic()
    print("t 0.0 step 0 acc %.4f" % evaluate(model, x_eval, y_eval), flush=True)
    step = 0
    for step in range(1, args.steps + 1):
        idx = torch.from_numpy(rng.choice(len(x_train), args.batch_size, replace=False))
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        rep = opt.step()
        t = time.monotonic() - started
        if args.solo and step % eval_every == 0:
            print("t %.1f step %d acc %.4f loss %.4f" %
                  (t, step, evaluate(model, x_eval, y_eval), loss.item()), flush=True)
        if rep is not None:
            how = ("averaged with %d" % rep["group_size"]) if rep["averaged"] else \
                  ("alone (%s)%s" % (rep["code"] or rep["error"],
                                     ", caught up with the run" if rep["caught_up"] else ""))
            print("outer %d t %.1f step %d acc %.4f loss %.4f %s in %.2f s" %
                  (rep["round"], t, step, evaluate(model, x_eval, y_eval), loss.item(), how,
                   rep["average_s"]), flush=True)
        if args.time_limit and t > args.time_limit:
            break
    print("test accuracy %.4f on %d images after %d steps in %.1f s" %
          (evaluate(model, x_eval, y_eval), len(y_eval), step, time.monotonic() - started),
          flush=True)
    if client is not None:
        opt.close()
        client.close()


if __name__ == "__main__":
    main()
