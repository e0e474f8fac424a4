"""RemoteMixtureOfExperts: a torch layer whose experts live on hivemindd
hosts anywhere in the swarm, chosen per batch by a local gate.

The experts form a grid "PREFIX.i.j" (grid_size (G0, G1)); the gate is a
local nn.Linear(in_features, G0 + G1) giving each sample one score per grid
coordinate. For a batch:

1. the batch-mean score of every coordinate goes to the daemon's beam
   search (experts.find), which returns the k_best experts of the swarm
   with the best summed coordinate scores (looked up again only when the
   best coordinates change or the cached answer is older than cache_ttl
   seconds, or an expert stopped answering);
2. the batch goes to those experts (experts.forward); those that do not
   answer in time are left out, and fewer than k_min answering raises;
3. each sample's mixture weights are the softmax, over the experts that
   answered, of its summed coordinate scores; computed in torch, so the
   gate learns through them;
4. output = sum_e w_e * y_e.

On backward, each expert that answered gets grad_output * w_e
(experts.backward), returns its dL/dx and applies one optimizer step to its
own parameters on its host; the layer's input gradient is the sum of those
plus what flows through the gate. An expert that does not answer the
backward contributes nothing; fewer than backward_k_min raises.

Experts compute dim -> dim (hivemindd's ffn expert), so in_features must be
the hosts' --expert-dim.
"""

import time

import numpy as np
import torch
from torch import nn

from .client import Client, HivemindError

__all__ = ["RemoteMixtureOfExperts"]


class _Call:
    """What one forward decided, for its backward."""

    def __init__(self, client, experts, k_min, timeout, after, backward_k_min, backward_timeout):
        self.client = client
        self.experts = experts
        self.k_min = k_min
        self.timeout = timeout
        self.after = after
        self.backward_k_min = backward_k_min
        self.backward_timeout = backward_timeout
        self.answered = None           # indices into experts, after forward
        self.backward_answered = None  # booleans per answered expert, after backward


class _RemoteExperts(torch.autograd.Function):
    """Y [E, batch, dim] = the answered experts' outputs on x [batch, dim].

    ``dummy`` is an empty tensor that requires grad, so that backward runs
    (and the experts learn) even when x itself needs no gradient."""

    @staticmethod
    def forward(ctx, dummy, x, call):
        xn = x.detach().to("cpu", torch.float32).contiguous().numpy()
        y, answered = call.client.experts_forward(call.experts, xn, call.k_min, call.timeout,
                                                  call.after)
        call.answered = [i for i, a in enumerate(answered) if a]
        ctx.call = call
        ctx.save_for_backward(x)
        return torch.from_numpy(y[call.answered]).to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        call = ctx.call
        experts = [call.experts[i] for i in call.answered]
        xn = x.detach().to("cpu", torch.float32).contiguous().numpy()
        gy = grad_y.detach().to("cpu", torch.float32).contiguous().numpy()
        gx, answered = call.client.experts_backward(
            experts, xn, gy, min(call.backward_k_min, len(experts)), call.backward_timeout)
        call.backward_answered = answered
        if not ctx.needs_input_grad[1]:
            return None, None, None
        total = gx[np.asarray(answered, dtype=bool)].sum(axis=0)
        return None, torch.from_numpy(total).to(device=x.device, dtype=x.dtype), None


