"""Client, SharedBuffer and HivemindError: a trainer's connection to its
local hivemindd (through libhivemind), shared-memory buffers seen as numpy
arrays and torch tensors without copies, and the numpy-level expert calls
(find, forward, backward) that RemoteMixtureOfExperts is built on.

Tensors never travel through the control socket: the daemon allocates a
shared-memory segment, the library maps it, and numpy/torch look at the
mapped bytes directly. A Client keeps a few scratch buffers for expert
calls and grows them when a call needs more.
"""

import ctypes
import errno as _errno
import json
import threading
from collections import namedtuple

import numpy as np

from . import _lib

__all__ = ["HivemindError", "Client", "SharedBuffer", "ExpertInfo"]


class HivemindError(Exception):
    """A call failed. ``code`` is the daemon's machine-readable code when the
    daemon refused the request ("bad_args", "no_group", "timeout", ...), else
    the name of the local errno ("ENOENT", "ETIMEDOUT", ...), or a word of the
    binding's own ("not_enough_experts"). ``message`` is a sentence for
    people; ``errno`` the library's (positive) errno value, when there is
    one."""

    def __init__(self, code, message, errno=None):
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message
        self.errno = errno


def _local_code(r):
    return _errno.errorcode.get(-r, "E%d" % -r)


ExpertInfo = namedtuple("ExpertInfo", ["uid", "peer", "score"])
ExpertInfo.__doc__ = """An expert found by beam search: its ``uid``
("prefix.i.j"), the ``peer`` that hosts it ("PEERID@HOST:PORT") and its
beam-search ``score`` (the sum of its coordinates' grid scores)."""


class SharedBuffer:
    """A zero-filled shared-memory segment of ``nbytes`` that the daemon
    allocated for this connection and the library mapped.

    ``numpy(dtype, count, offset)`` and ``torch(...)`` view its bytes
    without copying; a view keeps the buffer object alive, but ``free()``
    (or ``Client.close()`` followed by ``free()``) unmaps the memory, after
    which every view is invalid: free a buffer only when nothing looks at it
    any more. A buffer that is simply dropped is freed when the last view
    goes. Closing the client releases the daemon's side of the segment; the
    mapping stays until ``free()``."""

    def __init__(self, client, nbytes):
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError("a shared buffer needs a positive size")
        self._client = client
        ptr = ctypes.c_void_p()
        with client._lock:
            h = client._handle()
            r = _lib.lib().hmc_buf_alloc(h, nbytes, ctypes.byref(ptr))
            if r != 0:
                raise client._error(r)
        self._buf = ptr.value
        self.nbytes = int(_lib.lib().hmc_buf_size(self._buf))
        self.id = int(_lib.lib().hmc_buf_id(self._buf))
        self.address = int(_lib.lib().hmc_buf_data(self._buf))

    @property
    def handle(self):
        """The library's hmc_buf pointer (an int); raises once freed."""
        if self._buf is None:
            raise ValueError("the shared buffer was freed")
        return self._buf

    def numpy(self, dtype=np.float32, count=-1, offset=0):
        """A numpy array of ``count`` items of ``dtype`` from byte ``offset``
        (count -1: to the end), sharing the buffer's memory."""
        self.handle
        # A ctypes array over the mapping is the base of the view; through
        # it the view keeps this object, and so the mapping, alive. A new
        # one per view, so that no reference cycle delays the release.
        raw = (ctypes.c_char * self.nbytes).from_address(self.address)
        raw._owner = self
        return np.frombuffer(raw, dtype=dtype, count=count, offset=offset)

    def torch(self, dtype=np.float32, count=-1, offset=0):
        """The same as a torch tensor (torch.from_numpy: no copy)."""
        import torch

        return torch.from_numpy(self.numpy(dtype, count, offset))

    def free(self):
        """Releases the segment on the daemon's side (if the connection is
        still open) and unmaps it. Views must not be used afterwards."""
        buf, self._buf = self._buf, None
        if buf is None:
            return
        client = self._client
        lock = client._lock if client is not None else None
        if lock is not None:
            with lock:
                _lib.lib().hmc_buf_free(buf)
        else:
            _lib.lib().hmc_buf_free(buf)

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        return "<SharedBuffer shm=%d bytes=%d%s>" % (self.id, self.nbytes,
                                                      "" if self._buf else " freed")


