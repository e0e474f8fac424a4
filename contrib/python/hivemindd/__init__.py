"""hivemindd: the Python binding of hivemindd's trainer client library.

A trainer attaches to its local hivemindd through the control socket and
hands tensors over in shared memory; this package does that through
libhivemind (lib/hivemind.h) with ctypes, so it needs no build step, only
the library (found at $HIVEMIND_LIB, in the build tree $HM_BUILDDIR, or
installed) and numpy; RemoteMixtureOfExperts also needs torch.

    from hivemindd import Client, Averager, RemoteMixtureOfExperts

    with Client("/run/hivemindd/control.sock") as c:
        print(c.info()["address"])
        avg = Averager(c, "mymodel", list(model.parameters()), target_group_size=4)
        avg.step()                      # average now, write the mean back
        avg.start(); ...; avg.apply()   # or in the background, delayed update

DiLoCo(params, inner_optimizer, run_id=..., inner_steps=..., client=c) is
the DiLoCo optimizer (libhivemind's, through ctypes).

Optimizer(params=..., optimizer=..., run_id=..., target_batch_size=...,
batch_size_per_step=..., client=c) is the collaborative optimizer
(Hivemind's Optimizer; libhivemind's hmc_opt_*): one optimizer step per
epoch of target_batch_size samples over the swarm.

Errors from the daemon or the library raise HivemindError(code, message).
"""

from .client import Client, ExpertInfo, HivemindError, SharedBuffer
from .averaging import Averager
from .diloco import DiLoCo
from .optimizer import Optimizer
from ._lib import library_path

__all__ = ["Client", "SharedBuffer", "HivemindError", "ExpertInfo", "Averager", "DiLoCo",
           "Optimizer", "RemoteExpert", "RemoteMixtureOfExperts", "RemoteSwitchMixtureOfExperts", "library_path"]


def __getattr__(name):
    # torch is imported only by those who use the experts layer.
    if name in ("RemoteExpert", "RemoteMixtureOfExperts", "RemoteSwitchMixtureOfExperts"):
        from . import moe

        return getattr(moe, name)
    raise AttributeError("module 'hivemindd' has no attribute %r" % name)
