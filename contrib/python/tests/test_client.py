"""Client and SharedBuffer against a real daemon: info and requests, the
daemon's errors as HivemindError, and shared buffers seen from numpy and
torch as the same memory the daemon accounts for."""

import os
import time
import unittest

import numpy as np
import torch

import swarm
from hivemindd import Client, HivemindError, SharedBuffer


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()

    def setUp(self):
        self.c = Client(self.swarm.daemons[0].sock)
        self.addCleanup(self.c.close)

    def test_info_and_request(self):
        info = self.c.info()
        self.assertEqual(info["address"], self.swarm.daemons[0].addr)
        peers = self.c.request("peers")["peers"]
        self.assertIsInstance(peers, list)
        put = self.c.request("dht.put", key="pytest/key", value="hello", ttl=60)
        self.assertGreaterEqual(put["stored"], 1)
        got = self.c.request("dht.get", key="pytest/key")
        self.assertTrue(got["found"])
        self.assertEqual(got["values"][0]["value"], "hello")

    def test_errors(self):
        with self.assertRaises(HivemindError) as cm:
            self.c.request("no.such.command")
        self.assertEqual(cm.exception.code, "unknown_command")
        with self.assertRaises(HivemindError) as cm:
            self.c.request("dht.put", key="k")  # no value
        self.assertEqual(cm.exception.code, "bad_args")
        # The connection stays usable after a refused request.
        self.assertIn("peer_id", self.c.info())
        with self.assertRaises(HivemindError) as cm:
            Client(os.path.join(self.swarm.root, "nobody-here.sock"))
        self.assertEqual(cm.exception.code, "ENOENT")
        self.assertIn("nobody-here.sock", cm.exception.message)

    def test_buffers_map_and_round_trip(self):
        before = self.c.info()["shm"]
        b = self.c.buffer(4096)
        self.assertGreater(b.id, 0)
        self.assertEqual(b.nbytes, 4096)
        during = self.c.info()["shm"]
        self.assertEqual(during["segments"], before["segments"] + 1)
        self.assertEqual(during["bytes"], before["bytes"] + 4096)

        a = b.numpy(np.float32)
        t = b.torch(np.float32)
        self.assertEqual(a.shape, (1024,))
        self.assertTrue((a == 0).all(), "a new buffer is zero-filled")
        vals = np.random.default_rng(1).standard_normal(1024).astype(np.float32)
        a[:] = vals
        # The torch view and a second numpy view see the same bytes.
        self.assertTrue(torch.equal(t, torch.from_numpy(vals)))
        t[10:20] = 7.5
        self.assertTrue((b.numpy(np.float32, 10, 40) == 7.5).all())
        self.assertEqual(a.ctypes.data, b.address)
        # Typed views at an offset.
        d = b.numpy(np.float64, 4, 16)
        self.assertEqual(d.ctypes.data, b.address + 16)

        b.free()
        self.assertEqual(self.c.info()["shm"], before)
        with self.assertRaises(ValueError):
            b.numpy()

    def test_tensor_keeps_its_buffer(self):
        n = self.c.info()["shm"]["segments"]
        arr = self.c.tensor((3, 5))
        self.assertEqual(arr.shape, (3, 5))
        arr += 2
        self.assertEqual(self.c.info()["shm"]["segments"], n + 1)
        x = torch.from_numpy(arr)
        del arr
        x.mul_(3)
        self.assertTrue(torch.equal(x, torch.full((3, 5), 6.0)))
        # The last view gone, the segment goes.
        del x
        self.assertEqual(self.c.info()["shm"]["segments"], n)

    def test_averaging_in_shared_memory_by_request(self):
        """A single-member round under a private prefix averages the buffer
        in place: the daemon reads and writes the trainer's mapping."""
        b = self.c.buffer(64)
        a = b.numpy(np.float32)
        a[:] = np.arange(16, dtype=np.float32)
        rep = self.c.request("average", prefix="pytest.solo", target_group_size=1, timeout=10,
                             data={"shm": b.id, "offset": 0, "elems": 16})
        self.assertEqual(rep["elements"], 16)
        np.testing.assert_array_equal(a, np.arange(16, dtype=np.float32))
        b.free()

    def test_close_releases_segments(self):
        other = Client(self.swarm.daemons[0].sock)
        b = SharedBuffer(other, 1 << 16)
        n = self.c.info()["shm"]["segments"]
        other.close()
        # The daemon releases a closed connection's segments.
        deadline = time.monotonic() + 5
        while self.c.info()["shm"]["segments"] != n - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.c.info()["shm"]["segments"], n - 1)
        # The trainer's mapping outlives the connection until free().
        b.numpy(np.uint8)[:] = 1
        b.free()


if __name__ == "__main__":
    unittest.main()
