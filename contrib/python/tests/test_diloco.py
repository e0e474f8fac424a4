"""DiLoCo between daemons of the test swarm: two trainers (threads, one
per daemon) train the same torch model with their own inner SGD on
different data for H = 3 steps a round, two rounds; after each outer step
every trainer's parameters equal a reference computed with
torch.optim.SGD(nesterov=True, lr 0.7, momentum 0.9) on the mean of the
two pseudo-gradients, which the inner optimizer recorded. Then a newcomer
on the third daemon loads the outer state (round 2) and holds the outer
parameters. A trainer alone misses its round and applies its own
pseudo-gradient. An 8-bit round lands within its quantization error of
the reference, nearer to the mean than to the trainer's own update."""

import threading
import unittest

import torch

import swarm
from hivemindd import Client, DiLoCo

H = 3
ROUNDS = 2


class Recording(torch.optim.SGD):
    """Inner SGD that keeps a flat copy of the parameters after each step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.after = []

    def step(self, closure=None):
        super().step(closure)
        with torch.no_grad():
            self.after.append(torch.cat([p.detach().reshape(-1).clone()
                                         for g in self.param_groups for p in g["params"]]))


def model():
    torch.manual_seed(5)  # every trainer starts from the same parameters
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def run_all(fns):
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
        t.join(180)
    for e in errors:
        if e is not None:
            raise e
    return results


class DiLoCoTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()

    def setUp(self):
        self.clients = [Client(s) for s in self.swarm.sockets]
        for c in self.clients:
            self.addCleanup(c.close)

    def test_outer_step_matches_torch_and_newcomer_loads(self):
        models = [model() for _ in range(2)]
        start = flat(models[0]).clone()
        inners = [Recording(m.parameters(), lr=0.05) for m in models]
        opts = [DiLoCo(m.parameters(), inner, run_id="pyd", inner_steps=H, client=c,
                       target_group_size=2, min_group_size=2, timeout=60, matchmaking_time=10,
                       load_state=False)
                for m, inner, c in zip(models, inners, self.clients[:2])]
        gens = [torch.Generator().manual_seed(100 + i) for i in range(2)]

        def trainer(i):
            m, opt = models[i], opts[i]
            reports, after = [], []
            for step in range(H * ROUNDS):
                x = torch.randn(16, 6, generator=gens[i])
                y = torch.randint(0, 3, (16,), generator=gens[i])
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                rep = opt.step()
                self.assertEqual(rep is not None, (step + 1) % H == 0)
                if rep is not None:
                    reports.append(rep)
                    after.append(flat(m).clone())
            return reports, after

        results = run_all([lambda i=i: trainer(i) for i in range(2)])

        ref = torch.nn.Parameter(start.clone())
        outer_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
        for r in range(ROUNDS):
            pgs = [ref.detach() - inners[i].after[r * H + H - 1] for i in range(2)]
            ref.grad = (pgs[0].double() + pgs[1].double()).div(2).float()
            outer_opt.step()
            for i in range(2):
                rep = results[i][0][r]
                self.assertEqual(rep["round"], r)
                self.assertTrue(rep["averaged"], rep)
                self.assertEqual(rep["group_size"], 2)
                diff = (results[i][1][r] - ref.detach()).abs().max().item()
                self.assertLessEqual(diff, 1e-6, "trainer %d round %d" % (i, r))
        for o in opts:
            self.assertEqual(o.outer_round, ROUNDS)
            self.assertEqual(o.local_step, 0)

        newcomer = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 3))
        late = DiLoCo(newcomer.parameters(), torch.optim.SGD(newcomer.parameters(), lr=0.05),
                      run_id="pyd", inner_steps=H, client=self.clients[2])
        self.assertTrue(late.start_report["loaded"], late.start_report)
        self.assertEqual(late.outer_round, ROUNDS)
        self.assertTrue(torch.equal(flat(newcomer), flat(models[0])))
        outer0, mom0 = opts[0].outer_state()
        outer1, mom1 = late.outer_state()
        self.assertTrue((outer0 == outer1).all() and (mom0 == mom1).all())
        for o in opts + [late]:
            o.close()

    def test_compressed_round(self):
        # 8-bit wire form: the outer step is the reference's up to the
        # quantization of the pseudo-gradients (and of the mean sent back).
        models = [model() for _ in range(2)]
        start = flat(models[0]).clone()
        inners = [Recording(m.parameters(), lr=0.05) for m in models]
        opts = [DiLoCo(m.parameters(), inner, run_id="pyd8", inner_steps=1, client=c,
                       compression="8bit", target_group_size=2, min_group_size=2, timeout=60,
                       matchmaking_time=10, load_state=False)
                for m, inner, c in zip(models, inners, self.clients[:2])]

        def trainer(i):
            x = torch.randn(16, 6, generator=torch.Generator().manual_seed(7 + i))
            opts[i].zero_grad()
            models[i](x).pow(2).sum().backward()
            return opts[i].step()

        reports = run_all([lambda i=i: trainer(i) for i in range(2)])
        pgs = [start - inners[i].after[0] for i in range(2)]
        g = (pgs[0] + pgs[1]) / 2
        want = start - 0.7 * (g + 0.9 * g)  # the first Nesterov step: lr (1 + m) g
        scale = max(p.abs().max().item() for p in pgs)
        for i in range(2):
            self.assertTrue(reports[i]["averaged"], reports[i])
            err = (flat(models[i]) - want).abs().max().item()
            # lr (1 + m) = 1.33 times a quantization error of at most 1/127 of the
            # range, twice over (the parts sent, the mean sent back), doubled for margin.
            self.assertLessEqual(err, 1.33 * 2 * 2 * scale / 127 + 1e-6)
            own = start - 1.33 * pgs[i]
            self.assertGreater((flat(models[i]) - own).abs().max().item(), err,
                               "the average is no nearer to the mean than to our own")
        for o in opts:
            o.close()

    def test_missed_round_applies_own(self):
        m = model()
        start = flat(m).clone()
        inner = Recording(m.parameters(), lr=0.1)
        opt = DiLoCo(m.parameters(), inner, run_id="pyalone", inner_steps=1, client=self.clients[0],
                     min_group_size=2, target_group_size=2, timeout=1.0, matchmaking_time=0.5,
                     load_timeout=2.0, outer_lr=0.5, outer_momentum=0.8)
        self.assertFalse(opt.start_report["loaded"])
        opt.zero_grad()
        m(torch.ones(2, 6)).sum().backward()
        rep = opt.step()
        self.assertFalse(rep["averaged"])
        self.assertEqual(rep["code"], "no_group")
        self.assertFalse(rep["caught_up"])
        ref = torch.nn.Parameter(start.clone())
        o = torch.optim.SGD([ref], lr=0.5, momentum=0.8, nesterov=True)
        ref.grad = start - inner.after[0]
        o.step()
        self.assertLessEqual((flat(m) - ref.detach()).abs().max().item(), 1e-6)
        self.assertEqual(opt.outer_round, 1)
        opt.close()


if __name__ == "__main__":
    unittest.main()
