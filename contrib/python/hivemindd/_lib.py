"""The ctypes view of libhivemind (lib/hivemind.h): finding and loading the
shared object, the structures the API passes by pointer, and the
prototype of every function, so that a wrong argument type fails in Python
instead of corrupting memory in C.

The library is found, in this order, at $HIVEMIND_LIB (the path of the .so),
in a build tree at $HM_BUILDDIR/lib/.libs/libhivemind.so, and then wherever
ctypes.util.find_library('hivemind') finds an installed one. It is loaded
once, on first use, so that importing the package never fails for want of
it.
"""

import ctypes
import ctypes.util
import os
import threading

# The sizes hivemind.h fixes.
UID_MAX = 256
PEER_MAX = 256
ERROR_MAX = 512

c_int = ctypes.c_int
c_size_t = ctypes.c_size_t
c_double = ctypes.c_double
c_char_p = ctypes.c_char_p
c_void_p = ctypes.c_void_p
P = ctypes.POINTER


class AvgOpts(ctypes.Structure):
    """struct hmc_avg_opts."""

    _fields_ = [
        ("prefix", c_char_p),
        ("weight", c_double),
        ("timeout_s", c_double),
        ("round_timeout_s", c_double),
        ("matchmaking_time_s", c_double),
        ("target_group_size", c_int),
        ("min_group_size", c_int),
        ("compression", c_char_p),
        ("group_bits", c_char_p),
        ("client_mode", c_int),
        ("extra_json", c_char_p),
    ]


class Expert(ctypes.Structure):
    """struct hmc_expert."""

    _fields_ = [
        ("uid", ctypes.c_char * UID_MAX),
        ("peer", ctypes.c_char * PEER_MAX),
        ("score", c_double),
    ]


DILOCO_CODE_MAX = 64


class DiLoCoOpts(ctypes.Structure):
    """struct hmc_diloco_opts."""

    _fields_ = [
        ("run_id", c_char_p),
        ("inner_steps", ctypes.c_uint),
        ("outer_lr", c_double),
        ("outer_momentum", c_double),
        ("weight", c_double),
        ("compression", c_char_p),
        ("timeout_s", c_double),
        ("round_timeout_s", c_double),
        ("matchmaking_time_s", c_double),
        ("target_group_size", c_int),
        ("min_group_size", c_int),
        ("load_state", c_int),
        ("share_state", c_int),
        ("load_timeout_s", c_double),
        ("state_min_agree", c_int),
        ("catch_up", c_int),
    ]


class DiLoCoReport(ctypes.Structure):
    """struct hmc_diloco_report."""

    _fields_ = [
        ("round", ctypes.c_uint64),
        ("loaded", c_int),
        ("averaged", c_int),
        ("group_size", c_int),
        ("shared", c_int),
        ("caught_up", c_int),
        ("status", c_int),
        ("code", ctypes.c_char * DILOCO_CODE_MAX),
        ("error", ctypes.c_char * ERROR_MAX),
        ("average_s", c_double),
        ("pseudo_grad_norm", c_double),
    ]


# void step(void *ud, float *params, const float *grads, size_t n): hmc_opt_step_fn.
OPT_STEP_FN = ctypes.CFUNCTYPE(None, c_void_p, P(ctypes.c_float), P(ctypes.c_float), c_size_t)
OPT_STATS_FN = ctypes.CFUNCTYPE(None, c_void_p, P(ctypes.c_float), c_size_t)


class OptOpts(ctypes.Structure):
    """struct hmc_opt_opts."""

    _fields_ = [
        ("run_id", c_char_p),
        ("target_batch_size", ctypes.c_uint64),
        ("batch_size_per_step", ctypes.c_uint64),
        ("matchmaking_time_s", c_double),
        ("averaging_timeout_s", c_double),
        ("average_state_every", ctypes.c_uint),
        ("client", c_int),
        ("target_group_size", c_int),
        ("compression", c_char_p),
        ("share_state", c_int),
        ("load_timeout_s", c_double),
        ("step", OPT_STEP_FN),
        ("step_ud", c_void_p),
        ("delay_step", c_int),
        ("local_updates", c_int),
        ("n_stats", c_size_t),
        ("stat_names", c_char_p),
        ("stats_get", OPT_STATS_FN),
        ("stats_set", OPT_STATS_FN),
    ]


