"""RemoteMixtureOfExperts and RemoteSwitchMixtureOfExperts: torch layers
whose experts live on hivemindd hosts anywhere in the swarm, chosen by a
local gate.

The experts form a grid "PREFIX.i.j" (grid_size (G0, G1)); the gate is a
local nn.Linear(in_features, G0 + G1) giving each sample one score per grid
coordinate.

Per-sample routing (routing="sample", the default, as Hivemind's
RemoteMixtureOfExperts):

1. every sample's own beam search over its own coordinate scores chooses
   its k_best experts; the daemon runs the batch's searches as one walk of
   the DHT (experts.route);
2. the batch's rows are grouped by expert: each expert gets one request
   holding the rows of the samples routed to it (experts.forward with
   routes); k_min and timeout_after_k_min count per sample;
3. each sample's mixture weights are the softmax, over its experts that
   answered, of its summed coordinate scores (computed in torch, so the
   gate learns through them); a sample none of whose experts answered gets
   zeros when allow_zero_outputs is set (else the call fails);
4. on backward each expert gets the rows it answered for, with
   grad_output * w, and only the experts whose forward answered are called.

Per-batch routing (routing="batch"): the batch-mean scores choose k_best
experts for the whole batch (experts.find, cached for cache_ttl seconds),
and every expert gets the whole batch.

On backward each expert that answered returns its dL/dx and applies one
optimizer step to its own parameters on its host; the layer's input
gradient is the sum of those plus what flows through the gate. An expert
that does not answer the backward contributes nothing; fewer than
backward_k_min raises.

RemoteSwitchMixtureOfExperts is the Switch Transformer's layer: k_best 1,
k_min 0 with zero outputs allowed (the caller's residual carries a sample
whose expert did not answer), the expert's output scaled by its gate
probability, multiplicative jitter on the gate's input in training, and a
load-balancing loss returned with the output.

Experts compute dim -> dim (hivemindd's ffn expert), so in_features must be
the hosts' --expert-dim.

Transformer experts (--expert-type transformer) take sequences: x
[batch, seq, dim], with an optional key-padding mask ``attention_mask``
[batch, seq] (1 a token, 0 padding, as Hivemind's transformer expert takes
it). RemoteExpert calls one such expert (or an ffn one, with [batch, dim]);
RemoteMixtureOfExperts(sequence_experts=True) sends them [batch, seq, dim],
each sequence one sample of the routing (per sample or per batch), the
gate scoring each sample's mean over its sequence as Hivemind's does
(without it, leading dimensions are rows for ffn experts, as before).
"""

import time

import numpy as np
import torch
from torch import nn

from .client import Client, HivemindError

__all__ = ["RemoteExpert", "RemoteMixtureOfExperts", "RemoteSwitchMixtureOfExperts"]


class _Call:
    """What one forward decided, for its backward."""

    def __init__(self, client, experts, k_min, timeout, after, backward_k_min, backward_timeout,
                 mask=None):
        self.client = client
        self.mask = mask  # numpy [batch, seq] 0/1 for sequences, or None
        self.experts = experts
        self.k_min = k_min
        self.timeout = timeout
        self.after = after
        self.backward_k_min = backward_k_min
        self.backward_timeout = backward_timeout
        self.answered = None           # indices into experts, after forward
        self.backward_answered = None  # booleans per answered expert, after backward


class _RemoteExperts(torch.autograd.Function):
    """Y [E, *x.shape] = the answered experts' outputs on x [batch, dim] or
    [batch, seq, dim] (with call.mask).

    ``dummy`` is an empty tensor that requires grad, so that backward runs
    (and the experts learn) even when x itself needs no gradient."""

    @staticmethod
    def forward(ctx, dummy, x, call):
        xn = x.detach().to("cpu", torch.float32).contiguous().numpy()
        y, answered = call.client.experts_forward(call.experts, xn, call.k_min, call.timeout,
                                                  call.after, mask=call.mask)
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
            experts, xn, gy, min(call.backward_k_min, len(experts)), call.backward_timeout,
            mask=call.mask)
        call.backward_answered = answered
        if not ctx.needs_input_grad[1]:
            return None, None, None
        total = gx[np.asarray(answered, dtype=bool)].sum(axis=0)
        return None, torch.from_numpy(total).to(device=x.device, dtype=x.dtype), None


