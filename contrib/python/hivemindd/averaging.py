"""Averager: averages a list of parameters (torch tensors or numpy arrays)
with the swarm through the local daemon.

All parameters are packed into one shared float32 buffer (in list order,
each flattened), so one round averages them all. ``step()`` averages
synchronously and writes the mean back into the parameters. ``start()``,
``poll()`` and ``apply()`` run a round in the background while training
goes on, and apply it as a delayed update: ``param += averaged -
snapshot``, where the snapshot is the value the round started from, so the
local progress made during the round is kept.
"""

import ctypes
import errno
import json

import numpy as np

from . import _lib
from .client import HivemindError

__all__ = ["Averager"]


def _is_torch(p):
    return type(p).__module__.startswith("torch")


class Averager:
    """Averages ``params`` under ``prefix`` with the other trainers of the
    swarm that average under the same prefix.

    client: a Client attached to the local daemon.
    params: a list of torch tensors (parameters included) or numpy arrays
        (writable); any float dtype, averaged as float32.
    target_group_size: the largest group, and the size at which a leader
        starts at once (None: the daemon's default, 16).
    min_group_size: the smallest group a leader starts with at its deadline
        (None: the daemon's default, 2).
    timeout: seconds to look for a group. round_timeout: the all-reduce's
        deadline. matchmaking_time: one matchmaking attempt's length.
    compression: None/"none", "fp16" or "8bit" (the wire format).
    client_mode: reduce nothing, only send and receive.
    """

    def __init__(self, client, prefix, params, target_group_size=None, min_group_size=None,
                 timeout=30.0, round_timeout=None, matchmaking_time=None, compression=None,
                 group_bits=None, client_mode=False):
        if not prefix:
            raise ValueError("an Averager needs a prefix")
        self.client = client
        self.prefix = prefix
        self.params = list(params)
        if not self.params:
            raise ValueError("an Averager needs at least one parameter")
        self.sizes = [int(np.prod(tuple(p.shape))) for p in self.params]
        self.numel = sum(self.sizes)
        if self.numel == 0:
            raise ValueError("the parameters hold no values")
        self._opts = dict(target_group_size=target_group_size, min_group_size=min_group_size,
                          timeout=timeout, round_timeout=round_timeout,
                          matchmaking_time=matchmaking_time, compression=compression,
                          group_bits=group_bits, client_mode=client_mode)
        self._buf = client.buffer(self.numel * 4)
        self._flat = self._buf.numpy(np.float32, self.numel)
        self._round = None
        self._snapshot = None
        self._keep = None
        self.last_report = None

    # ---- packing ----

    def _gather(self):
        """Copies the parameters into the shared buffer."""
        at = 0
        for p, n in zip(self.params, self.sizes):
            if _is_torch(p):
                self._flat[at:at + n] = p.detach().cpu().reshape(-1).float().numpy()
            else:
                self._flat[at:at + n] = np.asarray(p).reshape(-1)
            at += n

    def _scatter(self, values, add):
        """Writes values (a flat float32 array) into the parameters, or adds
        them when add is true."""
        at = 0
        for p, n in zip(self.params, self.sizes):
            v = values[at:at + n]
            at += n
            if _is_torch(p):
                import torch

                t = torch.from_numpy(v).view(p.shape).to(device=p.device, dtype=p.dtype)
                with torch.no_grad():
                    if add:
                        p.add_(t)
                    else:
                        p.copy_(t)
            else:
                if add:
                    p += v.reshape(p.shape).astype(p.dtype, copy=False)
                else:
                    p[...] = v.reshape(p.shape)

    def _opts_struct(self, weight):
        """The hmc_avg_opts, and the bytes objects it points at (kept alive
        by the caller for the call)."""
        o = _lib.AvgOpts()
        _lib.lib().hmc_avg_opts_init(ctypes.byref(o))
        keep = [self.prefix.encode()]
        o.prefix = keep[0]
        weight = float(weight)
        if not np.isfinite(weight) or weight < 0:
            raise ValueError("the weight must be finite and >= 0")
        o.weight = weight
        opts = self._opts
        o.timeout_s = float(opts["timeout"] or 0)
        o.round_timeout_s = float(opts["round_timeout"] or 0)
        o.matchmaking_time_s = float(opts["matchmaking_time"] or 0)
        o.target_group_size = int(opts["target_group_size"] or 0)
        o.min_group_size = int(opts["min_group_size"] or 0)
        for field in ("compression", "group_bits"):
            if opts[field] is not None:
                keep.append(opts[field].encode())
                setattr(o, field, keep[-1])
        o.client_mode = 1 if opts["client_mode"] else 0
        return o, keep

    # ---- synchronous ----

    def step(self, weight=1.0):
        """Averages the parameters with the swarm now, with this trainer's
        ``weight`` (e.g. its number of samples), and writes the mean back.
        Returns the round's report (a dict: group, members, spans, bytes,
        durations). A failed round raises HivemindError ("no_group",
        "timeout", ...) and leaves the parameters as they were."""
        if self._round is not None:
            raise RuntimeError("a background round is running; apply() it first")
        o, keep = self._opts_struct(weight)
        out = ctypes.c_void_p()
        self._gather()
        c = self.client
        with c._lock:
            r = _lib.lib().hmc_average(c._handle(), self._buf.handle, 0, self.numel,
                                       ctypes.byref(o), ctypes.byref(out))
            if r != 0:
                raise c._error(r)
        del keep
        report = json.loads(_lib.take_string(out.value))
        self._scatter(self._flat, add=False)
        self.last_report = report
        return report

    # ---- background ----

    @property
    def running(self):
        """Whether a background round was started and not yet applied."""
        return self._round is not None

    def start(self, weight=1.0):
        """Starts a background round from the parameters' current values (the
        snapshot) and returns at once. Train on; call ``poll()`` now and then
        and ``apply()`` once it is True."""
        if self._round is not None:
            raise RuntimeError("a background round is already running")
        o, keep = self._opts_struct(weight)
        self._gather()
        self._snapshot = self._flat.copy()
        rnd = ctypes.c_void_p()
        c = self.client
        with c._lock:
            r = _lib.lib().hmc_average_start(c._handle(), self._buf.handle, 0, self.numel,
                                             ctypes.byref(o), ctypes.byref(rnd))
            if r != 0:
                self._snapshot = None
                raise c._error(r)
        del keep
        self._round = rnd.value

    def poll(self):
        """True once the background round is over (averaged or failed);
        never blocks. False when none runs."""
        if self._round is None:
            return False
        return _lib.lib().hmc_round_done(self._round) == 1

    def apply(self, timeout=None):
        """Waits for the background round (``timeout`` seconds; None: up to
        the round's own deadline) and applies it: ``param += averaged -
        snapshot``. Returns the report. A round that failed raises
        HivemindError and leaves the parameters alone; one still running
        after ``timeout`` raises TimeoutError and keeps running (call again).
        """
        if self._round is None:
            raise RuntimeError("no background round to apply; start() one first")
        L = _lib.lib()
        ms = -1 if timeout is None else max(0, int(round(timeout * 1000)))
        out = ctypes.c_void_p()
        r = L.hmc_round_wait(self._round, ms, ctypes.byref(out))
        if r == -errno.EAGAIN:
            raise TimeoutError("the averaging round under %r is still running" % self.prefix)
        rnd, self._round = self._round, None
        snapshot, self._snapshot = self._snapshot, None
        try:
            if r != 0:
                code = _lib.text(L.hmc_round_error_code(rnd))
                msg = _lib.text(L.hmc_round_error(rnd))
                raise HivemindError(code or "E%d" % -r, msg, -r)
            report = json.loads(_lib.take_string(out.value))
        finally:
            L.hmc_round_free(rnd)
        self._scatter(self._flat - snapshot, add=True)
        self.last_report = report
        return report

    def close(self):
        """Frees the shared buffer. A round still running is abandoned: the
        daemon finishes it on its own mapping of the segment."""
        if self._round is not None:
            _lib.lib().hmc_round_free(self._round)
            self._round = None
        if self._buf is not None:
            self._flat = None
            self._buf.free()
            self._buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
