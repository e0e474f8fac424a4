"""The test swarm: real hivemindd processes on 127.0.0.1 (port 0) in a
temporary directory, started once per test run on first use and torn down
at exit (and killed with this process if it dies: PR_SET_PDEATHSIG).

    d0: a plain node; the others join through it.
    d1, d2 checkpoint their experts every second.
    d1: hosts the experts "ffn.[0:2].[0:2]" of dim 16 with SGD at a learning
        rate of 1e-30 (hosted through the control socket, experts.host), so that backward calls leave them as they are and
        results can be compared exactly across calls.
    d2: hosts "train.[0:2].[0:2]" of dim 16 with Adam at 0.01, for training.

The binaries come from $HM_BUILDDIR (default: the current directory).
"""

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

DIM = 16
_swarm = None


def builddir():
    return os.environ.get("HM_BUILDDIR") or os.getcwd()


def binary(name):
    return os.path.join(builddir(), "src", name)


def _die_with_parent():
    # 1 is PR_SET_PDEATHSIG: the daemon gets SIGKILL when the test process dies.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)


class Daemon:
    def __init__(self, root, name, args):
        self.dir = os.path.join(root, name)
        os.mkdir(self.dir, 0o700)
        self.sock = os.path.join(self.dir, "ctl.sock")
        self.out = os.path.join(root, name + ".out")
        self.err = os.path.join(root, name + ".err")
        argv = [binary("hivemindd"), "--listen", "127.0.0.1:0", "--state-dir", self.dir,
                "--control-socket", self.sock, "--ping-interval", "1"] + list(args)
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        self.addr = self._read_address(20.0)

    def _read_address(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.out) as f:
                line = f.readline()
            if line.endswith("\n") and os.path.exists(self.sock):
                return line.strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        with open(self.err) as f:
            err = f.read()
        self.stop()
        raise RuntimeError("hivemindd %s did not start; stderr:\n%s" % (self.dir, err))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Swarm:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="hmpy.")
        self.daemons = []
        try:
            d0 = self._start("d0", [])
            # Checkpoints every second, so that tests can read the experts'
            # weights back (contrib/python/tests/test_moe_routing.py).
            d1 = self._start("d1", ["--initial-peers", d0.addr, "--expert-dim", str(DIM),
                                    "--checkpoint-interval", "1"])
            d2 = self._start("d2", ["--initial-peers", d0.addr, "--expert-dim", str(DIM),
                                    "--checkpoint-interval", "1"])
            # Hosted once the nodes know each other (experts.host declares at
            # once), rather than with --host-experts, whose first declaration
            # runs before the node has peers and is then only repeated at the
            # next refresh, some 20 seconds later.
            self._host(d1, "ffn.[0:2].[0:2]", "sgd", 1e-30)
            self._host(d2, "train.[0:2].[0:2]", "adam", 0.01)
        except BaseException:
            self.close()
            raise

    def _start(self, name, args):
        d = Daemon(self.root, name, args)
        self.daemons.append(d)
        return d

    @staticmethod
    def _host(daemon, pattern, optimizer, lr):
        from hivemindd import Client

        with Client(daemon.sock) as c:
            c.request("experts.host", pattern=pattern, dim=DIM, optimizer=optimizer, lr=lr)

    @property
    def sockets(self):
        return [d.sock for d in self.daemons]

    def close(self):
        # All at once: each drains for a moment on SIGTERM.
        for d in self.daemons:
            if d.proc.poll() is None:
                d.proc.terminate()
        for d in self.daemons:
            d.stop()
        self.daemons = []
        shutil.rmtree(self.root, ignore_errors=True)


def get():
    """The running test swarm, started on first use; skips the calling test
    when the daemon is not built."""
    global _swarm
    if _swarm is None:
        if not os.access(binary("hivemindd"), os.X_OK):
            raise unittest.SkipTest("%s is not built (set HM_BUILDDIR)" % binary("hivemindd"))
        _swarm = Swarm()
        atexit.register(_swarm.close)
    return _swarm


def wait_for_experts(client, prefix, want, timeout=30.0):
    """Beam search with flat scores until want experts of the 2x2 grid under
    prefix are found (declarations take a moment to spread)."""
    deadline = time.monotonic() + timeout
    found = []
    while time.monotonic() < deadline:
        try:
            found = client.find_experts(prefix, [[0.0, 0.0], [0.0, 0.0]], want, timeout=5.0)
        except Exception:
            found = []
        if len(found) >= want:
            return found
        time.sleep(0.3)
    raise AssertionError("beam search under %r found %d of %d experts" % (prefix, len(found),
                                                                          want))
