"""Averager between the three daemons of the test swarm: three trainers,
one per daemon, each in its own thread as separate processes would be.
Synchronous rounds give every trainer the exact weighted mean of the
parameters (numpy and torch, float32 and float64); background rounds keep
the local progress made during the round (param = mean + progress)."""

import threading
import unittest

import numpy as np
import torch

import swarm
from hivemindd import Averager, Client, HivemindError

OPTS = dict(target_group_size=3, min_group_size=3, timeout=30.0, matchmaking_time=5.0)


def run_all(fns):
    """Runs each fn in a thread; returns their results, re-raising a failure."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def go(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # handed to the main thread
            errors[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for e in errors:
        if e is not None:
            raise e
    return results


class AveragerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()

    def setUp(self):
        self.clients = [Client(s) for s in self.swarm.sockets]
        for c in self.clients:
            self.addCleanup(c.close)

    def test_numpy_exact_weighted_mean(self):
        rng = np.random.default_rng(7)
        params = [[rng.standard_normal((3, 4)).astype(np.float32),
                   rng.standard_normal(5).astype(np.float64)] for _ in range(3)]
        weights = [1.0, 2.0, 3.0]
        want = [sum(w * p[j].astype(np.float64) for w, p in zip(weights, params)) / sum(weights)
                for j in range(2)]
        avgs = [Averager(c, "pytest.np", p, **OPTS) for c, p in zip(self.clients, params)]
        reports = run_all([lambda a=a, w=w: a.step(w) for a, w in zip(avgs, weights)])
        for rep in reports:
            self.assertEqual(rep["group_size"], 3)
            self.assertEqual(rep["elements"], 17)
        for p in params:
            self.assertEqual(p[0].dtype, np.float32)
            self.assertEqual(p[1].dtype, np.float64)
            for j in range(2):
                np.testing.assert_allclose(p[j], want[j], rtol=0, atol=1e-6)
        for a in avgs:
            a.close()

    def test_torch_exact_mean(self):
        torch.manual_seed(3)
        models = [torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
                  for _ in range(3)]
        want = [torch.stack([list(m.parameters())[j].detach() for m in models]).mean(0)
                for j in range(4)]
        avgs = [Averager(c, "pytest.torch", m.parameters(), **OPTS)
                for c, m in zip(self.clients, models)]
        run_all([a.step for a in avgs])
        for m in models:
            for p, w in zip(m.parameters(), want):
                self.assertTrue(p.requires_grad)
                self.assertLessEqual((p.detach() - w).abs().max().item(), 1e-6)
        for a in avgs:
            a.close()

    def test_background_delayed_update(self):
        rng = np.random.default_rng(11)
        start = [torch.from_numpy(rng.standard_normal(40).astype(np.float32)) for _ in range(3)]
        params = [s.clone() for s in start]
        progress = [torch.full((40,), float(i + 1)) for i in range(3)]
        mean = torch.stack(start).mean(0)
        avgs = [Averager(c, "pytest.bg", [p], **OPTS) for c, p in zip(self.clients, params)]

        def trainer(i):
            a = avgs[i]
            self.assertFalse(a.poll())
            a.start()
            self.assertTrue(a.running)
            with self.assertRaises(RuntimeError):
                a.step()
            # Training goes on while the swarm averages.
            params[i].add_(progress[i])
            while not a.poll():
                threading.Event().wait(0.05)
            rep = a.apply()
            self.assertFalse(a.running)
            return rep

        reports = run_all([lambda i=i: trainer(i) for i in range(3)])
        for rep in reports:
            self.assertEqual(rep["group_size"], 3)
        for p, g in zip(params, progress):
            self.assertLessEqual((p - (mean + g)).abs().max().item(), 1e-5)
        for a in avgs:
            a.close()

    def test_failed_round_leaves_params(self):
        p = np.arange(8, dtype=np.float32)
        a = Averager(self.clients[0], "pytest.alone", [p], target_group_size=2,
                     min_group_size=2, timeout=1.0, matchmaking_time=0.5)
        with self.assertRaises(HivemindError) as cm:
            a.step()
        self.assertEqual(cm.exception.code, "no_group")
        np.testing.assert_array_equal(p, np.arange(8, dtype=np.float32))
        a.start()
        with self.assertRaises(HivemindError):
            a.apply()
        np.testing.assert_array_equal(p, np.arange(8, dtype=np.float32))
        a.close()


if __name__ == "__main__":
    unittest.main()
