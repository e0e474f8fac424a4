#!/usr/bin/python3
"""Trains a Fashion-MNIST classifier whose middle layer is a mixture of
experts hosted by the swarm, through the local hivemindd.

    image (784) -> Linear(784, dim) -> GELU -> RemoteMixtureOfExperts(dim)
                   (each sample routed on its own; --routing batch: per batch)
                -> Linear(dim, 10)

The input projection, the gate and the classifier are local; every
--average-every steps they are averaged with the other trainers that run
this script under the same --average-prefix, in the background (the round
runs while training goes on and is applied as a delayed update). The
experts train on their hosts with every backward.

With --collaborative the local parameters are trained by
hivemindd.Optimizer instead (the collaborative optimizer): the trainers of
one --run-id take one Adam step per epoch of --target-batch-size samples
over the swarm, on the sample-weighted mean of their gradients
(--delay-optimizer-step, --use-local-updates, --average-state-every as
the Optimizer's options). --average-every 0 trains alone (local Adam at
every step, nothing averaged).

Start a host and run it, for example:

    hivemindd --listen 127.0.0.1:0 --state-dir /tmp/h --control-socket /tmp/h/ctl.sock \\
        --host-experts 'ffn.[0:4].[0:4]' --expert-dim 64
    hivemindd --listen 127.0.0.1:0 --state-dir /tmp/t --control-socket /tmp/t/ctl.sock \\
        --initial-peers ADDRESS_PRINTED_BY_THE_HOST
    HIVEMIND_LIB=build/lib/.libs/libhivemind.so PYTHONPATH=contrib/python \\
        /usr/bin/python3 contrib/python/examples/train_fmnist.py --socket /tmp/t/ctl.sock

It prints "step N loss L acc A" lines (with --collaborative also
"epoch E ..." lines, one per optimizer step) and, at the end, the accuracy
on the first --eval-samples test images.
"""

import argparse
import gzip
import logging
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hivemindd import (Averager, Client, HivemindError, Optimizer,  # noqa: E402
                       RemoteMixtureOfExperts)

# Larger files than this are not Fashion-MNIST; the cap bounds what we read.
MAX_IDX_BYTES = 64 << 20


