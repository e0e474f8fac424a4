"""Transformer experts over sequences from Python: RemoteExpert and
RemoteMixtureOfExperts(sequence_experts=True), routed per batch and per
sample, on [batch, seq, dim], with and
without a key-padding mask, against torch's own nn.MultiheadAttention
built from the experts' checkpoints (in float64).

The experts "xf.[0:2].[0:2]" are hosted on the swarm's d1 (checkpoints
every second) with SGD at 1e-30, so that a backward leaves them as they
were and the reference stays exact."""

import copy
import os
import struct
import time
import unittest

import numpy as np
import torch

import swarm
from hivemindd import Client, HivemindError, RemoteExpert, RemoteMixtureOfExperts

D = swarm.DIM
HEADS = 4
MAX_SEQ = 8


def _bin_after(body, key, start=0):
    """The bin that follows the msgpack str key in body (from start)."""
    at = body.index(bytes([0xA0 | len(key)]) + key, start) + 1 + len(key)
    tag = body[at]
    if tag == 0xC6:
        n, at = struct.unpack(">I", body[at + 1:at + 5])[0], at + 5
    elif tag == 0xC5:
        n, at = struct.unpack(">H", body[at + 1:at + 3])[0], at + 3
    elif tag == 0xC4:
        n, at = body[at + 1], at + 2
    else:
        raise AssertionError("%r is not a bin" % key)
    return body[at:at + n]


