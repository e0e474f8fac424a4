"""Per-sample routing and Switch layers against real expert hosts.

The grid "route.[0:3].[0:3]" (d1 hosts rows 0 and 1, d2 row 2) steps with
SGD at a learning rate of 1e-30, so its experts stay as they are; their
weights are read back from the hosts' checkpoints (written every second)
to compute the same mixture locally in torch. The grid "sw.[0:2].[0:2]"
(d1 row 0, d2 row 1, Adam at 0.01) is for training a Switch layer with one
host stopped.

The exact tests route from d0, which never sees a host stopped (a stalled
host is backed off and ranked last, moe/client.h); the tests that stop d2
route from d1."""

import copy
import glob
import os
import signal
import struct
import time
import unittest

import numpy as np
import torch

import swarm
from hivemindd import (Client, HivemindError, RemoteMixtureOfExperts,
                       RemoteSwitchMixtureOfExperts, SharedBuffer)

D = swarm.DIM
G = (3, 3)


def wait_grid(client, prefix, grid, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    found = []
    while time.monotonic() < deadline:
        try:
            found = client.find_experts(prefix, [[0.0] * g for g in grid], want, timeout=5.0)
        except Exception:
            found = []
        if len(found) >= want:
            return found
        time.sleep(0.3)
    raise AssertionError("found %d of %d experts under %r" % (len(found), want, prefix))


def read_params(path):
    """The flat parameter vector of an ffn checkpoint: the checkpoint
    header (48 bytes, moe/checkpoint.h), then the expert's msgpack state
    map, whose "params" entry is a bin of float32 (moe/ffn.c)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"HMCK", path
    body = data[48:]
    at = body.index(b"\xa6params") + 7
    tag = body[at]
    if tag == 0xC6:
        n, at = struct.unpack(">I", body[at + 1:at + 5])[0], at + 5
    elif tag == 0xC5:
        n, at = struct.unpack(">H", body[at + 1:at + 3])[0], at + 3
    else:
        raise AssertionError("params is not a bin in %s" % path)
    return np.frombuffer(body[at:at + n], dtype="<f4").astype(np.float64)


class LocalFFN:
    """hivemindd's ffn expert in torch (moe/ffn.h):
    y = x + W2 gelu_tanh(W1 LN(x) + b1) + b2, in float64."""

    def __init__(self, params, dim):
        h = (params.size - 3 * dim) // (2 * dim + 1)
        assert 3 * dim + 2 * h * dim + h == params.size
        p = torch.from_numpy(params)
        at = 0

        def take(n):
            nonlocal at
            t = p[at:at + n]
            at += n
            return t

        self.gamma, self.beta = take(dim), take(dim)
        self.W1 = take(h * dim).view(h, dim)
        self.b1 = take(h)
        self.W2 = take(dim * h).view(dim, h)
        self.b2 = take(dim)
        self.dim = dim

    def __call__(self, x):
        ln = torch.nn.functional.layer_norm(x, (self.dim,), self.gamma, self.beta, 1e-5)
        hid = torch.nn.functional.gelu(ln @ self.W1.t() + self.b1, approximate="tanh")
        return x + hid @ self.W2.t() + self.b2


class RoutingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()
        d0, d1, d2 = cls.swarm.daemons
        for d, pat in ((d1, "route.[0:2].[0:3]"), (d2, "route.2.[0:3]")):
            with Client(d.sock) as c:
                c.request("experts.host", pattern=pat, dim=D, optimizer="sgd", lr=1e-30)
        cls.client = Client(d0.sock)
        cls.trainer1 = Client(d1.sock)
        wait_grid(cls.client, "route", G, 9)
        wait_grid(cls.trainer1, "route", G, 9)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.trainer1.close()

    def moe(self, **kw):
        args = dict(grid_size=G, uid_prefix="route", k_best=3, beam_size=3, k_min=1,
                    forward_timeout=10.0, timeout_after_k_min=2.0, backward_timeout=10.0,
                    client=self.client)
        args.update(kw)
        return RemoteMixtureOfExperts(D, **args)

    @staticmethod
    def brute_top(scores, k):
        """Every sample's top k of the 3 x 3 grid by summed coordinate scores."""
        s = scores.detach().float().numpy()
        out = []
        for row in s:
            cells = [(row[i] + row[3 + j], "route.%d.%d" % (i, j))
                     for i in range(3) for j in range(3)]
            cells.sort(key=lambda c: (-c[0], c[1]))
            out.append([u for _, u in cells[:k]])
        return out

    def local_experts(self, uids):
        """The experts' own weights, from their hosts' checkpoints."""
        d1, d2 = self.swarm.daemons[1:]
        experts = {}
        deadline = time.monotonic() + 20
        for uid in uids:
            d = d2 if uid.startswith("route.2.") else d1
            path = os.path.join(d.dir, "experts", uid + ".ckpt")
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.assertTrue(os.path.exists(path), "no checkpoint %s (%s)" % (
                path, glob.glob(os.path.join(d.dir, "experts", "*"))))
            experts[uid] = LocalFFN(read_params(path), D)
        return experts

    def forward_requests(self):
        n = {}
        for d in self.swarm.daemons[1:]:
            with Client(d.sock) as c:
                for e in c.request("experts.list", prefix="route")["hosted"]:
                    n[e["uid"]] = e["forward_requests"]
        return n

    def test_routes_are_each_samples_brute_force_top_k(self):
        torch.manual_seed(10)
        moe = self.moe()
        x = torch.randn(24, D)
        scores = moe.gate(x)
        experts, routes = moe.route(scores)
        want = self.brute_top(scores, 3)
        got = [[experts[r].uid for r in row] for row in routes]
        self.assertEqual(got, want)
        # Samples want different experts: this is not the per-batch choice.
        self.assertGreater(len(experts), 3)
        self.assertGreater(len({tuple(r) for r in want}), 1)
        # k_best 1 with a beam of 1 is each sample's best row, then its best column.
        experts1, routes1 = self.moe(k_best=1, beam_size=1).route(scores)
        self.assertEqual([[experts1[r].uid for r in row] for row in routes1],
                         self.brute_top(scores, 1))

    def test_forward_and_backward_equal_the_local_mixture(self):
        torch.manual_seed(11)
        moe = self.moe()
        x = torch.randn(12, D, requires_grad=True)
        g = torch.randn(12, D)
        before = self.forward_requests()
        out = moe(x)
        after = self.forward_requests()
        (out * g).sum().backward()
        uids = [e.uid for e in moe.last_experts]
        self.assertTrue(moe.last_mask.all(), "every expert answered")
        # The rows were grouped by expert: one request each.
        for uid in set(after) | set(before):
            self.assertEqual(after[uid] - before.get(uid, 0), 1 if uid in uids else 0, uid)

        # The same layer computed here: the gate, each sample's brute-force
        # top 3, the experts' own weights, autograd for every gradient.
        gate = copy.deepcopy(moe.gate).double()
        gate.zero_grad()
        xr = x.detach().double().clone().requires_grad_(True)
        scores = gate(xr)
        top = self.brute_top(scores, 3)
        self.assertEqual([[uids[r] for r in row] for row in moe.last_routes], top)
        local = self.local_experts({u for row in top for u in row})
        rows = []
        for b, row in enumerate(top):
            ys = torch.stack([local[u](xr[b]) for u in row])                       # [3, D]
            lg = torch.stack([scores[b, int(u.split(".")[1])] +
                              scores[b, 3 + int(u.split(".")[2])] for u in row])  # [3]
            rows.append((torch.softmax(lg, 0)[:, None] * ys).sum(0))
        want = torch.stack(rows)
        (want * g.double()).sum().backward()

        self.assertLessEqual((out.double() - want).abs().max().item(), 1e-5)
        self.assertLessEqual((x.grad.double() - xr.grad).abs().max().item(), 1e-5)
        self.assertLessEqual((moe.gate.weight.grad.double() - gate.weight.grad).abs().max().item(),
                             1e-5)
        self.assertLessEqual((moe.gate.bias.grad.double() - gate.bias.grad).abs().max().item(),
                             1e-5)
        # The experts' part of dL/dx matters, and so does the gate's.
        self.assertGreater(gate.weight.grad.abs().max().item(), 1e-3)

    def test_daemon_checks_routed_arguments(self):
        """A route index out of range, k_min 0 without allow_zero_outputs and
        slots without routes are refused with bad_args, before any call."""
        experts, routes = self.moe().route(torch.randn(2, 6))
        B, K = routes.shape
        with SharedBuffer(self.client, 4 * B * K * D + 4 * B * D + 4 * B * K) as buf:
            x = {"shm": buf.id, "offset": 0, "elems": B * D}
            y = {"shm": buf.id, "offset": 4 * B * D, "elems": B * K * D}
            rt = {"shm": buf.id, "offset": 4 * B * D + 4 * B * K * D, "elems": B * K}
            view = buf.numpy(np.int32, B * K, 4 * B * D + 4 * B * K * D)
            ex = [{"uid": e.uid, "peer": e.peer} for e in experts]
            base = dict(experts=ex, x=x, y=y, routes=rt, slots=K, batch=B, dim=D)
            view[:] = routes.ravel()
            view[0] = len(experts)
            with self.assertRaises(HivemindError) as cm:
                self.client.request("experts.forward", **base)
            self.assertEqual(cm.exception.code, "bad_args")
            self.assertIn("args.routes", cm.exception.message)
            view[:] = routes.ravel()
            with self.assertRaises(HivemindError) as cm:
                self.client.request("experts.forward", k_min=0, **base)
            self.assertEqual(cm.exception.code, "bad_args")
            r = self.client.request("experts.forward", k_min=0, allow_zero_outputs=True, **base)
            self.assertEqual(len(r["answered"]), len(experts))
            del base["routes"]
            with self.assertRaises(HivemindError) as cm:
                self.client.request("experts.forward", **base)
            self.assertEqual(cm.exception.code, "bad_args")

    def test_backward_goes_only_to_experts_that_answered(self):
        """d2 (route.2.*) stopped: k_min 1 per sample still holds, route.2.*
        slots are left out of the mixture and of the backward."""
        d2 = self.swarm.daemons[2]
        torch.manual_seed(12)
        moe = self.moe(forward_timeout=4.0, timeout_after_k_min=0.5, backward_timeout=4.0,
                       client=self.trainer1)
        x = torch.randn(10, D, requires_grad=True)
        with torch.no_grad():
            moe.gate.bias[3 + 2] += 3.0  # column 2 first: each sample has one on d2
        os.kill(d2.proc.pid, signal.SIGSTOP)
        try:
            out = moe(x)
            uids = [e.uid for e in moe.last_experts]
            mask = moe.last_mask
            self.assertTrue(any(u.startswith("route.2.") for u in uids))
            for b, row in enumerate(moe.last_routes):
                for j, r in enumerate(row):
                    self.assertEqual(bool(mask[b, j]), not uids[r].startswith("route.2."))
            out.sum().backward()
            self.assertTrue(np.isfinite(x.grad.numpy()).all())
        finally:
            os.kill(d2.proc.pid, signal.SIGCONT)


class SwitchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()
        d0, d1, d2 = cls.swarm.daemons
        for d, pat in ((d1, "route.[0:2].[0:3]"), (d2, "route.2.[0:3]"),
                       (d1, "sw.0.[0:2]"), (d2, "sw.1.[0:2]")):
            with Client(d.sock) as c:
                c.request("experts.host", pattern=pat, dim=D,
                          optimizer="adam" if pat.startswith("sw") else "sgd",
                          lr=0.01 if pat.startswith("sw") else 1e-30)
        cls.client = Client(d0.sock)
        cls.trainer1 = Client(d1.sock)
        wait_grid(cls.client, "route", G, 9)
        wait_grid(cls.trainer1, "sw", (2, 2), 4)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.trainer1.close()

    def test_balancing_loss_moves_the_gate(self):
        torch.manual_seed(20)
        sw = RemoteSwitchMixtureOfExperts(D, grid_size=G, uid_prefix="route", beam_size=3,
                                          jitter_eps=0.0, client=self.client)
        with torch.no_grad():
            sw.gate.bias[0] += 4.0
            sw.gate.bias[3] += 4.0  # nearly every sample to route.0.0
        x = torch.randn(32, D)
        out, loss = sw(x)
        self.assertEqual(out.shape, (32, D))
        # The loss as defined: n_experts * sum_e f_e * P_e.
        scores = sw.gate(x).detach()
        p = torch.softmax(scores[:, :3], 1)[:, :, None] * torch.softmax(scores[:, 3:], 1)[:, None]
        first = sw.last_routes[:, 0]
        f = torch.zeros(3, 3, dtype=p.dtype)
        for r in first:
            i, j = map(int, sw.last_experts[r].uid.split(".")[1:])
            f[i, j] += 1.0 / len(first)
        self.assertAlmostEqual(loss.item(), 9 * (f * p.mean(0)).sum().item(), places=5)
        self.assertGreater(loss.item(), 3.0, "the routing is concentrated")
        loss.backward()
        self.assertGreater(sw.gate.weight.grad.abs().sum().item(), 0.0)
        self.assertGreater(sw.gate.bias.grad.abs().sum().item(), 0.0)

        opt = torch.optim.Adam(sw.gate.parameters(), lr=0.1)
        losses = []
        for _ in range(25):
            _, loss = sw(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        self.assertLess(losses[-1], 0.6 * losses[0], "balancing loss %s" % losses)

    def test_jitter_only_in_training(self):
        sw = RemoteSwitchMixtureOfExperts(D, grid_size=G, uid_prefix="route", jitter_eps=0.1,
                                          client=self.client)
        x = torch.randn(8, D)
        a, b = sw._gate_scores(x), sw._gate_scores(x)
        self.assertGreater((a - b).abs().max().item(), 0.0)
        sw.eval()
        torch.testing.assert_close(sw._gate_scores(x), sw.gate(x))

    def test_trains_with_one_host_dead(self):
        d2 = self.swarm.daemons[2]
        torch.manual_seed(21)
        rng = np.random.default_rng(21)
        n_in = 8
        teacher = torch.from_numpy(rng.standard_normal((n_in, 1)).astype(np.float32))
        X = torch.from_numpy(rng.standard_normal((256, n_in)).astype(np.float32))
        Y = torch.tanh(X @ teacher) + 0.5 * torch.sin(X[:, :1] * 2)
        sw = RemoteSwitchMixtureOfExperts(D, grid_size=(2, 2), uid_prefix="sw", beam_size=2,
                                          forward_timeout=3.0, timeout_after_k_min=0.5,
                                          backward_timeout=3.0, client=self.trainer1)
        inp, head = torch.nn.Linear(n_in, D), torch.nn.Linear(D, 1)
        params = list(inp.parameters()) + list(head.parameters()) + list(sw.parameters())
        opt = torch.optim.Adam(params, lr=0.01)

        os.kill(d2.proc.pid, signal.SIGSTOP)
        try:
            # The first batch: samples routed to d2's experts get zeros.
            with torch.no_grad():
                h = inp(X[:32])
                out, _ = sw(h)
            uids = [e.uid for e in sw.last_experts]
            dead = np.array([uids[r].startswith("sw.1.") for r in sw.last_routes[:, 0]])
            # (Once d2 is backed off, only samples whose two best experts
            # both sit on d2 still go there; the others go to d1.)
            self.assertTrue(dead.any(), "no sample was routed to the stopped host")
            self.assertFalse(dead.all(), "every sample was routed to the stopped host")
            self.assertEqual(out[torch.from_numpy(dead)].abs().max().item(), 0.0)
            self.assertGreater(out[torch.from_numpy(~dead)].abs().max().item(), 0.0)

            losses = []
            t0 = time.monotonic()
            for step in range(30):
                idx = torch.from_numpy(rng.choice(256, 32, replace=False))
                h = inp(X[idx])
                y, aux = sw(h)
                loss = torch.nn.functional.mse_loss(head(h + y), Y[idx])
                opt.zero_grad()
                (loss + 0.01 * aux).backward()
                opt.step()
                losses.append(loss.item())
            took = time.monotonic() - t0
        finally:
            os.kill(d2.proc.pid, signal.SIGCONT)
        first, last = np.mean(losses[:5]), np.mean(losses[-5:])
        self.assertLess(last, 0.7 * first, "loss went from %.4f to %.4f" % (first, last))
        print("switch with one host stopped: 30 steps in %.1f s" % took)


if __name__ == "__main__":
    unittest.main()