def read_idx(path):
    """An IDX file of unsigned bytes (gzip), as a numpy array of its shape."""
    with gzip.open(path, "rb") as f:
        data = f.read(MAX_IDX_BYTES + 1)
    if len(data) > MAX_IDX_BYTES:
        raise ValueError("%s: over %d bytes unpacked" % (path, MAX_IDX_BYTES))
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or not 1 <= data[3] <= 4:
        raise ValueError("%s: not an IDX file of unsigned bytes" % path)
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError("%s: truncated header" % path)
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    count = int(np.prod(shape))
    if len(data) != 4 + 4 * ndim + count:
        raise ValueError("%s: the header announces %d values, the file holds %d" %
                         (path, count, len(data) - 4 - 4 * ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load(data_dir, split):
    images = read_idx(os.path.join(data_dir, "%s-images-idx3-ubyte.gz" % split))
    labels = read_idx(os.path.join(data_dir, "%s-labels-idx1-ubyte.gz" % split))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError("%s: images and labels do not match" % split)
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
    x = (x - 0.2860) / 0.3530  # Fashion-MNIST's mean and standard deviation
    return x, torch.from_numpy(labels.astype(np.int64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="the daemon's control socket (default: its default path)")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--dim", type=int, default=64, help="the experts' dim (--expert-dim)")
    ap.add_argument("--grid", default="4x4", help="the expert grid, G0xG1")
    ap.add_argument("--uid-prefix", default="ffn")
    ap.add_argument("--k-best", type=int, default=4)
    ap.add_argument("--k-min", type=int, default=1)
    ap.add_argument("--routing", choices=("sample", "batch"), default="sample",
                    help="each sample's own beam search (as Hivemind) or one per batch")
    ap.add_argument("--beam-size", type=int, default=0, help="per-sample beam (0: k_best)")
    ap.add_argument("--forward-timeout", type=float, default=10.0)
    ap.add_argument("--backward-timeout", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--average-every", type=int, default=50,
                    help="start a background averaging round every N steps (0: never)")
    ap.add_argument("--average-prefix", default="fmnist.local")
    ap.add_argument("--target-group-size", type=int, default=4)
    ap.add_argument("--average-timeout", type=float, default=15.0)
    ap.add_argument("--collaborative", action="store_true",
                    help="train with hivemindd.Optimizer (one step per swarm epoch)")
    ap.add_argument("--run-id", default="fmnist.collab")
    ap.add_argument("--target-batch-size", type=int, default=1024,
                    help="--collaborative: the swarm's samples per epoch")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--average-state-every", type=int, default=1)
    ap.add_argument("--delay-optimizer-step", action="store_true")
    ap.add_argument("--use-local-updates", action="store_true")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # The optimizer's warnings (a round that fell back to local gradients) on stderr.
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")

    grid = tuple(int(g) for g in args.grid.lower().split("x"))
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    x_train, y_train = load(args.data_dir, "train")
    x_test, y_test = load(args.data_dir, "t10k")

    client = Client(args.socket)
    print("attached to %s" % client.info()["address"], flush=True)
    moe = RemoteMixtureOfExperts(args.dim, grid_size=grid, uid_prefix=args.uid_prefix,
                                 k_best=args.k_best, k_min=args.k_min,
                                 routing=args.routing, beam_size=args.beam_size,
                                 forward_timeout=args.forward_timeout,
                                 backward_timeout=args.backward_timeout, client=client)
    proj = nn.Sequential(nn.Linear(784, args.dim), nn.GELU())
    head = nn.Linear(args.dim, 10)
    model = nn.Sequential(proj, moe, head)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    averager = collab = None
    if args.collaborative:
        collab = opt = Optimizer(params=list(model.parameters()), optimizer=opt,
                                 run_id=args.run_id, target_batch_size=args.target_batch_size,
                                 batch_size_per_step=args.batch_size,
                                 matchmaking_time=args.matchmaking_time,
                                 averaging_timeout=args.averaging_timeout,
                                 average_state_every=args.average_state_every,
                                 delay_optimizer_step=args.delay_optimizer_step,
                                 use_local_updates=args.use_local_updates,
                                 target_group_size=args.target_group_size, client=client)
    elif args.average_every > 0:
        averager = Averager(client, args.average_prefix, list(model.parameters()),
                            target_group_size=args.target_group_size, min_group_size=2,
                            timeout=args.average_timeout)

    loss_sum = acc_sum = 0.0
    seen = 0
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        idx = torch.from_numpy(rng.choice(len(x_train), args.batch_size, replace=False))
        logits = model(x_train[idx])
        loss = nn.functional.cross_entropy(logits, y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if collab is not None:
            rep = collab.last_report
            if rep["epoch_ended"] or rep["caught_up"]:
                how = ("averaged with %d trainers" % rep["group_size"] if rep["averaged"] else
                       "state loaded" if rep["state_loaded"] else
                       "local step" if rep["local_fallback"] else
                       "pending" if rep["pending"] else "")
                print("epoch %d at step %d: %d samples here, %d in the swarm, %s" %
                      (rep["epoch"], step, rep["samples"], rep["swarm_samples"], how), flush=True)
        loss_sum += loss.item()
        acc_sum += (logits.argmax(1) == y_train[idx]).float().mean().item()
        seen += 1

        if averager is not None:
            if averager.running and averager.poll():
                try:
                    rep = averager.apply()
                    print("step %d averaged with %d trainers in %.2f s" %
                          (step, rep["group_size"], rep["duration_s"]), flush=True)
                except HivemindError as e:
                    print("step %d averaging skipped: %s" % (step, e.message), flush=True)
            if not averager.running and step % args.average_every == 0:
                averager.start(weight=args.batch_size)

        if step % args.log_every == 0 or step == args.steps:
            print("step %d loss %.4f acc %.3f experts %s (%.1f s)" %
                  (step, loss_sum / seen, acc_sum / seen,
                   ",".join(e.uid for e in moe.last_experts), time.monotonic() - started),
                  flush=True)
            loss_sum = acc_sum = 0.0
            seen = 0

    if collab is not None:
        collab.close()
    if averager is not None:
        if averager.running:
            try:
                averager.apply()
            except HivemindError as e:
                print("last averaging round skipped: %s" % e.message, flush=True)
        averager.close()

    model.eval()
    correct = 0
    n = min(args.eval_samples, len(x_test))
    with torch.no_grad():
        for at in range(0, n, 256):
            xb, yb = x_test[at:min(n, at + 256)], y_test[at:min(n, at + 256)]
            correct += (model(xb).argmax(1) == yb).sum().item()
    print("test accuracy %.3f on %d images" % (correct / max(n, 1), n), flush=True)
    client.close()


if __name__ == "__main__":
    main()