def _mask_numpy(x, attention_mask, key_padding_mask=None):
    """attention_mask (1 a token, 0 padding) or key_padding_mask (torch's
    convention, which Hivemind's transformer layer passes on: True padding)
    as numpy float32 [batch, seq] of 1 for a token, for x [batch, seq, dim]."""
    if key_padding_mask is not None:
        if attention_mask is not None:
            raise ValueError("give attention_mask or key_padding_mask, not both")
        attention_mask = ~key_padding_mask.to(torch.bool)
    if attention_mask is None:
        return None
    if x.dim() != 3:
        raise ValueError("attention_mask goes with inputs [batch, seq, dim]")
    m = attention_mask.detach().to("cpu")
    if tuple(m.shape) != tuple(x.shape[:2]):
        raise ValueError("attention_mask must be [batch, seq] = %s, not %s"
                         % (tuple(x.shape[:2]), tuple(m.shape)))
    return m.to(torch.float32).contiguous().numpy()


class RemoteExpert(nn.Module):
    """One expert on a hivemindd host, as a torch module (Hivemind's
    RemoteExpert): forward(x) is the expert's output on x, [batch, dim] for
    an ffn expert or [batch, seq, dim] for a transformer expert, with an
    optional key-padding ``attention_mask`` [batch, seq] (1 a token, 0
    padding) for the latter, or ``key_padding_mask``, its complement in
    torch's convention (True padding, as nn.MultiheadAttention and
    Hivemind's transformer layer take it). Backward sends dL/dy to the host, which
    returns dL/dx and applies one optimizer step to the expert.

    expert: an ExpertInfo or a (uid, peer) pair ("PEERID@HOST:PORT"), as
    Client.find_experts gives them. A host's refusal (a wrong shape, a
    sequence over its ExpertMaxSeq) raises HivemindError with its code
    ("expert_wrong_shape", ...) and the host's reason."""

    def __init__(self, expert, client=None, forward_timeout=10.0, backward_timeout=10.0):
        super().__init__()
        self.expert = tuple(expert)[:2]
        self.uid = self.expert[0]
        self.client = client if client is not None else Client()
        self.forward_timeout = float(forward_timeout)
        self.backward_timeout = float(backward_timeout)
        self._dummy = torch.empty(0, requires_grad=True)

    def extra_repr(self):
        return "uid=%r" % (self.uid,)

    def forward(self, x, attention_mask=None, key_padding_mask=None):
        if x.dim() not in (2, 3):
            raise ValueError("x must be [batch, dim] or [batch, seq, dim], not %s"
                             % (tuple(x.shape),))
        call = _Call(self.client, [self.expert], 1, self.forward_timeout, 1.0, 1,
                     self.backward_timeout, _mask_numpy(x, attention_mask, key_padding_mask))
        return _RemoteExperts.apply(self._dummy, x, call)[0]


class _RoutedCall:
    """What one routed forward decided, for its backward."""

    def __init__(self, client, experts, routes, k_min, allow_zero, timeout, after,
                 backward_k_min, backward_timeout, mask=None):
        self.client = client
        self.experts = experts
        self.mask = mask              # numpy [batch, seq] 0/1 for sequences, or None
        self.routes = routes          # [batch, k] int32, -1: none
        self.k_min = k_min
        self.allow_zero = allow_zero
        self.timeout = timeout
        self.after = after
        self.backward_k_min = backward_k_min
        self.backward_timeout = backward_timeout
        self.live = None              # [batch, k] bool: the slot's expert answered the forward
        self.backward_live = None     # [batch, k] bool, after backward


