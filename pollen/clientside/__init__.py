"""pollen's client side, for any Flower ClientApp: mods, client state, the Fed-LAMB optimiser, client steps.

- :func:`compression_mod`, :func:`lazy_mod`: Flower mods that compress the train reply (with error
  feedback) and run the lazy / bidirectional family's client rules; :func:`compress_update` compresses
  a flat update without building the model's record first.
- :func:`secagg_mod`: a Flower mod that takes part in a pollen server's secure aggregation (SecAgg+): the
  update encoded with the round's summable codec and kept on the node, masked, summed by the server.
- :class:`ClientState`: vectors a client keeps between messages (``context.state``, and a file under
  ``state-dir`` that survives a restart).
- :class:`LocalLAMB`: the local optimiser of Fed-LAMB / Mime-LAMB / Fed-AMS / Mime (a
  ``torch.optim.Optimizer``; imported on first use, so this package does not import torch).
- :class:`LocalWork`, :class:`StepOutcome`, :data:`LOCAL_STEPS`, :data:`PHASES`: what a client step gets
  and returns, and the tables of pollen's steps (:mod:`pollen.clientside.steps`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pollen.clientside.compression_mod import compress_update, compression_mod
from pollen.clientside.lazy_mod import lazy_mod
from pollen.clientside.secagg_mod import secagg_mod
from pollen.clientside.state import ClientState
from pollen.clientside.steps import LOCAL_STEPS, PHASES, LocalWork, StepOutcome

if TYPE_CHECKING:
    from pollen.clientside.lamb import LocalLAMB

__all__ = [
    "LOCAL_STEPS",
    "PHASES",
    "ClientState",
    "LocalLAMB",
    "LocalWork",
    "StepOutcome",
    "compress_update",
    "compression_mod",
    "lazy_mod",
    "secagg_mod",
]


def __getattr__(name: str) -> Any:
    """``LocalLAMB`` subclasses ``torch.optim.Optimizer``: import torch only when it is asked for."""
    if name == "LocalLAMB":
        from pollen.clientside.lamb import LocalLAMB

        return LocalLAMB
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