class RemoteMixtureOfExperts(nn.Module):
    """A mixture-of-experts layer over the swarm's experts "uid_prefix.i.j".

    in_features: the width of x and of the output (the experts' dim).
    grid_size: the expert grid, e.g. (G0, G1) for experts PREFIX.[0:G0].[0:G1].
    k_best: experts chosen per batch. k_min: fewest that must answer the
        forward. forward_timeout: seconds to wait for k_min of them;
        timeout_after_k_min: how much longer to wait for the rest.
    backward_k_min, backward_timeout: the same for backward.
    client: the Client to use (default: a new one on the default socket).
    find_timeout: the beam search's timeout. cache_ttl: seconds a beam
        search's answer is reused for batches with the same best coordinates.

    Attributes after a forward: ``last_experts`` (the ExpertInfo of the
    experts that answered, in the order of the mixture) and
    ``last_scores`` (the detached per-sample scores [batch, E] behind the
    mixture weights).
    """

    def __init__(self, in_features, grid_size=(4, 4), uid_prefix="ffn", k_best=4, k_min=1,
                 forward_timeout=10.0, timeout_after_k_min=1.0, backward_k_min=1,
                 backward_timeout=10.0, client=None, find_timeout=5.0, cache_ttl=5.0):
        super().__init__()
        grid_size = tuple(int(g) for g in grid_size)
        if not 1 <= len(grid_size) <= 4 or min(grid_size) < 1:
            raise ValueError("grid_size must hold 1 to 4 positive sizes")
        if k_min < 1 or k_best < k_min or backward_k_min < 1:
            raise ValueError("need 1 <= k_min <= k_best and backward_k_min >= 1")
        self.in_features = int(in_features)
        self.grid_size = grid_size
        self.uid_prefix = uid_prefix
        self.k_best = int(k_best)
        self.k_min = int(k_min)
        self.forward_timeout = float(forward_timeout)
        self.timeout_after_k_min = float(timeout_after_k_min)
        self.backward_k_min = int(backward_k_min)
        self.backward_timeout = float(backward_timeout)
        self.find_timeout = float(find_timeout)
        self.cache_ttl = float(cache_ttl)
        self.client = client if client is not None else Client()
        self.gate = nn.Linear(self.in_features, sum(grid_size))
        self._offsets = np.cumsum((0,) + grid_size[:-1])
        self._dummy = torch.empty(0, requires_grad=True)
        self._cache = None  # (time, key, experts)
        self.last_experts = []
        self.last_scores = None

    def extra_repr(self):
        return "in_features=%d, grid_size=%s, uid_prefix=%r, k_best=%d, k_min=%d" % (
            self.in_features, self.grid_size, self.uid_prefix, self.k_best, self.k_min)

    def _coords(self, uid):
        """The grid coordinates of uid, or None when it is not in our grid."""
        head = self.uid_prefix + "."
        if not uid.startswith(head):
            return None
        parts = uid[len(head):].split(".")
        if len(parts) != len(self.grid_size):
            return None
        try:
            c = [int(p) for p in parts]
        except ValueError:
            return None
        if any(not 0 <= ci < g for ci, g in zip(c, self.grid_size)):
            return None
        return c

    def find_experts(self, mean_scores):
        """The experts for a batch whose batch-mean coordinate scores are
        mean_scores (one array of G0 + G1 + ...): from the cache when it is
        fresh and the best coordinates are unchanged, else by beam search."""
        rows, at = [], 0
        for g in self.grid_size:
            rows.append(np.asarray(mean_scores[at:at + g], dtype=np.float64))
            at += g
        key = tuple(frozenset(np.argsort(-r, kind="stable")[:self.k_best].tolist())
                    for r in rows)
        now = time.monotonic()
        if self._cache is not None:
            t, k, experts = self._cache
            if k == key and now - t < self.cache_ttl:
                return experts
        found = self.client.find_experts(self.uid_prefix, rows, self.k_best, self.find_timeout)
        experts = [e for e in found if self._coords(e.uid) is not None]
        self._cache = (now, key, experts) if len(experts) >= self.k_min else None
        return experts

    def forget_experts(self):
        """Drops the cached beam-search answer (the next batch searches)."""
        self._cache = None

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError("expected inputs of width %d, got %s" % (self.in_features,
                                                                      tuple(x.shape)))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            raise ValueError("an empty batch")
        scores = self.gate(x2)  # [batch, sum(grid)]
        experts = self.find_experts(scores.detach().mean(0).cpu().double().numpy())
        if len(experts) < self.k_min:
            raise HivemindError("not_enough_experts",
                                "beam search under '%s' found %d experts; k_min is %d"
                                % (self.uid_prefix, len(experts), self.k_min))
        call = _Call(self.client, experts, self.k_min, self.forward_timeout,
                     self.timeout_after_k_min, self.backward_k_min, self.backward_timeout)
        try:
            y = _RemoteExperts.apply(self._dummy, x2, call)  # [E, batch, dim]
        except HivemindError:
            self._cache = None
            raise
        if len(call.answered) < len(experts):
            # Someone did not answer: look again next time.
            self._cache = None
        cols = torch.tensor([[int(self._offsets[d]) + c for d, c in
                              enumerate(self._coords(experts[i].uid))] for i in call.answered],
                            dtype=torch.long, device=scores.device)  # [E, ndims]
        logits = scores[:, cols].sum(-1)  # [batch, E]
        w = torch.softmax(logits, dim=1)
        out = torch.einsum("be,ebd->bd", w.to(y.dtype), y)
        self.last_experts = [experts[i] for i in call.answered]
        self.last_scores = logits.detach()
        return out.reshape(lead + (self.in_features,))