class Client:
    """A connection to the local hivemindd's control socket.

    ``socket_path`` None means $HIVEMINDD_CONTROL_SOCKET, else the daemon's
    default path (as hivemindctl finds it). ``timeout`` is the timeout of
    ordinary requests in seconds (averaging and expert calls wait for their
    own timeouts on top). One Client may be shared by threads: its calls are
    serialized. Usable as a context manager; ``close()`` releases the
    daemon's side of every buffer allocated through it.
    """

    def __init__(self, socket_path=None, timeout=30.0):
        L = _lib.lib()
        self._lock = threading.RLock()
        self._h = None
        self._scratch = {}
        self.socket_path = socket_path
        h = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_lib.ERROR_MAX)
        path = socket_path.encode() if isinstance(socket_path, str) else socket_path
        r = L.hmc_connect(path, ctypes.byref(h), err, len(err))
        if r != 0:
            raise HivemindError(_local_code(r), _lib.text(err.value), -r)
        self._h = h.value
        if timeout is not None:
            self.set_timeout(timeout)

    # ---- plumbing ----

    def _handle(self):
        if self._h is None:
            raise HivemindError("closed", "the client is closed")
        return self._h

    def _error(self, r):
        """The HivemindError for a failed call that returned r."""
        L = _lib.lib()
        code = _lib.text(L.hmc_last_error_code(self._h))
        msg = _lib.text(L.hmc_last_error(self._h))
        return HivemindError(code or _local_code(r), msg, -r)

    def _scratch_buffer(self, name, nbytes):
        """A buffer of at least nbytes kept for calls of this client."""
        b = self._scratch.get(name)
        if b is None or b.nbytes < nbytes:
            if b is not None:
                b.free()
            # Some headroom, so that a slowly growing batch does not
            # reallocate on every call.
            b = SharedBuffer(self, max(nbytes, 4096) * 5 // 4)
            self._scratch[name] = b
        return b

    # ---- connection ----

    def set_timeout(self, seconds):
        """Sets the timeout of ordinary requests (seconds, > 0)."""
        ms = int(round(seconds * 1000))
        if ms <= 0:
            raise ValueError("the timeout must be positive")
        with self._lock:
            _lib.lib().hmc_set_timeout(self._handle(), ms)

    def request(self, cmd, **args):
        """Sends any control command (docs/control-protocol.md) with args as
        its arguments and returns the result object as a dict. Raises
        HivemindError with the daemon's code when it refuses."""
        out = ctypes.c_void_p()
        payload = json.dumps(args).encode()
        with self._lock:
            r = _lib.lib().hmc_request(self._handle(), cmd.encode(), payload, ctypes.byref(out))
            if r != 0:
                raise self._error(r)
        return json.loads(_lib.take_string(out.value))

    def info(self):
        """The node's info: peer id, address, swarm, shared memory in use..."""
        out = ctypes.c_void_p()
        with self._lock:
            r = _lib.lib().hmc_info(self._handle(), ctypes.byref(out))
            if r != 0:
                raise self._error(r)
        return json.loads(_lib.take_string(out.value))

    def buffer(self, nbytes):
        """A new zero-filled SharedBuffer of nbytes."""
        return SharedBuffer(self, nbytes)

    def tensor(self, shape, dtype=np.float32):
        """A zero-filled numpy array of shape and dtype in a shared buffer of
        its own (use torch.from_numpy for a tensor: no copy). The array keeps
        its buffer alive."""
        shape = tuple(int(s) for s in np.atleast_1d(shape))
        count = int(np.prod(shape)) if shape else 1
        b = SharedBuffer(self, max(1, count * np.dtype(dtype).itemsize))
        return b.numpy(dtype, count).reshape(shape)

    def close(self):
        """Closes the connection; the daemon releases the buffers allocated
        through it. Scratch buffers are unmapped."""
        with self._lock:
            for b in self._scratch.values():
                b.free()
            self._scratch.clear()
            h, self._h = self._h, None
            if h is not None:
                _lib.lib().hmc_close(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- experts (numpy level) ----

    def find_experts(self, prefix, scores, k_best, timeout=5.0):
        """Beam search over the expert grid under ``prefix``: ``scores`` holds
        one sequence of grid scores per dimension. Returns up to ``k_best``
        ExpertInfo, best first (fewer, or none, when the swarm has fewer)."""
        rows = [np.asarray(s, dtype=np.float64).ravel() for s in scores]
        if not rows or any(r.size == 0 for r in rows):
            raise ValueError("scores needs at least one non-empty row per grid dimension")
        flat = np.ascontiguousarray(np.concatenate(rows))
        sizes = (ctypes.c_size_t * len(rows))(*[r.size for r in rows])
        out = (_lib.Expert * int(k_best))()
        n = ctypes.c_size_t(0)
        with self._lock:
            r = _lib.lib().hmc_experts_find(
                self._handle(), prefix.encode(),
                flat.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), sizes, len(rows),
                int(k_best), float(timeout), out, int(k_best), ctypes.byref(n), None)
            if r != 0:
                raise self._error(r)
        return [ExpertInfo(out[i].uid.decode(), out[i].peer.decode(), out[i].score)
                for i in range(n.value)]

    @staticmethod
    def _experts_array(experts):
        arr = (_lib.Expert * len(experts))()
        for i, e in enumerate(experts):
            uid, peer = e[0].encode(), e[1].encode()
            if len(uid) >= _lib.UID_MAX or len(peer) >= _lib.PEER_MAX:
                raise ValueError("expert %d: uid or peer too long" % i)
            arr[i].uid = uid
            arr[i].peer = peer
        return arr

    @staticmethod
    def _seq_mask(x, mask):
        """The key-padding mask of a [batch, seq, dim] input as float32
        [batch, seq] of 0/1, or None."""
        if mask is None:
            return None
        if x.ndim != 3:
            raise ValueError("a mask goes with inputs [batch, seq, dim]")
        m = np.asarray(mask)
        if m.shape != x.shape[:2]:
            raise ValueError("mask must be [batch, seq] = %s, not %s" % (x.shape[:2], m.shape))
        m = np.ascontiguousarray(m, dtype=np.float32)
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must hold 1 (a token) or 0 (padding)")
        if not np.all(m.max(axis=1) == 1):
            raise ValueError("every sequence must keep at least one token")
        return m

    def experts_forward(self, experts, x, k_min=None, timeout=10.0, timeout_after_k_min=1.0,
                        mask=None):
        """Calls forward on each of ``experts`` (ExpertInfo or (uid, peer)
        pairs) with the batch ``x`` (array-like [batch, dim], or [batch,
        seq, dim] for transformer experts). Returns ``(y, answered)``: y
        [k, *x.shape] float32 (rows of experts that did not answer are
        unspecified) and a list of k booleans. Succeeds once ``k_min``
        (default: all) answered, waiting at most ``timeout_after_k_min``
        more for the rest; fewer raises HivemindError ("timeout").
        ``mask`` (3-D inputs only; [batch, seq] of 1 for a token, 0 for
        padding, Hivemind's attention_mask) keeps padded keys out of the
        attention."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim not in (2, 3):
            raise ValueError("x must be [batch, dim] or [batch, seq, dim]")
        m = self._seq_mask(x, mask)
        k = len(experts)
        if k == 0:
            raise ValueError("no experts to call")
        batch, dim = x.shape[0], x.shape[-1]
        seq = x.shape[1] if x.ndim == 3 else 0
        k_min = k if k_min is None else int(k_min)
        arr = self._experts_array(experts)
        answered = (ctypes.c_int * k)()
        n = ctypes.c_size_t(0)
        with self._lock:
            xb = self._scratch_buffer("x", x.nbytes)
            yb = self._scratch_buffer("y", k * x.nbytes)
            xb.numpy(np.float32, x.size)[:] = x.ravel()
            if x.ndim == 3:
                mb = None
                if m is not None:
                    mb = self._scratch_buffer("mask", m.nbytes)
                    mb.numpy(np.float32, m.size)[:] = m.ravel()
                r = _lib.lib().hmc_experts_forward_seq(
                    self._handle(), arr, k, xb.handle, 0, mb.handle if mb is not None else None,
                    0, yb.handle, 0, batch, seq, dim, k_min, float(timeout),
                    float(timeout_after_k_min), answered, ctypes.byref(n))
            else:
                r = _lib.lib().hmc_experts_forward(
                    self._handle(), arr, k, xb.handle, 0, yb.handle, 0, batch, dim, k_min,
                    float(timeout), float(timeout_after_k_min), answered, ctypes.byref(n))
            if r != 0:
                raise self._error(r)
            y = yb.numpy(np.float32, k * x.size).reshape((k,) + x.shape).copy()
        return y, [bool(a) for a in answered]

    def experts_backward(self, experts, x, grad_y, k_min=None, timeout=10.0, mask=None):
        """Backward on each of ``experts`` with the input ``x`` [batch, dim]
        (or [batch, seq, dim], with the forward's ``mask``) and the
        gradients of their outputs ``grad_y`` [k, *x.shape]; each host
        applies one optimizer step to its expert. Returns ``(grad_x,
        answered)``: dL/dx per expert [k, *x.shape] and k booleans. Fewer
        than ``k_min`` (default: all) answering raises HivemindError."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        gy = np.ascontiguousarray(grad_y, dtype=np.float32)
        k = len(experts)
        if x.ndim not in (2, 3) or gy.shape != (k,) + x.shape:
            raise ValueError("x must be [batch, dim] or [batch, seq, dim] and grad_y [k, *x.shape]")
        m = self._seq_mask(x, mask)
        if k == 0:
            raise ValueError("no experts to call")
        batch, dim = x.shape[0], x.shape[-1]
        seq = x.shape[1] if x.ndim == 3 else 0
        k_min = k if k_min is None else int(k_min)
        arr = self._experts_array(experts)
        answered = (ctypes.c_int * k)()
        n = ctypes.c_size_t(0)
        with self._lock:
            xb = self._scratch_buffer("x", x.nbytes)
            gyb = self._scratch_buffer("gy", gy.nbytes)
            gxb = self._scratch_buffer("gx", gy.nbytes)
            xb.numpy(np.float32, x.size)[:] = x.ravel()
            gyb.numpy(np.float32, gy.size)[:] = gy.ravel()
            if x.ndim == 3:
                mb = None
                if m is not None:
                    mb = self._scratch_buffer("mask", m.nbytes)
                    mb.numpy(np.float32, m.size)[:] = m.ravel()
                r = _lib.lib().hmc_experts_backward_seq(
                    self._handle(), arr, k, xb.handle, 0, mb.handle if mb is not None else None,
                    0, gyb.handle, 0, gxb.handle, 0, batch, seq, dim, k_min, float(timeout),
                    answered, ctypes.byref(n))
            else:
                r = _lib.lib().hmc_experts_backward(
                    self._handle(), arr, k, xb.handle, 0, gyb.handle, 0, gxb.handle, 0, batch,
                    dim, k_min, float(timeout), answered, ctypes.byref(n))
            if r != 0:
                raise self._error(r)
            gx = gxb.numpy(np.float32, gy.size).reshape(gy.shape).copy()
        return gx, [bool(a) for a in answered]

    # ---- per-sample routing (numpy level) ----

    MAX_ROUTED = 1024  # distinct experts of one routed search or call (moe/client.h)

    def route_experts(self, prefix, grid_size, scores, k_best, beam_size=0, timeout=5.0):
        """Per-sample beam search: ``scores`` [batch, sum(grid_size)] holds
        each sample's grid scores (dimension 0, then 1, ...); the daemon
        runs every sample's search in one walk of the DHT. Returns
        ``(experts, routes)``: the ExpertInfo (score 0) of every expert some
        sample was routed to, each once, and routes [batch, k_best] int32,
        row b sample b's experts best first as indices into experts, -1
        past the ones found."""
        grid = [int(g) for g in grid_size]
        sc = np.ascontiguousarray(scores, dtype=np.float32)
        if sc.ndim != 2 or sc.shape[1] != sum(grid) or sc.shape[0] == 0:
            raise ValueError("scores must be [batch, sum(grid_size)]")
        batch, k_best = sc.shape[0], int(k_best)
        sizes = (ctypes.c_size_t * len(grid))(*grid)
        cap = min(self.MAX_ROUTED, batch * k_best)
        out = (_lib.Expert * cap)()
        n = ctypes.c_size_t(0)
        with self._lock:
            sb = self._scratch_buffer("scores", sc.nbytes)
            rb = self._scratch_buffer("routes", batch * k_best * 4)
            sb.numpy(np.float32, sc.size)[:] = sc.ravel()
            r = _lib.lib().hmc_experts_route(
                self._handle(), prefix.encode(), sizes, len(grid), sb.handle, 0, batch, k_best,
                int(beam_size), float(timeout), rb.handle, 0, out, cap, ctypes.byref(n), None)
            if r != 0:
                raise self._error(r)
            routes = rb.numpy(np.int32, batch * k_best).reshape(batch, k_best).copy()
        experts = [ExpertInfo(out[i].uid.decode(), out[i].peer.decode(), 0.0)
                   for i in range(n.value)]
        return experts, routes

    @staticmethod
    def _routes_array(routes, n_experts):
        rt = np.ascontiguousarray(routes, dtype=np.int32)
        if rt.ndim != 2 or rt.shape[1] == 0:
            raise ValueError("routes must be [batch, slots]")
        if rt.size and (rt.min() < -1 or rt.max() >= n_experts):
            raise ValueError("routes must hold -1 or indices into experts")
        return rt

    def experts_forward_routed(self, experts, routes, x, k_min=1, allow_zero_outputs=False,
                               timeout=10.0, timeout_after_k_min=1.0, mask=None):
        """Forward with the rows grouped by expert: each expert gets one
        request with the rows of the samples routed to it (``routes``
        [batch, slots] as route_experts gives it). Returns ``(y,
        answered)``: y [batch, slots, dim] float32 (slot j of sample b the
        output of expert routes[b, j] on x[b]; zeros where the expert did
        not answer or there is none) and a boolean per expert. ``k_min``
        counts per sample (min(k_min, its experts)); 0 needs
        ``allow_zero_outputs``. Some sample with fewer answers at
        ``timeout`` raises HivemindError ("timeout"). For transformer
        experts x may be [batch, seq, dim] (each sequence one sample, y
        [batch, slots, seq, dim]) with ``mask`` [batch, seq]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim not in (2, 3):
            raise ValueError("x must be [batch, dim] or [batch, seq, dim]")
        m = self._seq_mask(x, mask)
        k = len(experts)
        if k == 0:
            raise ValueError("no experts to call")
        rt = self._routes_array(routes, k)
        if rt.shape[0] != x.shape[0]:
            raise ValueError("routes and x must have a row per sample")
        batch, dim = x.shape[0], x.shape[-1]
        seq = x.shape[1] if x.ndim == 3 else 0
        slots = rt.shape[1]
        arr = self._experts_array(experts)
        answered = (ctypes.c_int * k)()
        n = ctypes.c_size_t(0)
        with self._lock:
            xb = self._scratch_buffer("x", x.nbytes)
            rb = self._scratch_buffer("call_routes", rt.nbytes)
            yb = self._scratch_buffer("y", slots * x.nbytes)
            xb.numpy(np.float32, x.size)[:] = x.ravel()
            rb.numpy(np.int32, rt.size)[:] = rt.ravel()
            if seq:
                mb = None
                if m is not None:
                    mb = self._scratch_buffer("mask", m.nbytes)
                    mb.numpy(np.float32, m.size)[:] = m.ravel()
                r = _lib.lib().hmc_experts_forward_routed_seq(
                    self._handle(), arr, k, rb.handle, 0, slots, xb.handle, 0,
                    mb.handle if mb is not None else None, 0, yb.handle, 0, batch, seq, dim,
                    int(k_min), 1 if allow_zero_outputs else 0, float(timeout),
                    float(timeout_after_k_min), answered, ctypes.byref(n))
            else:
                r = _lib.lib().hmc_experts_forward_routed(
                    self._handle(), arr, k, rb.handle, 0, slots, xb.handle, 0, yb.handle, 0,
                    batch, dim, int(k_min), 1 if allow_zero_outputs else 0, float(timeout),
                    float(timeout_after_k_min), answered, ctypes.byref(n))
            if r != 0:
                raise self._error(r)
            y = yb.numpy(np.float32, slots * x.size).reshape(
                (batch, slots) + x.shape[1:]).copy()
        ans = np.array([bool(a) for a in answered])
        live = (rt >= 0) & ans[np.maximum(rt, 0)]
        y[~live] = 0.0
        return y, [bool(a) for a in answered]

    def experts_backward_routed(self, experts, routes, x, grad_y, k_min=1,
                                allow_zero_outputs=False, timeout=10.0, mask=None):
        """Backward of a routed forward: ``grad_y`` [batch, slots, dim];
        pass the forward's routes with -1 where the expert did not answer,
        so that backward goes only to the experts that gave those rows.
        Returns ``(grad_x, answered)``: [batch, slots, dim] (zeros where no
        expert answered) and a boolean per expert."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        gy = np.ascontiguousarray(grad_y, dtype=np.float32)
        k = len(experts)
        if k == 0:
            raise ValueError("no experts to call")
        rt = self._routes_array(routes, k)
        if x.ndim not in (2, 3) or gy.shape != (x.shape[0], rt.shape[1]) + x.shape[1:] or \
                rt.shape[0] != x.shape[0]:
            raise ValueError("x must be [batch, (seq,) dim], routes [batch, slots] and grad_y "
                             "[batch, slots, (seq,) dim]")
        m = self._seq_mask(x, mask)
        batch, dim = x.shape[0], x.shape[-1]
        seq = x.shape[1] if x.ndim == 3 else 0
        slots = rt.shape[1]
        arr = self._experts_array(experts)
        answered = (ctypes.c_int * k)()
        n = ctypes.c_size_t(0)
        with self._lock:
            xb = self._scratch_buffer("x", x.nbytes)
            rb = self._scratch_buffer("call_routes", rt.nbytes)
            gyb = self._scratch_buffer("gy", gy.nbytes)
            gxb = self._scratch_buffer("gx", gy.nbytes)
            xb.numpy(np.float32, x.size)[:] = x.ravel()
            rb.numpy(np.int32, rt.size)[:] = rt.ravel()
            gyb.numpy(np.float32, gy.size)[:] = gy.ravel()
            if seq:
                mb = None
                if m is not None:
                    mb = self._scratch_buffer("mask", m.nbytes)
                    mb.numpy(np.float32, m.size)[:] = m.ravel()
                r = _lib.lib().hmc_experts_backward_routed_seq(
                    self._handle(), arr, k, rb.handle, 0, slots, xb.handle, 0,
                    mb.handle if mb is not None else None, 0, gyb.handle, 0, gxb.handle, 0,
                    batch, seq, dim, int(k_min), 1 if allow_zero_outputs else 0, float(timeout),
                    answered, ctypes.byref(n))
            else:
                r = _lib.lib().hmc_experts_backward_routed(
                    self._handle(), arr, k, rb.handle, 0, slots, xb.handle, 0, gyb.handle, 0,
                    gxb.handle, 0, batch, dim, int(k_min), 1 if allow_zero_outputs else 0,
                    float(timeout), answered, ctypes.byref(n))
            if r != 0:
                raise self._error(r)
            gx = gxb.numpy(np.float32, gy.size).reshape(gy.shape).copy()
        ans = np.array([bool(a) for a in answered])
        live = (rt >= 0) & ans[np.maximum(rt, 0)]
        gx[~live] = 0.0
        return gx, [bool(a) for a in answered]
