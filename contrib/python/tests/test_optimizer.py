"""hivemindd.Optimizer between the daemons of the test swarm, trainers as
threads (one per daemon) or, for the one that is SIGKILLed, a process.

Each trainer's gradients are known (a vector of its own, written to
.grad directly) and its batch size differs, so that the tests can check
that an epoch ends only once the trainers' summed samples reach the
target, that the step uses the sample-weighted mean of the gradients,
that a dead trainer holds the others up no longer than the round's
timeouts, that a late trainer loads the swarm's state, and that
delay_optimizer_step and use_local_updates do what they say.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import torch

import swarm
from hivemindd import Client, Optimizer

N = 40
LR = 0.1
BATCH = [2, 3, 5]


def grad_of(i):
    return torch.arange(N, dtype=torch.float32) * 0.01 * (i + 2) + (i + 1)


def start_of(i=0):
    return torch.arange(N, dtype=torch.float32) * 0.01 + 10.0 * i


def run_all(fns, timeout=180):
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
        t.join(timeout)
    for e in errors:
        if e is not None:
            raise e
    return results


class Trainer:
    """One parameter vector under torch SGD (lr 0.1), wrapped."""

    def __init__(self, client, i, run_id, start=None, adam=False, **kw):
        self.i = i
        self.p = torch.nn.Parameter((start if start is not None else start_of()).clone())
        self.start = self.p.detach().clone()
        inner = torch.optim.Adam([self.p], lr=1e-2) if adam else torch.optim.SGD([self.p], lr=LR)
        self.opt = Optimizer(params=[self.p], optimizer=inner,
                             run_id=run_id, batch_size_per_step=BATCH[i], client=client, **kw)

    def stats(self):
        st = self.opt.optimizer.state.get(self.p, {})
        return {k: (v.detach().clone() if hasattr(v, "clone") else v) for k, v in st.items()}

    def step(self, grad):
        self.opt.zero_grad()
        self.p.grad = grad.clone()
        self.opt.step()
        return self.opt.last_report

    def now(self):
        return self.p.detach().clone()


class OptimizerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()

    def setUp(self):
        self.clients = [Client(s, timeout=90) for s in self.swarm.sockets]
        for c in self.clients:
            self.addCleanup(c.close)

    def test_three_trainers_step_on_the_sample_weighted_mean(self):
        target = 300
        given = [0]
        lock = threading.Lock()
        trainers = [Trainer(self.clients[i], i, "pyopt3", target_batch_size=target,
                            matchmaking_time=5, averaging_timeout=20, target_group_size=3,
                            average_state_every=0) for i in range(3)]

        def train(t):
            out = {"calls": 0}
            deadline = time.monotonic() + 90
            while t.opt.local_epoch == 0 and time.monotonic() < deadline:
                with lock:
                    given[0] += BATCH[t.i]
                    before = given[0]
                rep = t.step(grad_of(t.i))
                out["calls"] += 1
                if rep["epoch_ended"]:
                    out.update(end=rep, given=before, after=t.now())
                else:
                    self.assertFalse(rep["stepped"])
                    self.assertTrue(torch.equal(t.now(), t.start), "stepped before the end")
                time.sleep(0.05)
            return out

        res = run_all([lambda t=t: train(t) for t in trainers])
        ends = [r["end"] for r in res]
        samples = [e["samples"] for e in ends]
        self.assertGreaterEqual(sum(samples), target)
        mean = sum(s * grad_of(i) for i, s in enumerate(samples)) / sum(samples)
        for i, (r, e) in enumerate(zip(res, ends)):
            # Not before: when the call that ended the epoch began, the
            # trainers had handed over at least the target.
            self.assertGreaterEqual(r["given"], target, "trainer %d ended early" % i)
            self.assertGreaterEqual(e["swarm_samples"], target)
            self.assertTrue(e["averaged"], e)
            self.assertEqual(e["group_size"], 3)
            self.assertEqual(e["epoch"], 1)
            self.assertEqual(trainers[i].opt.local_epoch, 1)
            self.assertGreaterEqual(trainers[i].opt.global_epoch, 0)
            want = trainers[i].start - LR * mean
            self.assertLessEqual((r["after"] - want).abs().max().item(), 1e-4,
                                 "trainer %d did not step on the weighted mean" % i)
            # The mean each used was the same, not its own.
            own = trainers[i].start - LR * grad_of(i)
            self.assertGreater((r["after"] - own).abs().max().item(), 1e-2)
        for t in trainers:
            t.opt.close()

    def test_a_killed_trainer_holds_the_others_up_within_the_timeouts(self):
        mm, avg_timeout = 3.0, 5.0
        victim_src = r"""
