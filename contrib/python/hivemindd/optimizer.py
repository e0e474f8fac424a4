"""The collaborative optimizer: Hivemind's Optimizer over hivemindd.

A trainer's own torch optimizer is wrapped so that the swarm takes one
step per epoch on the gradients of target_batch_size samples from all its
trainers. This class is a thin wrapper over libhivemind's collaborative
optimizer (hmc_opt_* in lib/hivemind.h): the accumulation, the progress
reports, when an epoch ends, the sample-weighted gradient round, the
fallback to local gradients, catching up and the state averaging are the
C library's, so C and Python trainers of one run are the same optimizer
and meet in the same rounds. Python packs the gradients into one float32
array at each step, and the library calls back into Python for the local
step: the averaged gradients are written to each parameter's .grad and
the wrapped optimizer's step() runs.

    opt = Optimizer(params=model.parameters(), optimizer=torch.optim.Adam(model.parameters()),
                    run_id="fmnist", target_batch_size=4096, batch_size_per_step=64,
                    client=client)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()              # accumulates; steps once per epoch
        print(opt.local_epoch, opt.global_epoch, opt.last_report)
"""

import ctypes
import errno
import logging

import numpy as np

from . import _lib
from .client import HivemindError

__all__ = ["Optimizer"]

log = logging.getLogger("hivemindd.optimizer")