class OptReport(ctypes.Structure):
    """struct hmc_opt_report."""

    _fields_ = [
        ("epoch_ended", c_int),
        ("averaged", c_int),
        ("local_fallback", c_int),
        ("caught_up", c_int),
        ("state_loaded", c_int),
        ("state_averaged", c_int),
        ("epoch", ctypes.c_uint64),
        ("global_epoch", ctypes.c_uint64),
        ("samples", ctypes.c_uint64),
        ("swarm_samples", ctypes.c_uint64),
        ("group_size", c_int),
        ("error", ctypes.c_char * ERROR_MAX),
        ("stepped", c_int),
        ("pending", c_int),
        ("stepped_epoch", ctypes.c_uint64),
        ("scheduled", c_int),
        ("matchmaking_lead_s", c_double),
        ("tagged_along", c_int),
        ("tagged_along_group", c_int),
        ("state_started", c_int),
        ("state_pending", c_int),
        ("held_ahead", c_int),
    ]


# name: (restype, argtypes)
_PROTOTYPES = {
    "hmc_connect": (c_int, [c_char_p, P(c_void_p), c_char_p, c_size_t]),
    "hmc_connect_timeout": (c_int, [c_char_p, c_int, P(c_void_p), c_char_p, c_size_t]),
    "hmc_close": (None, [c_void_p]),
    "hmc_last_error": (c_char_p, [c_void_p]),
    "hmc_last_error_code": (c_char_p, [c_void_p]),
    "hmc_set_timeout": (None, [c_void_p, c_int]),
    "hmc_free_string": (None, [c_void_p]),
    "hmc_request": (c_int, [c_void_p, c_char_p, c_char_p, P(c_void_p)]),
    "hmc_info": (c_int, [c_void_p, P(c_void_p)]),
    "hmc_buf_alloc": (c_int, [c_void_p, c_size_t, P(c_void_p)]),
    "hmc_buf_data": (c_void_p, [c_void_p]),
    "hmc_buf_size": (c_size_t, [c_void_p]),
    "hmc_buf_id": (ctypes.c_uint64, [c_void_p]),
    "hmc_buf_free": (None, [c_void_p]),
    "hmc_avg_opts_init": (None, [P(AvgOpts)]),
    "hmc_average": (c_int, [c_void_p, c_void_p, c_size_t, c_size_t, P(AvgOpts), P(c_void_p)]),
    "hmc_average_start": (c_int, [c_void_p, c_void_p, c_size_t, c_size_t, P(AvgOpts),
                                  P(c_void_p)]),
    "hmc_round_done": (c_int, [c_void_p]),
    "hmc_round_wait": (c_int, [c_void_p, c_int, P(c_void_p)]),
    "hmc_round_error": (c_char_p, [c_void_p]),
    "hmc_round_error_code": (c_char_p, [c_void_p]),
    "hmc_round_free": (None, [c_void_p]),
    "hmc_experts_find": (c_int, [c_void_p, c_char_p, P(c_double), P(c_size_t), c_size_t,
                                 c_size_t, c_double, P(Expert), c_size_t, P(c_size_t),
                                 P(c_void_p)]),
    "hmc_experts_forward": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                    c_void_p, c_size_t, c_size_t, c_size_t, c_size_t, c_double,
                                    c_double, P(c_int), P(c_size_t)]),
    "hmc_experts_backward": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                     c_void_p, c_size_t, c_void_p, c_size_t, c_size_t, c_size_t,
                                     c_size_t, c_double, P(c_int), P(c_size_t)]),
    "hmc_experts_forward_seq": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                        c_void_p, c_size_t, c_void_p, c_size_t, c_size_t,
                                        c_size_t, c_size_t, c_size_t, c_double, c_double,
                                        P(c_int), P(c_size_t)]),
    "hmc_experts_backward_seq": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                         c_void_p, c_size_t, c_void_p, c_size_t, c_void_p,
                                         c_size_t, c_size_t, c_size_t, c_size_t, c_size_t,
                                         c_double, P(c_int), P(c_size_t)]),
    "hmc_experts_route": (c_int, [c_void_p, c_char_p, P(c_size_t), c_size_t, c_void_p,
                                  c_size_t, c_size_t, c_size_t, c_size_t, c_double, c_void_p,
                                  c_size_t, P(Expert), c_size_t, P(c_size_t), P(c_void_p)]),
    "hmc_experts_forward_routed": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                           c_size_t, c_void_p, c_size_t, c_void_p, c_size_t,
                                           c_size_t, c_size_t, c_size_t, c_int, c_double,
                                           c_double, P(c_int), P(c_size_t)]),
    "hmc_experts_backward_routed": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p, c_size_t,
                                            c_size_t, c_void_p, c_size_t, c_void_p, c_size_t,
                                            c_void_p, c_size_t, c_size_t, c_size_t, c_size_t,
                                            c_int, c_double, P(c_int), P(c_size_t)]),
    "hmc_experts_forward_routed_seq": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p,
                                               c_size_t, c_size_t, c_void_p, c_size_t, c_void_p,
                                               c_size_t, c_void_p, c_size_t, c_size_t, c_size_t,
                                               c_size_t, c_size_t, c_int, c_double, c_double,
                                               P(c_int), P(c_size_t)]),
    "hmc_experts_backward_routed_seq": (c_int, [c_void_p, P(Expert), c_size_t, c_void_p,
                                                c_size_t, c_size_t, c_void_p, c_size_t,
                                                c_void_p, c_size_t, c_void_p, c_size_t,
                                                c_void_p, c_size_t, c_size_t, c_size_t,
                                                c_size_t, c_size_t, c_int, c_double, P(c_int),
                                                P(c_size_t)]),
    "hmc_diloco_opts_init": (None, [P(DiLoCoOpts)]),
    "hmc_diloco_open": (c_int, [c_void_p, P(DiLoCoOpts), c_size_t, P(c_void_p)]),
    "hmc_diloco_begin": (c_int, [c_void_p, P(ctypes.c_float), P(DiLoCoReport)]),
    "hmc_diloco_inner_done": (c_int, [c_void_p]),
    "hmc_diloco_outer_step": (c_int, [c_void_p, P(ctypes.c_float), P(DiLoCoReport)]),
    "hmc_diloco_round": (ctypes.c_uint64, [c_void_p]),
    "hmc_diloco_inner_count": (ctypes.c_uint, [c_void_p]),
    "hmc_diloco_outer_params": (P(ctypes.c_float), [c_void_p]),
    "hmc_diloco_momentum": (P(ctypes.c_float), [c_void_p]),
    "hmc_diloco_close": (None, [c_void_p]),
    "hmc_opt_opts_init": (None, [P(OptOpts)]),
    "hmc_opt_open": (c_int, [c_void_p, P(OptOpts), c_size_t, P(c_void_p)]),
    "hmc_opt_step": (c_int, [c_void_p, P(ctypes.c_float), ctypes.c_uint64, P(ctypes.c_float),
                             P(OptReport)]),
    "hmc_opt_local_epoch": (ctypes.c_uint64, [c_void_p]),
    "hmc_opt_global_epoch": (ctypes.c_uint64, [c_void_p]),
    "hmc_opt_close": (None, [c_void_p]),
}