def read_transformer(path):
    """(attention, ffn) parameter vectors of a transformer checkpoint: the
    48-byte checkpoint header (moe/checkpoint.h), then the state map whose
    "attn" is a bin of float32 and whose "ffn" is the ffn's own state, with
    its "params" (moe/transformer.h, moe/ffn.c)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"HMCK", path
    body = data[48:]
    attn = np.frombuffer(_bin_after(body, b"attn"), dtype="<f4").astype(np.float64)
    ffn = _bin_after(body, b"ffn")
    params = np.frombuffer(_bin_after(ffn, b"params"), dtype="<f4").astype(np.float64)
    return attn, params


class LocalTransformer:
    """hivemindd's transformer expert in torch, float64: h = x +
    MHA(LN1(x)) with torch's nn.MultiheadAttention (in_proj = Wqkv,
    out_proj = Wo, key_padding_mask = the padding), y = h + FFN(LN2(h))."""

    def __init__(self, attn, params, dim, heads):
        a = torch.from_numpy(attn)
        at = [0]

        def take(t, n):
            v = t[at[0]:at[0] + n]
            at[0] += n
            return v

        self.g1, self.b1 = take(a, dim), take(a, dim)
        self.mha = torch.nn.MultiheadAttention(dim, heads, batch_first=True).double()
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(take(a, 3 * dim * dim).view(3 * dim, dim))
            self.mha.in_proj_bias.copy_(take(a, 3 * dim))
            self.mha.out_proj.weight.copy_(take(a, dim * dim).view(dim, dim))
            self.mha.out_proj.bias.copy_(take(a, dim))
        assert at[0] == attn.size
        p = torch.from_numpy(params)
        at[0] = 0
        h = (params.size - 3 * dim) // (2 * dim + 1)
        self.g2, self.b2 = take(p, dim), take(p, dim)
        self.W1 = take(p, h * dim).view(h, dim)
        self.fb1 = take(p, h)
        self.W2 = take(p, dim * h).view(dim, h)
        self.fb2 = take(p, dim)
        assert at[0] == params.size
        self.dim = dim

    def __call__(self, x, mask=None):
        F = torch.nn.functional
        a = F.layer_norm(x, (self.dim,), self.g1, self.b1, 1e-5)
        pad = None if mask is None else (mask == 0)
        o, _ = self.mha(a, a, a, key_padding_mask=pad, need_weights=False)
        h = x + o
        ln = F.layer_norm(h, (self.dim,), self.g2, self.b2, 1e-5)
        return h + F.gelu(ln @ self.W1.t() + self.fb1, approximate="tanh") @ self.W2.t() + self.fb2


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class TransformerExpertTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.swarm = swarm.get()
        d0, d1 = cls.swarm.daemons[0], cls.swarm.daemons[1]
        with Client(d1.sock) as c:
            c.request("experts.host", pattern="xf.[0:2].[0:2]", type="transformer", dim=D,
                      heads=HEADS, max_seq=MAX_SEQ, optimizer="sgd", lr=1e-30)
        cls.client = Client(d0.sock)
        cls.experts = swarm.wait_for_experts(cls.client, "xf", 4)
        # A host checkpoints an expert once it has stepped: one backward
        # each (SGD at 1e-30 moves nothing but zeros, by 1e-30 at most).
        x = np.zeros((1, 2, D), dtype=np.float32)
        cls.client.experts_backward(cls.experts, x, np.ones((4, 1, 2, D), dtype=np.float32))

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def local(self, uid):
        path = os.path.join(self.swarm.daemons[1].dir, "experts", uid + ".ckpt")
        deadline = time.monotonic() + 20
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertTrue(os.path.exists(path), "no checkpoint " + path)
        return LocalTransformer(*read_transformer(path), D, HEADS)

    def check_expert(self, mask):
        torch.manual_seed(3)
        info = self.experts[0]
        remote = RemoteExpert(info, client=self.client)
        ref = self.local(info.uid)
        x = torch.randn(3, 6, D)
        xr = x.double().clone().requires_grad_(True)
        x.requires_grad_(True)
        y = remote(x, attention_mask=mask)
        want = ref(xr, mask)
        self.assertEqual(y.shape, (3, 6, D))
        self.assertLessEqual(rel(y.double(), want), 1e-5)
        gy = torch.randn(3, 6, D)
        y.backward(gy)
        want.backward(gy.double())
        self.assertLessEqual(rel(x.grad.double(), xr.grad), 1e-5)
        return x.detach(), y.detach()

    def test_remote_expert_equals_torch_reference(self):
        self.check_expert(None)

    def test_remote_expert_with_padding_mask(self):
        mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
        x, ym = self.check_expert(mask)
        _, y = self.check_expert(None)
        # torch's convention (True: padding) says the same.
        remote = RemoteExpert(self.experts[0], client=self.client)
        yk = remote(x, key_padding_mask=mask == 0).detach()
        self.assertLessEqual((yk - ym).abs().max().item(), 1e-6, (yk - ym).abs().max().item())
        # Padding changes what the other tokens see, and nothing else matters.
        self.assertGreater((ym[1] - y[1]).abs().max().item(), 1e-4)
        self.assertLessEqual((ym[0] - y[0]).abs().max().item(), 1e-6)

    def test_mixture_over_sequences(self):
        torch.manual_seed(4)
        moe = RemoteMixtureOfExperts(D, grid_size=(2, 2), uid_prefix="xf", k_best=4,
                                     routing="batch", sequence_experts=True,
                                     client=self.client, timeout_after_k_min=2.0)
        x = torch.randn(2, 5, D)
        mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
        x1 = x.clone().requires_grad_(True)
        out = moe(x1, attention_mask=mask)
        self.assertEqual(out.shape, (2, 5, D))
        self.assertEqual(len(moe.last_experts), 4)
        xr = x.double().clone().requires_grad_(True)
        g = copy.deepcopy(moe.gate).double()(xr.mean(1))
        ys, logits = [], []
        for e in moe.last_experts:
            i, j = map(int, e.uid.split(".")[1:])
            ys.append(self.local(e.uid)(xr, mask))
            logits.append(g[:, i] + g[:, 2 + j])
        w = torch.softmax(torch.stack(logits, 1), 1)
        want = torch.einsum("be,ebsd->bsd", w, torch.stack(ys))
        self.assertLessEqual(rel(out.double(), want), 1e-5)
        gy = torch.randn(2, 5, D)
        out.backward(gy)
        want.backward(gy.double())
        self.assertLessEqual(rel(x1.grad.double(), xr.grad), 1e-5)

    def test_per_sample_routing_over_sequences(self):
        """Each sequence its own experts: an expert's request holds the
        whole sequences routed to it, each with its own mask."""
        torch.manual_seed(5)
        moe = RemoteMixtureOfExperts(D, grid_size=(2, 2), uid_prefix="xf", k_best=2,
                                     beam_size=2, routing="sample", sequence_experts=True,
                                     client=self.client, timeout_after_k_min=2.0)
        x = torch.randn(4, 5, D)
        mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
        x1 = x.clone().requires_grad_(True)
        out = moe(x1, attention_mask=mask)
        self.assertEqual(out.shape, (4, 5, D))
        routes = moe.last_routes
        self.assertTrue(moe.last_mask.all())
        # Not every sample went to the same experts, or this would be per batch.
        self.assertGreater(len({tuple(sorted(r)) for r in
                                ([moe.last_experts[i].uid for i in row] for row in routes)}), 1)
        xr = x.double().clone().requires_grad_(True)
        g = copy.deepcopy(moe.gate).double()(xr.mean(1))
        refs = {e.uid: self.local(e.uid) for e in moe.last_experts}
        rows = []
        for b in range(4):
            logits, ys = [], []
            for idx in routes[b]:
                e = moe.last_experts[idx]
                i, j = map(int, e.uid.split(".")[1:])
                logits.append(g[b, i] + g[b, 2 + j])
                ys.append(refs[e.uid](xr[b:b + 1], mask[b:b + 1])[0])
            w = torch.softmax(torch.stack(logits), 0)
            rows.append(torch.einsum("k,ksd->sd", w, torch.stack(ys)))
        want = torch.stack(rows)
        self.assertLessEqual(rel(out.double(), want), 1e-5)
        gy = torch.randn(4, 5, D)
        out.backward(gy)
        want.backward(gy.double())
        self.assertLessEqual(rel(x1.grad.double(), xr.grad), 1e-5)

    def test_refusals_keep_the_servers_code(self):
        remote = RemoteExpert(self.experts[0], client=self.client)
        with self.assertRaises(HivemindError) as cm:
            remote(torch.randn(1, MAX_SEQ + 1, D))
        self.assertEqual(cm.exception.code, "expert_wrong_shape")
        self.assertIn("at most %d, not %d" % (MAX_SEQ, MAX_SEQ + 1), cm.exception.message)
        with self.assertRaises(HivemindError) as cm:
            remote(torch.randn(4, D))
        self.assertEqual(cm.exception.code, "expert_wrong_shape")
        self.assertIn("[batch, seq, %d]" % D, cm.exception.message)
        with self.assertRaises(HivemindError) as cm:
            remote(torch.randn(2, 3, D // 2))
        self.assertEqual(cm.exception.code, "expert_wrong_shape")
        # Bad masks are refused before any call.
        with self.assertRaises(ValueError):
            remote(torch.randn(2, 3, D), attention_mask=torch.zeros(2, 3))
        with self.assertRaises(ValueError):
            remote(torch.randn(2, 3, D), attention_mask=torch.ones(3, 2))


if __name__ == "__main__":
    unittest.main()