class Optimizer:
    """Hivemind's Optimizer (hivemind.Optimizer's argument names where they
    mean the same).

    params: the parameters (torch tensors, float dtypes; averaged as
        float32). None: those of optimizer's param_groups.
    optimizer: a torch optimizer over them, or a callable that makes one
        from the parameter list (as hivemind allows).
    run_id: the run's name: trainers with one run_id train together.
    target_batch_size: the swarm's samples per epoch (one optimizer step).
    batch_size_per_step: this trainer's samples per step() (or give
        step(batch_size=...)).
    scheduler: an LR scheduler over the wrapped optimizer, or a callable
        that makes one from it; stepped once per epoch, after the step.
    matchmaking_time: seconds to look for a group: matchmaking starts this
        long before the epoch's estimated end, so that the all-reduce
        begins when the samples are in.
    averaging_timeout: the gradient round's deadline; past it (or with no
        group) the trainer steps on its own gradients and logs a warning.
    average_state_every: the parameters are averaged with the peers every
        this many epochs, after the step (0: never).
    average_opt_statistics: names of the wrapped optimizer's per-parameter
        state tensors (e.g. ("exp_avg", "exp_avg_sq") for Adam). They and
        each parameter's "step" count travel with the parameters: averaged
        with them (one round, weight 1; the averaged step is rounded),
        shared with them, and loaded with them by a late trainer. The
        others stay local.
    delay_optimizer_step: the gradient round runs in the background while
        the next epoch accumulates; its step runs in the first step() that
        finds the round over (at the next epoch's end at the latest): the
        parameters are one epoch stale.
    use_local_updates: the wrapped optimizer steps at every step() on that
        step's gradients; no gradient round; at epoch ends (every
        average_state_every epochs, 0 meaning 1) the state is averaged in
        the background and applied by the delta rule (x += average - x at
        the round's start) in the first step() that finds it over, so the
        local steps taken meanwhile are kept. With delay_optimizer_step too
        (Hivemind's pair, with its offload_optimizer): each step()'s local
        step runs in the library's background thread on a copy of the
        parameters that the wrapped optimizer owns (optimizer must then be
        a factory, optimizer=lambda params: ..., given params), and the
        next step() waits for it and copies its result into the model, so
        gradients are taken one local step late (last_report["stepped"]: a
        step landed; ["pending"]: one runs). The optimizer's state and
        param_groups are the copy's.
    client: a hivemindd.Client attached to the local daemon. Its lock is
        held for the whole of a step() that ends an epoch.
    client_mode: this trainer's epoch does not lead and it reduces nothing.
    target_group_size, grad_compression (None/"none", "fp16", "8bit"):
        the rounds'.
    share_state: share the state (parameters, the statistics named in
        average_opt_statistics, the epoch) after each epoch, and load the
        newest from the peers when this trainer is more than one epoch
        behind (it then discards its gradients, takes part in a round it
        had already matched with weight 0, and jumps to the swarm's epoch).
        load_state_timeout: seconds for that download.
    """

    def __init__(self, params=None, optimizer=None, run_id=None, target_batch_size=None,
                 batch_size_per_step=None, scheduler=None, matchmaking_time=5.0,
                 averaging_timeout=30.0, average_state_every=1, delay_optimizer_step=False,
                 use_local_updates=False, client=None, client_mode=False, target_group_size=16,
                 grad_compression=None, share_state=True, load_state_timeout=30.0,
                 average_opt_statistics=()):
        import torch

        if client is None:
            raise ValueError("Optimizer needs a client (hivemindd.Client)")
        if optimizer is None:
            raise ValueError("Optimizer needs a torch optimizer to wrap")
        if not run_id:
            raise ValueError("Optimizer needs a run_id")
        if not target_batch_size or target_batch_size <= 0:
            raise ValueError("target_batch_size must be a positive number of samples")
        # Both: every local step runs in the library's background thread, so
        # the wrapped optimizer steps a copy of the parameters of its own
        # (Hivemind's offload_optimizer), never the model's tensors, which
        # the next forward and backward read meanwhile.
        self._bg = bool(delay_optimizer_step and use_local_updates)
        if params is not None:
            params = [p for p in params]
        if self._bg and (not callable(optimizer) or hasattr(optimizer, "param_groups") or
                         params is None):
            raise ValueError(
                "delay_optimizer_step with use_local_updates steps an offloaded copy of the "
                "parameters: pass params and optimizer as a factory, "
                "optimizer=lambda params: torch.optim.SGD(params, ...)")
        opt_params = params
        if self._bg:
            opt_params = [torch.nn.Parameter(p.detach().cpu().float().clone()) for p in params]
        if callable(optimizer) and not hasattr(optimizer, "param_groups"):
            if params is None:
                raise ValueError("an optimizer factory needs params")
            optimizer = optimizer(opt_params)
        if params is None:
            params = opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError("Optimizer needs at least one parameter")
        self.optimizer = optimizer
        self.params = params
        self._opt_params = opt_params  # what the wrapped optimizer steps
        if scheduler is not None and callable(scheduler) and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        self.scheduler = scheduler
        self.client = client
        self.run_id = run_id
        self.use_local_updates = bool(use_local_updates)
        self.delay_optimizer_step = bool(delay_optimizer_step)
        self.batch_size_per_step = batch_size_per_step
        if isinstance(average_opt_statistics, str):
            average_opt_statistics = (average_opt_statistics,)
        self.average_opt_statistics = tuple(average_opt_statistics or ())
        if not all(isinstance(n, str) and n for n in self.average_opt_statistics):
            raise ValueError("average_opt_statistics names the optimizer's state tensors")
        self.sizes = [int(np.prod(tuple(p.shape))) for p in params]
        # The statistics as one float32 vector: each name's tensor of every
        # parameter, then every parameter's step count.
        self._stat_names = [n for n in self.average_opt_statistics if n != "step"]
        if self._stat_names:
            self._stat_names.append("step")
        self.numel = sum(self.sizes)
        if self.numel == 0:
            raise ValueError("the parameters hold no values")
        self.last_report = None
        self._o = None
        self._cb_error = None
        self._params = np.zeros(self.numel, dtype=np.float32)
        self._grads = np.zeros(self.numel, dtype=np.float32)
        self._pp = self._params.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self._gp = self._grads.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        # Kept referenced: the library calls it for as long as the optimizer lives.
        self._cb = _lib.OPT_STEP_FN(self._local_step)
        self._stats_get_cb = _lib.OPT_STATS_FN(self._stats_get)
        self._stats_set_cb = _lib.OPT_STATS_FN(self._stats_set)

        L = _lib.lib()
        o = _lib.OptOpts()
        L.hmc_opt_opts_init(ctypes.byref(o))
        keep = [run_id.encode()]
        o.run_id = keep[0]
        o.target_batch_size = int(target_batch_size)
        o.batch_size_per_step = int(batch_size_per_step or 0)
        o.matchmaking_time_s = float(matchmaking_time or 0)
        o.averaging_timeout_s = float(averaging_timeout or 0)
        o.average_state_every = int(average_state_every or 0)
        o.client = 1 if client_mode else 0
        o.target_group_size = int(target_group_size or 0)
        if grad_compression is not None:
            keep.append(grad_compression.encode())
            o.compression = keep[-1]
        o.share_state = 1 if share_state else 0
        o.load_timeout_s = float(load_state_timeout or 0)
        o.step = self._cb
        o.delay_step = 1 if delay_optimizer_step else 0
        o.local_updates = 1 if use_local_updates else 0
        if self._stat_names:
            o.n_stats = (len(self._stat_names) - 1) * self.numel + len(params)
            keep.append(",".join(self._stat_names).encode())
            o.stat_names = keep[-1]
            o.stats_get = self._stats_get_cb
            o.stats_set = self._stats_set_cb
        self._gather_params()
        h = ctypes.c_void_p()
        with client._lock:
            r = L.hmc_opt_open(client._handle(), ctypes.byref(o), self.numel, ctypes.byref(h))
            if r == -errno.EINVAL:
                raise ValueError("the library refused these options (EINVAL)")
            if r != 0:
                raise client._error(r)
        del keep
        self._o = h.value

    # ---- packing ----

    def _gather_params(self, into=None, src=None):
        flat = self._params if into is None else into
        at = 0
        for p, n in zip(self.params if src is None else src, self.sizes):
            flat[at:at + n] = p.detach().cpu().reshape(-1).float().numpy()
            at += n

    def _gather_grads(self):
        at = 0
        for p, n in zip(self.params, self.sizes):
            if p.grad is None:
                self._grads[at:at + n] = 0.0
            else:
                self._grads[at:at + n] = p.grad.detach().cpu().reshape(-1).float().numpy()
            at += n

    def _scatter_params(self):
        import torch

        at = 0
        for p, n in zip(self.params, self.sizes):
            t = torch.from_numpy(self._params[at:at + n]).view(p.shape)
            at += n
            with torch.no_grad():
                p.copy_(t.to(device=p.device, dtype=p.dtype))

    def _local_step(self, ud, params, grads, n):
        """The library's step callback: the wrapped optimizer's step on
        the gradients given (the average, or ours), then the parameters
        handed back."""
        import torch

        try:
            g = np.ctypeslib.as_array(grads, (n,))
            x = np.ctypeslib.as_array(params, (n,))
            at = 0
            for p, size in zip(self._opt_params, self.sizes):
                t = torch.from_numpy(g[at:at + size].copy()).view(p.shape)
                if self._bg:
                    # The library's copy: where the delta rule or a load
                    # may have moved the parameters since the last step.
                    with torch.no_grad():
                        p.copy_(torch.from_numpy(x[at:at + size].copy()).view(p.shape))
                at += size
                p.grad = t.to(device=p.device, dtype=p.dtype)
            self.optimizer.step()
            self._gather_params(x, self._opt_params)
        except BaseException as e:  # raised again once back in Python's step()
            self._cb_error = e

    def _stats_get(self, ud, out, n):
        """The library's call for the statistics (to share or average):
        those the optimizer has not made yet are zeros, as Adam starts."""
        try:
            flat = np.ctypeslib.as_array(out, (n,))
            at = 0
            for name in self._stat_names[:-1]:
                for p, size in zip(self._opt_params, self.sizes):
                    t = self.optimizer.state.get(p, {}).get(name)
                    if hasattr(t, "numel") and t.numel() == size:
                        flat[at:at + size] = t.detach().cpu().reshape(-1).float().numpy()
                    else:
                        flat[at:at + size] = 0.0
                    at += size
            for p in self._opt_params:
                step = self.optimizer.state.get(p, {}).get("step", 0)
                flat[at] = float(step)
                at += 1
        except BaseException as e:
            self._cb_error = e

    def _stats_set(self, ud, data, n):
        """The library hands statistics back (loaded or averaged): into
        the optimizer's state, made where it is missing."""
        import torch

        try:
            flat = np.ctypeslib.as_array(data, (n,))
            at = 0
            for name in self._stat_names[:-1]:
                for p, size in zip(self._opt_params, self.sizes):
                    st = self.optimizer.state[p]
                    t = torch.from_numpy(flat[at:at + size].copy()).view(p.shape)
                    at += size
                    old = st.get(name)
                    if hasattr(old, "copy_") and old.shape == p.shape:
                        with torch.no_grad():
                            old.copy_(t.to(device=old.device, dtype=old.dtype))
                    else:
                        st[name] = t.to(device=p.device, dtype=p.dtype)
            for p in self._opt_params:
                st = self.optimizer.state[p]
                step = float(round(float(flat[at])))
                at += 1
                old = st.get("step")
                st["step"] = (torch.tensor(step) if old is None or hasattr(old, "copy_")
                              else type(old)(step))
        except BaseException as e:
            self._cb_error = e

    @staticmethod
    def _report(rep):
        return dict(epoch_ended=bool(rep.epoch_ended), stepped=bool(rep.stepped),
                    stepped_epoch=int(rep.stepped_epoch), averaged=bool(rep.averaged),
                    local_fallback=bool(rep.local_fallback), caught_up=bool(rep.caught_up),
                    state_loaded=bool(rep.state_loaded), state_averaged=bool(rep.state_averaged),
                    pending=bool(rep.pending), epoch=int(rep.epoch),
                    global_epoch=int(rep.global_epoch), samples=int(rep.samples),
                    swarm_samples=int(rep.swarm_samples), group_size=int(rep.group_size),
                    error=_lib.text(rep.error), scheduled=bool(rep.scheduled),
                    matchmaking_lead_s=float(rep.matchmaking_lead_s),
                    tagged_along=bool(rep.tagged_along),
                    state_started=bool(rep.state_started),
                    state_pending=bool(rep.state_pending),
                    held_ahead=bool(rep.held_ahead))

    # ---- the optimizer ----

    @property
    def local_epoch(self):
        """This trainer's epoch: the optimizer steps it has taken part in."""
        return int(_lib.lib().hmc_opt_local_epoch(self._o))

    @property
    def global_epoch(self):
        """The swarm's epoch (the largest of its trainers'), as last read."""
        return int(_lib.lib().hmc_opt_global_epoch(self._o))

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        if self._bg:
            # The model's gradients only: the wrapped optimizer's copy may be
            # stepping on its own on the library's thread right now.
            for p in self.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
            return
        try:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        except TypeError:  # optimizers without the argument
            self.optimizer.zero_grad()

    def step(self, closure=None, batch_size=None):
        """Adds this step's gradients (each parameter's .grad, the mean
        over batch_size samples; default batch_size_per_step) and, when the
        epoch ends, averages them with the swarm's and steps. Returns the
        closure's loss (or None) as torch's step() does; the call's report
        is in last_report (a dict: epoch_ended, stepped, averaged,
        local_fallback, caught_up, state_loaded, state_averaged, pending,
        epoch, global_epoch, samples, swarm_samples, group_size, error,
        scheduled and matchmaking_lead_s: the round was matched that long
        before the epoch's end, tagged_along: behind the swarm, this
        trainer took part in its scheduled round with weight 0,
        held_ahead: past the swarm's epoch, the epoch's end waits for it).
        A failed round is not an exception: it is logged as a warning and
        the step uses this trainer's gradients."""
        import torch

        if self._o is None:
            raise HivemindError("closed", "the optimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bs = batch_size if batch_size is not None else self.batch_size_per_step
        if not bs or bs <= 0:
            raise ValueError("step() needs batch_size (or batch_size_per_step)")
        self._gather_grads()
        if not np.isfinite(self._grads).all():
            raise ValueError("the gradients hold NaN or infinity")
        rep = _lib.OptReport()
        self._cb_error = None
        with self.client._lock:
            r = _lib.lib().hmc_opt_step(self._o, self._gp, int(bs), self._pp, ctypes.byref(rep))
            if r != 0 and self._cb_error is None:
                raise self.client._error(r)
        if self._cb_error is not None:
            e, self._cb_error = self._cb_error, None
            raise e
        # The library wrote the parameters itself (a load, an average, or
        # with both delays a background step landing): hand them to torch.
        if rep.state_loaded or rep.state_averaged or (self._bg and rep.stepped):
            self._scatter_params()
        self.last_report = out = self._report(rep)
        if self._stat_names:
            out["statistics_averaged"] = bool(rep.state_averaged)
            out["statistics_loaded"] = bool(rep.state_loaded)
        if rep.caught_up:
            log.warning("run %s: %s; now at epoch %d", self.run_id,
                        "behind the swarm: gradients discarded, state loaded from a peer"
                        if rep.state_loaded else
                        "behind the swarm: gradients discarded, no state loaded",
                        rep.epoch)
        if rep.stepped and not self.use_local_updates:
            if rep.local_fallback:
                log.warning("run %s epoch %d: stepping on local gradients: %s", self.run_id,
                            rep.stepped_epoch, out["error"])
            if self.scheduler is not None:
                self.scheduler.step()
        elif rep.epoch_ended and self.use_local_updates and self.scheduler is not None:
            self.scheduler.step()
        return loss

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "local_epoch": self.local_epoch}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self):
        if self._o is not None:
            with self.client._lock:
                _lib.lib().hmc_opt_close(self._o)
            self._o = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