import sys, time, torch
from hivemindd import Client, Optimizer
c = Client(sys.argv[1], timeout=90)
p = torch.nn.Parameter(torch.zeros(%d))
opt = Optimizer(params=[p], optimizer=torch.optim.SGD([p], lr=0.1), run_id="pyoptkill",
                target_batch_size=400, batch_size_per_step=5, client=c, matchmaking_time=%g,
                averaging_timeout=%g, target_group_size=3, average_state_every=0)
while True:
    opt.zero_grad()
    p.grad = torch.ones(%d)
    opt.step()
    time.sleep(0.1)
""" % (N, mm, avg_timeout, N)
        victim = subprocess.Popen([sys.executable, "-c", victim_src, self.swarm.sockets[2]],
                                  stdin=subprocess.DEVNULL, env=os.environ.copy())
        self.addCleanup(lambda: victim.poll() is None and victim.kill())
        trainers = [Trainer(self.clients[i], i, "pyoptkill", target_batch_size=400,
                            matchmaking_time=mm, averaging_timeout=avg_timeout,
                            target_group_size=3, average_state_every=0) for i in range(2)]

        def train(t):
            out = {}
            deadline = time.monotonic() + 90
            while t.opt.local_epoch == 0 and time.monotonic() < deadline:
                began = time.monotonic()
                rep = t.step(grad_of(t.i))
                if rep["epoch_ended"]:
                    out.update(end=rep, took=time.monotonic() - began, after=t.now())
                time.sleep(0.1)
            return out

        def kill():
            # Once the victim's report is in the swarm, well before the target.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                prog = self.clients[0].request("progress", run="pyoptkill")
                if len(prog.get("peers", [])) == 3 and 0 < prog.get("samples", 0) < 250:
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    return True
                time.sleep(0.1)
            return False

        with self.assertLogs("hivemindd.optimizer", logging.WARNING) as logs:
            logging.getLogger("hivemindd.optimizer").warning("(a warning, so that none is fine)")
            res = run_all([lambda t=t: train(t) for t in trainers] + [kill])
        self.assertTrue(res[2], "the victim never showed in the progress")
        for i in range(2):
            e = res[i]["end"]
            self.assertTrue(e["averaged"] or e["local_fallback"], e)
            if e["averaged"]:
                # Matchmaking starts before the epoch's end, so the group may
                # hold the victim; what it averaged must not: every element
                # is the survivors' weighted mean, or the trainer's own where
                # the dead member was to reduce it.
                ws = [res[j]["end"]["samples"] for j in range(2)]
                mean = sum(w * grad_of(j) for j, w in enumerate(ws)) / sum(ws)
                got = (trainers[i].start - res[i]["after"]) / LR
                ok = torch.minimum((got - mean).abs(), (got - grad_of(i)).abs())
                self.assertLessEqual(ok.max().item(), 1e-3,
                                     "trainer %d averaged with the dead member" % i)
            else:
                self.assertTrue(any("stepping on local gradients" in m for m in logs.output),
                                logs.output)
            self.assertLessEqual(res[i]["took"], mm + avg_timeout + 3.0,
                                 "trainer %d was held up %.1f s" % (i, res[i]["took"]))
            self.assertEqual(trainers[i].opt.local_epoch, 1)
        for t in trainers:
            t.opt.close()

    def test_a_late_trainer_catches_up_by_a_state_load(self):
        # The donors train with Adam and carry its moments: the late trainer
        # loads the parameters, exp_avg, exp_avg_sq, the step count and the
        # epoch a donor had there.
        stop = threading.Event()
        kw = dict(target_batch_size=30, matchmaking_time=3, averaging_timeout=10,
                  target_group_size=2, average_state_every=0, load_state_timeout=20, adam=True,
                  average_opt_statistics=("exp_avg", "exp_avg_sq"))
        donors = [Trainer(self.clients[i], i, "pyoptlate", **kw) for i in range(2)]

        def donate(t):
            snaps = {}
            deadline = time.monotonic() + 90
            while not stop.is_set() and time.monotonic() < deadline:
                rep = t.step(grad_of(t.i))
                if rep["epoch_ended"]:
                    snaps[rep["epoch"]] = (t.now(), t.stats())
                time.sleep(0.02)
            return snaps

        late_out = {}

        def late():
            try:
                c = self.clients[2]
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if c.request("progress", run="pyoptlate").get("global_epoch", 0) >= 3:
                        break
                    time.sleep(0.2)
                t = Trainer(c, 2, "pyoptlate", start=torch.zeros(N), **kw)
                with self.assertLogs("hivemindd.optimizer", logging.WARNING) as logs:
                    late_out["rep"] = t.step(torch.full((N,), 1000.0))
                late_out["logs"] = logs.output
                late_out["params"] = t.now()
                late_out["stats"] = t.stats()
                late_out["epoch"] = t.opt.local_epoch
                # Adam steps on the loaded moments (its state is whole).
                t.step(grad_of(2))
                t.opt.close()
            finally:
                stop.set()

        res = run_all([lambda t=t: donate(t) for t in donors] + [late])
        rep = late_out["rep"]
        self.assertTrue(rep["caught_up"], rep)
        self.assertTrue(rep["state_loaded"], rep)
        self.assertTrue(rep["statistics_loaded"], rep)
        self.assertFalse(rep["epoch_ended"], "the late trainer stepped on its own gradients")
        self.assertGreaterEqual(rep["epoch"], 3)
        self.assertEqual(late_out["epoch"], rep["epoch"])
        self.assertTrue(any("state loaded" in m for m in late_out["logs"]), late_out["logs"])
        st = late_out["stats"]
        self.assertIn("exp_avg", st)
        self.assertGreater(st["exp_avg"].abs().sum().item(), 0)

        def same(snap):
            params, stats = snap
            return (torch.equal(params, late_out["params"]) and
                    torch.equal(stats["exp_avg"], st["exp_avg"]) and
                    torch.equal(stats["exp_avg_sq"], st["exp_avg_sq"]) and
                    float(stats["step"]) == float(st["step"]))

        self.assertTrue(any(rep["epoch"] in s and same(s[rep["epoch"]]) for s in res[:2]),
                        "the loaded state is no donor's at epoch %d" % rep["epoch"])
        for t in donors:
            t.opt.close()

    def test_delay_optimizer_step_steps_one_epoch_late(self):
        trainers = [Trainer(self.clients[i], i, "pyoptdelay", target_batch_size=100,
                            matchmaking_time=4, averaging_timeout=10, target_group_size=2,
                            average_state_every=0, delay_optimizer_step=True)
                    for i in range(2)]

        def train(t):
            out = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                rep = t.step(grad_of(t.i))
                if rep["epoch_ended"] and "end" not in out:
                    out.update(end=rep, at_end=t.now())
                if rep["stepped"] and rep["stepped_epoch"] == 0:
                    out.update(applied=rep, after=t.now(), epoch=t.opt.local_epoch)
                    return out
                time.sleep(0.05)
            return out

        res = run_all([lambda t=t: train(t) for t in trainers])
        samples = [r["end"]["samples"] for r in res]
        self.assertGreaterEqual(sum(samples), 100)
        mean = sum(s * grad_of(i) for i, s in enumerate(samples)) / sum(samples)
        for i, r in enumerate(res):
            t = trainers[i]
            # The call that ended the epoch returned before the round was
            # over and left the parameters as they were.
            self.assertFalse(r["end"]["stepped"], r["end"])
            self.assertTrue(r["end"]["pending"], r["end"])
            self.assertTrue(torch.equal(r["at_end"], t.start))
            self.assertIn("applied", r, "epoch 0 was never stepped on")
            self.assertTrue(r["applied"]["averaged"], r["applied"])
            self.assertEqual(r["applied"]["group_size"], 2)
            self.assertGreaterEqual(r["epoch"], 1)
            want = t.start - LR * mean
            self.assertLessEqual((r["after"] - want).abs().max().item(), 1e-4)
        for t in trainers:
            t.opt.close()

    def test_use_local_updates_steps_every_call_and_averages_by_the_delta_rule(self):
        # The state average starts at the epoch's end from the parameters
        # there and is applied later by the delta rule: each trainer then
        # holds the mean of the epoch-end parameters minus its own local
        # steps since.
        trainers = [Trainer(self.clients[i], i, "pyoptlocal", start=start_of(i),
                            target_batch_size=100, matchmaking_time=4, averaging_timeout=10,
                            target_group_size=2, use_local_updates=True) for i in range(2)]
        ones = torch.ones(N)

        def train(t):
            calls, end, at_end, after_end = 0, None, None, 0
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                before = t.now()
                rep = t.step(ones)
                calls += 1
                # A local step on this call's gradients, every call.
                self.assertTrue(rep["stepped"], rep)
                if end is None:
                    self.assertLessEqual((t.now() - (before - LR * ones)).abs().max().item(),
                                         1e-5)
                if rep["epoch_ended"] and end is None:
                    end, at_end = rep, t.now()
                elif end is not None:
                    after_end += 1
                    if rep["state_averaged"]:
                        return dict(end=end, calls=calls - after_end,
                                    at_end=at_end, after_end=after_end, apply=rep,
                                    after=t.now())
                time.sleep(0.05)
            return {}

        res = run_all([lambda t=t: train(t) for t in trainers])
        mean = sum(r["at_end"] for r in res) / 2
        for i, r in enumerate(res):
            self.assertTrue(r["end"]["state_started"], r["end"])
            self.assertFalse(r["end"]["state_averaged"], r["end"])
            self.assertFalse(r["end"]["averaged"], "a gradient round with local updates")
            self.assertLessEqual((r["at_end"] - (trainers[i].start - LR * r["calls"]))
                                 .abs().max().item(), 1e-3)
            want = mean - LR * r["after_end"]
            self.assertLessEqual((r["after"] - want).abs().max().item(), 1e-3,
                                 "trainer %d: not the delta rule's result" % i)
        for t in trainers:
            t.opt.close()

    def test_average_opt_statistics_averages_adam_moments(self):
        # Local updates with Adam on constant gradients g_i: the moments at
        # the epoch's end are averaged in the background and applied by
        # the delta rule, the local steps going on meanwhile. So the
        # applied moments are the local ones moved by (mean at the end -
        # own at the end), which for exp_avg, with n_i steps at the end
        # and k_i more, is checked against the closed form.
        models, opts = [], []
        for i in range(2):
            p = torch.nn.Parameter(start_of(i).clone())
            adam = torch.optim.Adam([p], lr=1e-3)
            models.append(p)
            opts.append(Optimizer(params=[p], optimizer=adam, run_id="pyoptstats",
                                  target_batch_size=60, batch_size_per_step=BATCH[i],
                                  matchmaking_time=4, averaging_timeout=10, target_group_size=2,
                                  use_local_updates=True,
                                  average_opt_statistics=("exp_avg", "exp_avg_sq"),
                                  client=self.clients[i]))

        def train(i):
            calls, end_calls = 0, None
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                opts[i].zero_grad()
                models[i].grad = grad_of(i).clone()
                opts[i].step()
                calls += 1
                rep = opts[i].last_report
                if rep["epoch_ended"] and end_calls is None:
                    end_calls = calls
                elif end_calls is not None and rep["state_averaged"]:
                    st = opts[i].optimizer.state[models[i]]
                    return dict(rep=rep, n=end_calls, k=calls - end_calls,
                                exp_avg=st["exp_avg"].clone(),
                                exp_avg_sq=st["exp_avg_sq"].clone())
                time.sleep(0.05)
            return {}

        res = run_all([lambda i=i: train(i) for i in range(2)])

        def m(n, g, beta):
            return (1 - beta ** n) * g

        mean_m = sum(m(r["n"], grad_of(i), 0.9) for i, r in enumerate(res)) / 2
        mean_v = sum(m(r["n"], grad_of(i) ** 2, 0.999) for i, r in enumerate(res)) / 2
        for i, r in enumerate(res):
            n, k = r["n"], r["k"]
            want_m = m(n + k, grad_of(i), 0.9) + mean_m - m(n, grad_of(i), 0.9)
            want_v = m(n + k, grad_of(i) ** 2, 0.999) + mean_v - m(n, grad_of(i) ** 2, 0.999)
            self.assertTrue(r["rep"]["state_averaged"], r["rep"])
            self.assertTrue(r["rep"]["statistics_averaged"], r["rep"])
            self.assertLessEqual((r["exp_avg"] - want_m).abs().max().item(), 1e-4)
            self.assertLessEqual(((r["exp_avg_sq"] - want_v).abs() / want_v).max().item(), 1e-4)
        for o in opts:
            o.close()

    def test_delay_optimizer_step_with_local_updates_steps_in_the_background(self):
        # Each step()'s local step runs on the library's thread, on the
        # wrapped optimizer's own copy of the parameters; the next step()
        # hands its result to the model: after call k the model holds k - 1
        # steps.
        threads = set()

        class Probe(torch.optim.SGD):
            def step(self, closure=None):
                threads.add(threading.get_ident())
                time.sleep(0.02)
                return super().step(closure)

        p = torch.nn.Parameter(start_of())
        start = p.detach().clone()
        opt = Optimizer(params=[p], optimizer=lambda ps: Probe(ps, lr=LR), run_id="pybgsteps",
                        target_batch_size=100000, batch_size_per_step=1,
                        delay_optimizer_step=True, use_local_updates=True,
                        client=self.clients[0])
        self.assertIsNot(opt.optimizer.param_groups[0]["params"][0], p)
        ones = torch.ones(N)
        for call in range(1, 6):
            # Inside the running step's sleep: zero_grad must not reach it.
            time.sleep(0.01)
            opt.zero_grad()
            p.grad = ones.clone()
            opt.step()
            rep = opt.last_report
            self.assertEqual(rep["stepped"], call > 1, rep)
            self.assertTrue(rep["pending"], rep)
            want = start - LR * (call - 1)
            self.assertLessEqual((p.detach() - want).abs().max().item(), 1e-5,
                                 "call %d" % call)
        opt.close()
        self.assertNotIn(threading.get_ident(), threads)
        self.assertEqual(len(threads), 1, threads)
        # A ready-made optimizer cannot step a copy: refused with a reason.
        with self.assertRaisesRegex(ValueError, "factory"):
            Optimizer(params=[p], optimizer=torch.optim.SGD([p], lr=LR), run_id="x",
                      target_batch_size=10, delay_optimizer_step=True,
                      use_local_updates=True, client=self.clients[0])

    def test_alone_steps_on_its_own_gradients_and_warns(self):
        t = Trainer(self.clients[0], 0, "pyoptalone", target_batch_size=6, matchmaking_time=1,
                    averaging_timeout=2, target_group_size=2, average_state_every=0)
        with self.assertLogs("hivemindd.optimizer", logging.WARNING) as logs:
            reps = [t.step(grad_of(0)) for _ in range(3)]
        self.assertEqual([r["epoch_ended"] for r in reps], [False, False, True])
        self.assertTrue(reps[2]["local_fallback"], reps[2])
        self.assertTrue(any("stepping on local gradients" in m for m in logs.output), logs.output)
        want = t.start - LR * grad_of(0)
        self.assertLessEqual((t.now() - want).abs().max().item(), 1e-5)
        self.assertEqual(t.opt.local_epoch, 1)
        t.opt.close()

    def test_refuses_bad_options(self):
        p = torch.nn.Parameter(torch.zeros(3))
        sgd = torch.optim.SGD([p], lr=0.1)
        with self.assertRaises(ValueError):
            Optimizer(params=[p], optimizer=sgd, run_id="x", target_batch_size=0,
                      client=self.clients[0])
        with self.assertRaises(ValueError):
            Optimizer(params=[p], optimizer=sgd, run_id="x" * 200, target_batch_size=10,
                      client=self.clients[0])
        opt = Optimizer(params=[p], optimizer=sgd, run_id="pyoptbad", target_batch_size=10,
                        client=self.clients[0])
        p.grad = torch.tensor([1.0, float("nan"), 0.0])
        with self.assertRaises(ValueError):
            opt.step(batch_size=1)
        with self.assertRaises(ValueError):
            opt.step()  # no batch size at all
        opt.close()


if __name__ == "__main__":
    unittest.main()