class _RoutedExperts(torch.autograd.Function):
    """Y [batch, k, dim] (or [batch, k, seq, dim] for x [batch, seq, dim]):
    slot j of sample b the output of its expert routes[b, j] on x[b]
    (zeros where none answered)."""

    @staticmethod
    def forward(ctx, dummy, x, call):
        xn = x.detach().to("cpu", torch.float32).contiguous().numpy()
        y, answered = call.client.experts_forward_routed(
            call.experts, call.routes, xn, call.k_min, call.allow_zero, call.timeout, call.after,
            mask=call.mask)
        ans = np.asarray(answered, dtype=bool)
        call.live = (call.routes >= 0) & ans[np.maximum(call.routes, 0)]
        ctx.call = call
        ctx.save_for_backward(x)
        return torch.from_numpy(y).to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        call = ctx.call
        # Backward goes only to the experts whose forward answered for those rows.
        routes = np.where(call.live, call.routes, -1).astype(np.int32)
        total = None
        if call.live.any():
            xn = x.detach().to("cpu", torch.float32).contiguous().numpy()
            gy = grad_y.detach().to("cpu", torch.float32).contiguous().numpy()
            gx, answered = call.client.experts_backward_routed(
                call.experts, routes, xn, gy, call.backward_k_min,
                call.allow_zero or call.backward_k_min == 0, call.backward_timeout,
                mask=call.mask)
            ans = np.asarray(answered, dtype=bool)
            call.backward_live = (routes >= 0) & ans[np.maximum(routes, 0)]
            total = gx.sum(axis=1)  # zeros in the slots that did not answer
        else:
            call.backward_live = np.zeros_like(call.live)
        if not ctx.needs_input_grad[1]:
            return None, None, None
        if total is None:
            return None, torch.zeros_like(x), None
        return None, torch.from_numpy(total).to(device=x.device, dtype=x.dtype), None


