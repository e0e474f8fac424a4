"""DiLoCo: H inner steps with the trainer's own optimizer, then an outer
Nesterov SGD step on the swarm's average pseudo-gradient.

This class is a thin wrapper over libhivemind's DiLoCo (hmc_diloco_* in
lib/hivemind.h, section "DiLoCo"): the round naming, the averaging, the
outer arithmetic (torch.optim.SGD with nesterov=True, in float32), the
handling of a missed round and the outer state that newcomers load are
the C library's, so that C and Python trainers of one run are the same
optimizer, meet in the same rounds and load each other's state. Python
only packs the parameters into one float32 array at each outer step and
writes the result back.

    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), 1e-3),
                 run_id="fmnist", inner_steps=100, client=client)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        report = opt.step()     # a dict after an outer step, else None
"""

import ctypes
import errno

import numpy as np

from . import _lib
from .client import HivemindError

__all__ = ["DiLoCo"]


class DiLoCo:
    """DiLoCo over ``params`` (torch tensors, float dtypes; averaged and
    stepped as float32).

    params: the parameters the inner optimizer trains (an iterable).
    inner_optimizer: a torch optimizer over them; step()/zero_grad() are
        passed on to it.
    run_id: the run's name: trainers with one run_id train together.
    inner_steps: H, the inner steps between two outer steps.
    outer_lr, outer_momentum: the outer Nesterov SGD's (0.7, 0.9).
    compression: None/"none", "fp16" or "8bit": the pseudo-gradient's wire
        format.
    client: a Client attached to the local daemon.
    weight: this trainer's weight in the average (e.g. its batch size).
    timeout, matchmaking_time, round_timeout, target_group_size,
        min_group_size: the averaging round's, as Averager's (None: the
        daemon's defaults).
    load_state: load the peers' outer state at construction (a newcomer's
        parameters become the run's); share_state: share ours after each
        outer step. load_timeout: seconds for that download;
        state_min_agree: donors (network origins) that must agree on it.
    catch_up: after a missed round, load the run's state when peers share a
        later round than ours (a trainer that fell behind rejoins; the
        report says caught_up).

    Trainers that start a run together must start from the same
    parameters (the same seed), or start one first and let the others
    load its state.
    """

    def __init__(self, params, inner_optimizer, run_id, inner_steps=500, outer_lr=0.7,
                 outer_momentum=0.9, compression=None, client=None, weight=1.0, timeout=None,
                 matchmaking_time=None, round_timeout=None, target_group_size=None,
                 min_group_size=None, load_state=True, share_state=True, load_timeout=30.0,
                 state_min_agree=1, catch_up=True):
        import torch  # noqa: F401  (parameters are torch tensors)

        if client is None:
            raise ValueError("DiLoCo needs a client (hivemindd.Client)")
        self.client = client
        self.inner_optimizer = inner_optimizer
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("DiLoCo needs at least one parameter")
        self.sizes = [int(np.prod(tuple(p.shape))) for p in self.params]
        self.numel = sum(self.sizes)
        if self.numel == 0:
            raise ValueError("the parameters hold no values")
        self.run_id = run_id
        self.last_report = None
        self._flat = np.zeros(self.numel, dtype=np.float32)
        self._ptr = self._flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

        L = _lib.lib()
        o = _lib.DiLoCoOpts()
        L.hmc_diloco_opts_init(ctypes.byref(o))
        keep = [run_id.encode()]
        o.run_id = keep[0]
        o.inner_steps = int(inner_steps)
        o.outer_lr = float(outer_lr)
        o.outer_momentum = float(outer_momentum)
        o.weight = float(weight)
        if compression is not None:
            keep.append(compression.encode())
            o.compression = keep[-1]
        o.timeout_s = float(timeout or 0)
        o.matchmaking_time_s = float(matchmaking_time or 0)
        o.round_timeout_s = float(round_timeout or 0)
        o.target_group_size = int(target_group_size or 0)
        o.min_group_size = int(min_group_size or 0)
        o.load_state = 1 if load_state else 0
        o.share_state = 1 if share_state else 0
        o.load_timeout_s = float(load_timeout)
        o.state_min_agree = int(state_min_agree)
        o.catch_up = 1 if catch_up else 0
        d = ctypes.c_void_p()
        with client._lock:
            r = L.hmc_diloco_open(client._handle(), ctypes.byref(o), self.numel, ctypes.byref(d))
            if r != 0:
                raise client._error(r)
        del keep
        self._d = d.value
        self._gather()
        rep = _lib.DiLoCoReport()
        with client._lock:
            r = L.hmc_diloco_begin(self._d, self._ptr, ctypes.byref(rep))
        if r != 0:
            self.close()
            raise ValueError("the parameters hold NaN or infinity")
        self.start_report = self._report(rep, begin=True)
        if rep.loaded:
            self._scatter()

    # ---- packing ----

    def _gather(self):
        at = 0
        for p, n in zip(self.params, self.sizes):
            self._flat[at:at + n] = p.detach().cpu().reshape(-1).float().numpy()
            at += n

    def _scatter(self):
        import torch

        at = 0
        for p, n in zip(self.params, self.sizes):
            t = torch.from_numpy(self._flat[at:at + n]).view(p.shape)
            at += n
            with torch.no_grad():
                p.copy_(t.to(device=p.device, dtype=p.dtype))

    @staticmethod
    def _report(rep, begin=False):
        out = dict(round=int(rep.round), shared=bool(rep.shared), status=int(rep.status),
                   code=_lib.text(rep.code), error=_lib.text(rep.error))
        if begin:
            out.update(loaded=bool(rep.loaded), load_s=rep.average_s)
        else:
            out.update(averaged=bool(rep.averaged), group_size=int(rep.group_size),
                       caught_up=bool(rep.caught_up),
                       average_s=rep.average_s, pseudo_grad_norm=rep.pseudo_grad_norm)
        return out

    # ---- the optimizer ----

    @property
    def outer_round(self):
        """Outer steps taken so far (the next round's number)."""
        return int(_lib.lib().hmc_diloco_round(self._d))

    @property
    def local_step(self):
        """Inner steps since the last outer step."""
        return int(_lib.lib().hmc_diloco_inner_count(self._d))

    def zero_grad(self, set_to_none=True):
        try:
            self.inner_optimizer.zero_grad(set_to_none=set_to_none)
        except TypeError:  # optimizers without the argument
            self.inner_optimizer.zero_grad()

    def step(self, closure=None):
        """One inner step (the inner optimizer's), and the outer step once
        inner_steps have been taken since the last. Returns the outer
        step's report (a dict: round, averaged, group_size, caught_up, code,
        error, average_s, pseudo_grad_norm, shared) or None. A missed round is not
        an exception: the report says averaged False and why (code)."""
        if closure is not None:
            self.inner_optimizer.step(closure)
        else:
            self.inner_optimizer.step()
        L = _lib.lib()
        if L.hmc_diloco_inner_done(self._d) != 1:
            return None
        return self.outer_step()

    def outer_step(self):
        """The outer step now, whatever the inner count; returns its report."""
        L = _lib.lib()
        self._gather()
        rep = _lib.DiLoCoReport()
        with self.client._lock:
            r = L.hmc_diloco_outer_step(self._d, self._ptr, ctypes.byref(rep))
        if r != 0:
            if r == -errno.EDOM:
                raise HivemindError("EDOM", "the outer step was refused: the parameters hold "
                                    "NaN or infinity", -r)
            raise HivemindError("E%d" % -r, "the outer step failed", -r)
        self._scatter()
        self.last_report = self._report(rep)
        return self.last_report

    def outer_state(self):
        """Copies of the outer parameters and the momentum (flat float32)."""
        L = _lib.lib()
        outer = np.ctypeslib.as_array(L.hmc_diloco_outer_params(self._d), (self.numel,)).copy()
        mom = np.ctypeslib.as_array(L.hmc_diloco_momentum(self._d), (self.numel,)).copy()
        return outer, mom

    def state_dict(self):
        return {"inner": self.inner_optimizer.state_dict(), "outer_round": self.outer_round}

    def close(self):
        if self._d is not None:
            with self.client._lock:
                _lib.lib().hmc_diloco_close(self._d)
            self._d = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
