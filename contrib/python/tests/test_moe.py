"""RemoteMixtureOfExperts against real expert hosts.

The exactness tests use the grid "ffn" of the test swarm, whose experts
step with a learning rate of 1e-30, so a backward leaves them as they were
and the same call may be made again by hand for reference. The training
test uses the grid "train" (Adam at 0.01).

These are the per-batch routing's tests (routing="batch": one beam search
on the batch-mean scores, every expert gets the whole batch); per-sample
routing, the default, is tested in test_moe_routing.py."""

import copy
import os
import signal
import time
import unittest

import numpy as np
import torch

import swarm
from hivemindd import Client, HivemindError, RemoteMixtureOfExperts

D = swarm.DIM


class MoETest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()
        cls.client = Client(cls.swarm.daemons[0].sock)
        swarm.wait_for_experts(cls.client, "ffn", 4)
        swarm.wait_for_experts(cls.client, "train", 4)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def moe(self, **kw):
        args = dict(grid_size=(2, 2), uid_prefix="ffn", k_best=4, k_min=1, forward_timeout=10.0,
                    timeout_after_k_min=2.0, backward_timeout=10.0, client=self.client,
                    routing="batch")
        args.update(kw)
        return RemoteMixtureOfExperts(D, **args)

    def manual(self, moe, x, gate=None, client=None):
        """The mixture by hand: per-expert outputs from experts_forward,
        weights from the gate's per-sample coordinate scores."""
        experts = moe.last_experts
        client = client if client is not None else self.client
        y, answered = client.experts_forward(experts, x.detach().numpy())
        self.assertTrue(all(answered))
        y = torch.from_numpy(y)
        g = gate(x) if gate is not None else moe.gate(x)
        logits = torch.stack([g[:, i] + g[:, 2 + j] for i, j in
                              (map(int, e.uid.split(".")[1:]) for e in experts)], dim=1)
        return experts, y, logits

    def test_forward_matches_manual_mixture(self):
        torch.manual_seed(0)
        moe = self.moe()
        x = torch.randn(6, D)
        out = moe(x)
        self.assertEqual(out.shape, (6, D))
        self.assertEqual(len(moe.last_experts), 4)
        self.assertEqual(sorted(e.uid for e in moe.last_experts),
                         ["ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"])
        experts, y, logits = self.manual(moe, x)
        w = torch.softmax(logits, dim=1)
        want = torch.einsum("be,ebd->bd", w, y)
        self.assertLessEqual((out - want).abs().max().item(), 1e-5)
        torch.testing.assert_close(moe.last_scores, logits.detach())
        # The experts are not the identity: the layer does something.
        self.assertGreater((out - x).abs().max().item(), 1e-3)
        # Leading dimensions are kept.
        out3 = moe(x.reshape(2, 3, D))
        self.assertEqual(out3.shape, (2, 3, D))
        self.assertLessEqual((out3.reshape(6, D) - want).abs().max().item(), 1e-5)

    def test_backward_gradients(self):
        torch.manual_seed(1)
        moe = self.moe()
        x = torch.randn(5, D, requires_grad=True)
        out = moe(x)
        g = torch.randn(5, D)
        (out * g).sum().backward()

        gw = moe.gate.weight.grad
        self.assertIsNotNone(gw)
        self.assertGreater(gw.abs().sum().item(), 0.0)
        self.assertGreater(moe.gate.bias.grad.abs().sum().item(), 0.0)

        # Reference: the gate's path with the experts' outputs as constants,
        # plus each expert's dL/dx for grad_output * w_e, asked by hand.
        xr = x.detach().clone().requires_grad_(True)
        gate = copy.deepcopy(moe.gate)
        gate.zero_grad()
        experts, y, logits = self.manual(moe, xr, gate)
        w = torch.softmax(logits, dim=1)
        (torch.einsum("be,ebd->bd", w, y) * g).sum().backward()
        gate_path = xr.grad
        gy = (w.detach().t()[:, :, None] * g[None]).numpy()  # [E, batch, D]
        gx, answered = self.client.experts_backward(experts, x.detach().numpy(), gy)
        self.assertTrue(all(answered))
        want = gate_path + torch.from_numpy(gx.sum(0))
        self.assertLessEqual((x.grad - want).abs().max().item(), 1e-5)
        # Both parts matter: the experts' part is not negligible.
        self.assertGreater(np.abs(gx.sum(0)).max(), 1e-3)
        # The gate's gradients equal the reference's too.
        self.assertLessEqual((gate.weight.grad - gw).abs().max().item(), 1e-5)
        self.assertLessEqual((gate.bias.grad - moe.gate.bias.grad).abs().max().item(), 1e-5)

    def backward_requests(self, daemon):
        with Client(daemon.sock) as c:
            return sum(e["backward_requests"] for e in c.request("experts.list")["hosted"])

    def test_experts_learn_without_input_grad(self):
        """A first layer (x needs no gradient) still calls backward on its
        experts, so they learn, and trains its gate."""
        moe = self.moe()
        x = torch.randn(4, D)
        before = self.backward_requests(self.swarm.daemons[1])
        moe(x).sum().backward()
        self.assertIsNotNone(moe.gate.weight.grad)
        self.assertIsNone(x.grad)
        self.assertEqual(self.backward_requests(self.swarm.daemons[1]), before + 4)
        # Without autograd, no backward reaches the hosts.
        with torch.no_grad():
            moe(x)
        self.assertEqual(self.backward_requests(self.swarm.daemons[1]), before + 4)

    def test_silent_experts_are_left_out(self):
        """Of the grid "mix", d0 hosts mix.0.* and d1 mix.1.*; a trainer on
        d2 calls them. With d1 stopped the mixture is made of d0's experts
        alone, and k_min above what answers raises."""
        d0, d1, d2 = self.swarm.daemons
        trainer = Client(d2.sock)
        self.addCleanup(trainer.close)
        for d, row in ((d0, 0), (d1, 1)):
            with Client(d.sock) as c:
                c.request("experts.host", pattern="mix.%d.[0:2]" % row, dim=D,
                          optimizer="sgd", lr=1e-30)
        swarm.wait_for_experts(trainer, "mix", 4)
        torch.manual_seed(2)
        moe = self.moe(uid_prefix="mix", cache_ttl=600.0, forward_timeout=4.0,
                       timeout_after_k_min=0.5, client=trainer)
        x = torch.randn(3, D)
        self.assertEqual(len(moe(x)), 3)
        self.assertEqual(len(moe.last_experts), 4)
        os.kill(d1.proc.pid, signal.SIGSTOP)
        try:
            out = moe(x)  # the same batch: the cached search, d1 silent
            self.assertEqual(sorted(e.uid for e in moe.last_experts), ["mix.0.0", "mix.0.1"])
            self.assertIsNone(moe._cache, "a silent expert drops the cached search")
            experts, y, logits = self.manual(moe, x, client=trainer)
            want = torch.einsum("be,ebd->bd", torch.softmax(logits, dim=1), y)
            self.assertLessEqual((out - want).abs().max().item(), 1e-5)
            moe.k_min = 3
            moe._cache = None
            with self.assertRaises(HivemindError) as cm:
                moe(x)
            self.assertEqual(cm.exception.code, "timeout")
        finally:
            os.kill(d1.proc.pid, signal.SIGCONT)

    def test_server_refusal_reaches_the_caller(self):
        """A call of the wrong width raises the expert's own reason and
        code at once, not a timeout (the timeout here is 30 s)."""
        experts = self.client.find_experts("ffn", [[0.0, 0.0], [0.0, 0.0]], 1, 5.0)
        self.assertEqual(len(experts), 1)
        t0 = time.monotonic()
        with self.assertRaises(HivemindError) as cm:
            self.client.experts_forward(experts, np.zeros((2, D // 2), np.float32), timeout=30.0)
        self.assertLess(time.monotonic() - t0, 10.0)
        self.assertEqual(cm.exception.code, "expert_wrong_shape")
        self.assertIn("takes inputs of width %d, not %d" % (D, D // 2), str(cm.exception))

    def test_not_enough_experts(self):
        moe = self.moe(uid_prefix="nobody", k_min=1, find_timeout=2.0)
        with self.assertRaises(HivemindError) as cm:
            moe(torch.randn(2, D))
        self.assertEqual(cm.exception.code, "not_enough_experts")
        # Per sample too; with zero outputs allowed the layer gives zeros instead.
        moe = self.moe(uid_prefix="nobody", k_min=1, find_timeout=2.0, routing="sample")
        with self.assertRaises(HivemindError) as cm:
            moe(torch.randn(2, D))
        self.assertEqual(cm.exception.code, "not_enough_experts")
        moe = self.moe(uid_prefix="nobody", k_min=0, backward_k_min=0, find_timeout=2.0,
                       routing="sample", allow_zero_outputs=True)
        self.assertEqual(moe(torch.randn(2, D)).abs().max().item(), 0.0)
        with self.assertRaises(ValueError):
            self.moe()(torch.randn(2, D + 1))

    def test_cache(self):
        moe = self.moe(cache_ttl=60.0)
        x = torch.randn(3, D)
        moe(x)
        cached = moe._cache
        self.assertIsNotNone(cached)
        moe(x)
        self.assertIs(moe._cache, cached, "the same batch reuses the beam search")
        moe.forget_experts()
        moe(x)
        self.assertIsNot(moe._cache, cached)

    def test_training_reduces_loss(self):
        for routing in ("batch", "sample"):
            with self.subTest(routing=routing):
                self.train_once(routing)

    def train_once(self, routing):
        torch.manual_seed(5)
        rng = np.random.default_rng(5)
        n_in = 8
        teacher = torch.from_numpy(rng.standard_normal((n_in, 1)).astype(np.float32))
        X = torch.from_numpy(rng.standard_normal((256, n_in)).astype(np.float32))
        Y = torch.tanh(X @ teacher) + 0.5 * torch.sin(X[:, :1] * 2)
        moe = self.moe(uid_prefix="train", k_best=2, routing=routing)
        model = torch.nn.Sequential(torch.nn.Linear(n_in, D), moe, torch.nn.Linear(D, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for step in range(30):
            idx = torch.from_numpy(rng.choice(256, 32, replace=False))
            loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        first, last = np.mean(losses[:5]), np.mean(losses[-5:])
        self.assertLess(last, 0.7 * first, "loss went from %.4f to %.4f" % (first, last))


if __name__ == "__main__":
    unittest.main()
