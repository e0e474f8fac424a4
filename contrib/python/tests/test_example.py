"""examples/train_fmnist.py runs end to end against the test swarm (a few
steps on the "train" grid), printing its step lines and a test accuracy."""

import os
import re
import subprocess
import sys
import unittest

import swarm

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_fmnist.py")
DATA = "/usr/share/datasets/fashion-mnist"


class ExampleTest(unittest.TestCase):
    @unittest.skipUnless(os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
                         "Fashion-MNIST is not under " + DATA)
    def test_train_fmnist_runs(self):
        s = swarm.get()
        with __import__("hivemindd").Client(s.daemons[0].sock) as c:
            swarm.wait_for_experts(c, "train", 4)
        argv = [sys.executable, EXAMPLE, "--socket", s.daemons[0].sock, "--data-dir", DATA,
                "--dim", str(swarm.DIM), "--grid", "2x2", "--uid-prefix", "train",
                "--k-best", "2", "--steps", "12", "--batch-size", "32", "--log-every", "4",
                "--average-every", "5", "--average-timeout", "2", "--eval-samples", "256"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        self.assertEqual(p.returncode, 0, "stdout:\n%s\nstderr:\n%s" % (p.stdout, p.stderr))
        steps = re.findall(r"^step (\d+) loss ([0-9.]+) acc ([0-9.]+)", p.stdout, re.M)
        self.assertEqual([int(s[0]) for s in steps], [4, 8, 12], p.stdout)
        for _, loss, acc in steps:
            self.assertTrue(0 < float(loss) < 10 and 0 <= float(acc) <= 1)
        m = re.search(r"^test accuracy ([0-9.]+) on 256 images", p.stdout, re.M)
        self.assertIsNotNone(m, p.stdout)
        # Alone under its prefix, the background round finds no group and
        # training goes on.
        self.assertRegex(p.stdout, r"averaging (round )?skipped: no group")

    @unittest.skipUnless(os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
                         "Fashion-MNIST is not under " + DATA)
    def test_train_fmnist_collaborative_runs(self):
        # Alone in its run: one epoch every two steps (64 of 32 each), each
        # stepped on its own gradients.
        s = swarm.get()
        with __import__("hivemindd").Client(s.daemons[0].sock) as c:
            swarm.wait_for_experts(c, "train", 4)
        argv = [sys.executable, EXAMPLE, "--socket", s.daemons[0].sock, "--data-dir", DATA,
                "--dim", str(swarm.DIM), "--grid", "2x2", "--uid-prefix", "train",
                "--k-best", "2", "--steps", "8", "--batch-size", "32", "--log-every", "4",
                "--collaborative", "--run-id", "fmnist.example", "--target-batch-size", "64",
                "--matchmaking-time", "1", "--averaging-timeout", "2",
                "--average-state-every", "0", "--eval-samples", "256"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=180)
        self.assertEqual(p.returncode, 0, "stdout:\n%s\nstderr:\n%s" % (p.stdout, p.stderr))
        epochs = re.findall(r"^epoch (\d+) at step (\d+): 64 samples here, \d+ in the swarm, "
                            r"local step", p.stdout, re.M)
        self.assertEqual([(int(e), int(s)) for e, s in epochs], [(1, 2), (2, 4), (3, 6), (4, 8)],
                         p.stdout)
        self.assertIn("stepping on local gradients", p.stderr)
        self.assertRegex(p.stdout, r"(?m)^test accuracy [0-9.]+ on 256 images")


if __name__ == "__main__":
    unittest.main()