class RemoteMixtureOfExperts(nn.Module):
    """A mixture-of-experts layer over the swarm's experts "uid_prefix.i.j".

    in_features: the width of x and of the output (the experts' dim).
    grid_size: the expert grid, e.g. (G0, G1) for experts PREFIX.[0:G0].[0:G1].
    routing: "sample" (each sample's own beam search chooses its experts;
        the default) or "batch" (the batch-mean scores choose them for the
        whole batch).
    k_best: experts chosen per sample (per batch with routing="batch").
    k_min: fewest that must answer the forward, per sample (per batch with
        routing="batch"). forward_timeout: seconds to wait for them;
        timeout_after_k_min: how much longer to wait for the rest.
    backward_k_min, backward_timeout: the same for backward.
    allow_zero_outputs: a sample none of whose experts answered gets zeros
        rather than failing the call; k_min and backward_k_min may then be
        0 (routing="sample" only).
    beam_size: the per-sample beam (0: k_best); at least the grid's largest
        dimension makes every sample's choice its exact top k_best.
    sequence_experts: the experts are transformers (--expert-type
        transformer): forward(x, attention_mask=None) takes x [batch, seq,
        dim] and an optional key-padding mask [batch, seq] (1 a token, 0
        padding); the gate scores each sample's mean over its sequence, and
        each sequence is one sample of the routing.
    client: the Client to use (default: a new one on the default socket).
    find_timeout: the beam search's timeout. cache_ttl (routing="batch"):
        seconds a beam search's answer is reused for batches with the same
        best coordinates.

    Attributes after a forward: ``last_experts`` (the ExpertInfo of the
    experts: with routing="sample" every expert some sample was routed to,
    with routing="batch" those that answered, in the order of the mixture)
    and ``last_scores`` (the detached logits behind the mixture weights,
    [batch, k]); with routing="sample" also ``last_routes`` ([batch, k]
    indices into last_experts, -1: none) and ``last_mask`` ([batch, k]
    bools: the slot's expert answered).
    """

    def __init__(self, in_features, grid_size=(4, 4), uid_prefix="ffn", k_best=4, k_min=1,
                 forward_timeout=10.0, timeout_after_k_min=1.0, backward_k_min=1,
                 backward_timeout=10.0, client=None, find_timeout=5.0, cache_ttl=5.0,
                 routing="sample", beam_size=0, allow_zero_outputs=False,
                 sequence_experts=False):
        super().__init__()
        self.sequence_experts = bool(sequence_experts)
        grid_size = tuple(int(g) for g in grid_size)
        if not 1 <= len(grid_size) <= 4 or min(grid_size) < 1:
            raise ValueError("grid_size must hold 1 to 4 positive sizes")
        if routing not in ("sample", "batch"):
            raise ValueError("routing must be 'sample' or 'batch'")
        if allow_zero_outputs and routing != "sample":
            raise ValueError("allow_zero_outputs needs routing='sample'")
        lo = 0 if allow_zero_outputs else 1
        if k_min < lo or k_best < max(k_min, 1) or backward_k_min < lo:
            raise ValueError("need %d <= k_min <= k_best and backward_k_min >= %d "
                             "(0 only with allow_zero_outputs)" % (lo, lo))
        self.routing = routing
        self.beam_size = int(beam_size)
        self.allow_zero_outputs = bool(allow_zero_outputs)
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
        self.last_routes = None
        self.last_mask = None

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

    def _gate_scores(self, x2):
        """The gate's coordinate scores [batch, sum(grid)] (the Switch layer adds jitter)."""
        return self.gate(x2)

    def _slot_logits(self, scores, experts, routes):
        """logits [batch, k]: slot j of sample b the summed coordinate
        scores of its expert routes[b, j] (0 where there is none)."""
        coords = np.zeros((max(len(experts), 1), len(self.grid_size)), dtype=np.int64)
        for i, e in enumerate(experts):
            coords[i] = self._coords(e.uid)
        cols = torch.as_tensor(coords + self._offsets[None, :], device=scores.device)
        idx = cols[torch.as_tensor(np.maximum(routes, 0).astype(np.int64), device=scores.device)]  # [b, k, nd]
        return torch.gather(scores, 1, idx.flatten(1)).view(idx.shape).sum(-1)

    def route(self, scores):
        """Per-sample routing of a batch with gate scores [batch, sum(grid)]:
        ``(experts, routes)`` as Client.route_experts gives them, experts
        outside the grid left out (their slots -1)."""
        experts, routes = self.client.route_experts(
            self.uid_prefix, self.grid_size, scores.detach().cpu().float().numpy(), self.k_best,
            self.beam_size, self.find_timeout)
        keep = np.array([self._coords(e.uid) is not None for e in experts] + [False])
        routes = np.where(keep[np.where(routes >= 0, routes, len(experts))], routes, -1)
        return experts, routes.astype(np.int32)

    def _forward_sample(self, x2, scores, mask=None):
        experts, routes = self.route(scores)
        found = (routes >= 0).sum(1)
        if not self.allow_zero_outputs and (found < self.k_min).any():
            b = int(np.argmax(found < self.k_min))
            raise HivemindError("not_enough_experts",
                                "beam search under '%s' found %d experts for sample %d; k_min "
                                "is %d" % (self.uid_prefix, int(found[b]), b, self.k_min))
        if not experts:
            # Zero outputs allowed and nothing found: every sample gets zeros.
            self.last_experts, self.last_routes = [], routes
            self.last_mask = np.zeros(routes.shape, dtype=bool)
            self.last_scores = torch.zeros(routes.shape)
            return x2 * 0.0, None, routes, self.last_mask
        call = _RoutedCall(self.client, experts, routes, self.k_min, self.allow_zero_outputs,
                           self.forward_timeout, self.timeout_after_k_min, self.backward_k_min,
                           self.backward_timeout, mask)
        y = _RoutedExperts.apply(self._dummy, x2, call)  # [batch, k, (seq,) dim]
        live = torch.as_tensor(call.live, device=scores.device)
        logits = self._slot_logits(scores, experts, routes)
        masked = logits.masked_fill(~live, float("-inf"))
        # A sample with no answer has weights 0, not the NaN of an empty softmax.
        any_live = live.any(1, keepdim=True)
        w = torch.softmax(torch.where(any_live, masked, torch.zeros_like(masked)), dim=1)
        w = w * live.to(w.dtype)
        out = torch.einsum("bk,bk...->b...", w.to(y.dtype), y)
        self.last_experts = experts
        self.last_routes = routes
        self.last_mask = call.live
        self.last_scores = logits.detach()
        return out, y, routes, call.live

    def forward(self, x, attention_mask=None, key_padding_mask=None):
        if x.shape[-1] != self.in_features:
            raise ValueError("expected inputs of width %d, got %s" % (self.in_features,
                                                                      tuple(x.shape)))
        if self.sequence_experts:
            return self._forward_seq(x, attention_mask, key_padding_mask)
        if attention_mask is not None or key_padding_mask is not None:
            raise ValueError("attention_mask goes with sequence_experts=True")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            raise ValueError("an empty batch")
        if self.routing == "sample":
            out = self._forward_sample(x2, self._gate_scores(x2))[0]
            return out.reshape(lead + (self.in_features,))
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

    def _forward_seq(self, x, attention_mask, key_padding_mask=None):
        """x [batch, seq, dim] to transformer experts. The gate scores each
        sample's mean over its sequence (Hivemind's input_for_gating);
        routing="sample" routes each sequence on those scores (the rows of
        an expert's request are whole sequences, each with its mask);
        routing="batch" chooses the experts by the batch mean, and every
        expert gets the whole batch with the mask."""
        if x.dim() != 3:
            raise ValueError("sequence_experts take x [batch, seq, dim], not %s"
                             % (tuple(x.shape),))
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError("an empty batch")
        mask = _mask_numpy(x, attention_mask, key_padding_mask)
        if self.routing == "sample":
            # Each sequence is a sample: its own beam search, its own experts.
            return self._forward_sample(x, self._gate_scores(x.mean(dim=1)), mask)[0]
        scores = self.gate(x.mean(dim=1))  # [batch, sum(grid)]
        experts = self.find_experts(scores.detach().mean(0).cpu().double().numpy())
        if len(experts) < self.k_min:
            raise HivemindError("not_enough_experts",
                                "beam search under '%s' found %d experts; k_min is %d"
                                % (self.uid_prefix, len(experts), self.k_min))
        call = _Call(self.client, experts, self.k_min, self.forward_timeout,
                     self.timeout_after_k_min, self.backward_k_min, self.backward_timeout,
                     mask)
        try:
            y = _RemoteExperts.apply(self._dummy, x, call)  # [E, batch, seq, dim]
        except HivemindError:
            self._cache = None
            raise
        if len(call.answered) < len(experts):
            self._cache = None
        cols = torch.tensor([[int(self._offsets[d]) + c for d, c in
                              enumerate(self._coords(experts[i].uid))] for i in call.answered],
                            dtype=torch.long, device=scores.device)
        logits = scores[:, cols].sum(-1)  # [batch, E]
        w = torch.softmax(logits, dim=1)
        out = torch.einsum("be,ebsd->bsd", w.to(y.dtype), y)
        self.last_experts = [experts[i] for i in call.answered]
        self.last_scores = logits.detach()
        return out

