#!/usr/bin/python3
"""One Fashion-MNIST trainer of bench/fmnist_modes.sh: the same MLP
(784 -> --hidden -> ReLU -> 10, AdamW, batch --batch-size) trained alone
or in the swarm in one of four ways, printing "t T step S acc A" lines: the
test accuracy of the model on the first --eval-samples test images every
--eval-interval seconds of wall time (the evaluation's own time is not
counted), measured from the first step.

    --mode solo         one process, all 60,000 training images
    --mode periodic     local AdamW every step, the parameters averaged in the
                        background every --average-every steps and applied as
                        a delayed update (hivemindd.Averager; train_fmnist.py's
                        way)
    --mode collab       hivemindd.Optimizer: one AdamW step per swarm epoch of
                        --target-batch-size samples on the sample-weighted mean
                        gradient (--collab-lr, large-batch; --use-local-updates)
    --mode diloco       hivemindd.DiLoCo: --inner-steps AdamW steps, then the
                        outer Nesterov step on the mean pseudo-gradient

In the swarm modes every trainer trains on its own shard (--shard I/N)
from the same initial parameters (--seed).
"""

import argparse
import logging
import os
import sys
import time

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "contrib", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "contrib", "python", "examples"))

from train_fmnist import load  # noqa: E402  (the bounded IDX reader)


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", required=True, choices=["solo", "periodic", "collab", "diloco"])
    ap.add_argument("--socket")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--run-id", default="bench.modes")
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--average-every", type=int, default=50)
    ap.add_argument("--target-batch-size", type=int, default=1024)
    ap.add_argument("--collab-lr", type=float, default=4e-3)
    ap.add_argument("--use-local-updates", action="store_true")
    ap.add_argument("--delay-optimizer-step", action="store_true")
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--compression", default="fp16", choices=["none", "fp16", "8bit"],
                    help="DiLoCo's pseudo-gradient on the wire (default fp16)")
    ap.add_argument("--eval-interval", type=float, default=5.0)
    ap.add_argument("--eval-samples", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")

    torch.set_num_threads(args.threads)
    shard, n_shards = (int(v) for v in args.shard.split("/"))
    x_train, y_train = load(args.data_dir, "train")
    x_test, y_test = load(args.data_dir, "t10k")
    x_train, y_train = x_train[shard::n_shards], y_train[shard::n_shards]
    x_eval, y_eval = x_test[:args.eval_samples], y_test[:args.eval_samples]
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    rng = np.random.default_rng(1000 + shard)

    client = averager = None
    lr = args.collab_lr if args.mode == "collab" and not args.use_local_updates else args.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if args.mode != "solo":
        import hivemindd

        client = hivemindd.Client(args.socket, timeout=120)
    if args.mode == "periodic":
        averager = hivemindd.Averager(client, args.run_id, list(model.parameters()),
                                      target_group_size=args.peers, min_group_size=2,
                                      timeout=5.0)
    elif args.mode == "collab":
        opt = hivemindd.Optimizer(params=list(model.parameters()), optimizer=opt,
                                  run_id=args.run_id, target_batch_size=args.target_batch_size,
                                  batch_size_per_step=args.batch_size, matchmaking_time=5.0,
                                  averaging_timeout=30.0,
                                  average_state_every=1 if args.use_local_updates else 0,
                                  use_local_updates=args.use_local_updates,
                                  delay_optimizer_step=args.delay_optimizer_step,
                                  target_group_size=args.peers, client=client)
    elif args.mode == "diloco":
        opt = hivemindd.DiLoCo(model.parameters(), opt, run_id=args.run_id,
                               inner_steps=args.inner_steps, compression=args.compression,
                               client=client,
                               target_group_size=args.peers, min_group_size=2, timeout=30.0,
                               matchmaking_time=5.0, load_state=False)

    spent_eval = 0.0
    started = time.monotonic()
    next_eval = 0.0
    rounds = fails = 0
    end_s = other_s = 0.0  # time in the optimizer's step: calls that ended an epoch, the rest
    step = 0
    while True:
        t = time.monotonic() - started - spent_eval
        if t >= next_eval:
            e0 = time.monotonic()
            print("t %.1f step %d acc %.4f" % (t, step, evaluate(model, x_eval, y_eval)),
                  flush=True)
            spent_eval += time.monotonic() - e0
            next_eval += args.eval_interval
        if t >= args.time_limit:
            break
        step += 1
        idx = torch.from_numpy(rng.choice(len(x_train), args.batch_size, replace=False))
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        s0 = time.monotonic()
        rep = opt.step()
        took = time.monotonic() - s0
        if args.mode == "collab":
            r = opt.last_report
            if r["epoch_ended"] or r["stepped"] and not args.use_local_updates:
                end_s += took
            else:
                other_s += took
            if r["epoch_ended"]:
                rounds += 1
                fails += r["local_fallback"]
        elif args.mode == "diloco" and rep is not None:
            end_s += took
            rounds += 1
            fails += not rep["averaged"]
        elif averager is not None:
            if averager.running and averager.poll():
                rounds += 1
                try:
                    averager.apply()
                except hivemindd.HivemindError:
                    fails += 1
            if not averager.running and step % args.average_every == 0:
                averager.start(weight=args.batch_size)
    print("done steps %d rounds %d failed %d; in step(): %.1f s in rounds' calls, %.1f s in "
          "the others" % (step, rounds, fails, end_s, other_s), flush=True)
    if args.mode in ("collab", "diloco"):
        opt.close()
    if averager is not None:
        if averager.running:
            try:
                averager.apply()
            except hivemindd.HivemindError:
                pass
        averager.close()
    if client is not None:
        client.close()


if __name__ == "__main__":
    main()