_lock = threading.Lock()
_lib = None


def library_path():
    """The path libhivemind is loaded from, by the rules in this module's
    docstring, or None when none is found."""
    env = os.environ.get("HIVEMIND_LIB")
    if env:
        return env
    build = os.environ.get("HM_BUILDDIR")
    if build:
        cand = os.path.join(build, "lib", ".libs", "libhivemind.so")
        if os.path.exists(cand):
            return cand
    return ctypes.util.find_library("hivemind")


def lib():
    """The loaded library (loaded on the first call). Raises OSError when it
    cannot be found or loaded, or lacks a function this binding needs."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if path is None:
            raise OSError("libhivemind not found: set HIVEMIND_LIB to the path of "
                          "libhivemind.so, or HM_BUILDDIR to a built hivemindd tree, "
                          "or install the library")
        handle = ctypes.CDLL(path)
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(handle, name)
            except AttributeError:
                raise OSError("%s has no %s: it is not a matching libhivemind" % (path, name))
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = handle
        return _lib


def take_string(ptr):
    """The text of a string the library returned (char ** out-parameter),
    freed with hmc_free_string; None for NULL."""
    if not ptr:
        return None
    try:
        return ctypes.string_at(ptr).decode("utf-8")
    finally:
        lib().hmc_free_string(ptr)


def text(b):
    """A const char * result as str ('' for NULL)."""
    return b.decode("utf-8", "replace") if b else ""