class RemoteSwitchMixtureOfExperts(RemoteMixtureOfExperts):
    """A Switch Transformer layer (Fedus et al., 2021) over the swarm's
    experts: each sample goes to its one best expert (k_best 1, routed per
    sample); a sample whose expert did not answer gets zeros
    (allow_zero_outputs, k_min 0), so use it inside a residual block
    (x + layer(x)[0]).

    forward(x) returns ``(output, balancing_loss)``:
      - output[b] = p_b(e_b) * y_b, the expert's output scaled by the gate's
        probability of that expert, p_b(e) = prod_d softmax(s_bd)[e_d] over
        the grid, so that the task's loss trains the gate;
      - balancing_loss = n_experts * sum_e f_e * P_e, with n_experts the
        grid's size, f_e the fraction of the batch's samples routed to e
        (constant in the backward) and P_e the batch mean of p_b(e): it is
        1 when the routing is uniform and grows as it concentrates, and its
        gradient reaches the gate through P. Add it to the loss with a
        small factor (the paper uses 0.01).
    In training, the gate's input is multiplied by uniform noise in
    [1 - jitter_eps, 1 + jitter_eps] (the experts get x as it is).
    """

    def __init__(self, in_features, grid_size=(4, 4), uid_prefix="ffn", k_min=0,
                 forward_timeout=10.0, timeout_after_k_min=1.0, backward_k_min=0,
                 backward_timeout=10.0, client=None, find_timeout=5.0, beam_size=0,
                 jitter_eps=1e-2, allow_zero_outputs=True):
        super().__init__(in_features, grid_size=grid_size, uid_prefix=uid_prefix, k_best=1,
                         k_min=k_min, forward_timeout=forward_timeout,
                         timeout_after_k_min=timeout_after_k_min, backward_k_min=backward_k_min,
                         backward_timeout=backward_timeout, client=client,
                         find_timeout=find_timeout, routing="sample", beam_size=beam_size,
                         allow_zero_outputs=allow_zero_outputs)
        if not 0 <= jitter_eps < 1:
            raise ValueError("jitter_eps must be in [0, 1)")
        self.jitter_eps = float(jitter_eps)
        self.n_experts = int(np.prod(self.grid_size))
        self.last_balancing_loss = None

    def _gate_scores(self, x2):
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x2).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x2 = x2 * noise
        return self.gate(x2)

    def _probs(self, scores, coords):
        """p_b(e) [batch, n] for the experts with grid coordinates coords [n, ndims]."""
        p = None
        for d, g in enumerate(self.grid_size):
            at = int(self._offsets[d])
            sm = torch.softmax(scores[:, at:at + g], dim=1)[:, coords[:, d]]
            p = sm if p is None else p * sm
        return p

    def balancing_loss(self, scores, experts, routes):
        """n_experts * sum_e f_e * P_e for a batch's gate scores and routes."""
        first = routes[:, 0]
        used = np.unique(first[first >= 0])
        if used.size == 0:
            return scores.sum() * 0.0
        coords = torch.as_tensor(np.array([self._coords(experts[i].uid) for i in used]),
                                 device=scores.device)
        f = torch.as_tensor([(first == i).mean() for i in used], dtype=scores.dtype,
                            device=scores.device)
        P = self._probs(scores, coords).mean(0)
        return self.n_experts * (f * P).sum()

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError("expected inputs of width %d, got %s" % (self.in_features,
                                                                      tuple(x.shape)))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            raise ValueError("an empty batch")
        scores = self._gate_scores(x2)
        out, y, routes, live = self._forward_sample(x2, scores)
        if y is not None:
            coords = np.zeros((len(self.last_experts), len(self.grid_size)), dtype=np.int64)
            for i, e in enumerate(self.last_experts):
                coords[i] = self._coords(e.uid)
            r0 = np.maximum(routes[:, 0], 0)
            sm = None
            for d, g in enumerate(self.grid_size):
                at = int(self._offsets[d])
                c = torch.as_tensor(coords[r0, d], device=scores.device)[:, None]
                p = torch.softmax(scores[:, at:at + g], dim=1).gather(1, c)[:, 0]
                sm = p if sm is None else sm * p
            gate_p = sm * torch.as_tensor(live[:, 0], dtype=sm.dtype, device=sm.device)
            out = gate_p[:, None].to(y.dtype) * y[:, 0]
        loss = self.balancing_loss(scores, self.last_experts, routes)
        self.last_balancing_loss = loss.detach()
        return out.reshape(lead + (self.in_features,)), loss
