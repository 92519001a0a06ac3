"""Client side of Fed-LAMB, Mime-LAMB, Fed-AMS and Mime (:class:`pollen.strategies.FedLAMB`): the ``adaptive-local``
local step.

One train message (:func:`run`): take ``v_hat`` from the message (the server sends it when this client
does not hold its current version) or from client state; restore this client's momentum ``m`` from
client state; on a Mime sync round first take the full-batch gradient of the local data at the
received model (extra ``grad``, BatchNorm statistics left as they are); then run the local steps with
:class:`~pollen.clientside.lamb.LocalLAMB` (LAMB trust ratio or plain AMSGrad step, as the server
says), keep ``m`` for the next round, and on a Fed-* sync round upload the local ``v`` (extra ``v``).
The model itself is uploaded as usual (full, or compressed when the server asks).

What is fixed within a round and what moves (Algorithm 1 of Karimi, Li, Li, UAI 2023)
--------------------------------------------------------------------------------------
``m`` persists across rounds (line 6, ``m^0_{r,i} = m^T_{r-1,i}``): this step keeps it in client
state. ``v_hat`` is the server's ``v_hat_{r-1}``, the same for every client and fixed for the round;
:func:`set_global_v_hat` puts it in the optimiser's state (floored at ``eps`` in ``eps_mode="floor"``)
and resets the local ``v`` to it (line 6, ``v^0_{r,i} = v_hat_{r-1}``), so after ``T`` steps
``v = beta_2**T v_hat + (1 - beta_2) sum_t beta_2**(T-t) g_t**2``: what Fed-LAMB / Fed-AMS upload
(line 16, :func:`flat_local_v`). Mime-LAMB and Mime build their ``v_hat`` on the server from
full-batch gradients and keep no local ``v`` (``track_v=False``).

The same round in any PyTorch loop, with ``v_hat`` one flat vector of all parameters in order::

    opt = LocalLAMB(model.parameters(), lr=lr_r, weight_decay=lam)
    if saved is not None:
        opt.load_state_dict(saved)            # m (and the last v_hat) of this client's last round
        opt.param_groups[0]["lr"] = lr_r      # load_state_dict restores the saved group settings too
    set_global_v_hat(opt, v_hat_flat)         # the broadcast v_hat_{r-1}; also resets v to it
    for x, y in batches:                      # T local steps
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    upload(model, flat_local_v(opt)); saved = opt.state_dict()

In a round that brings no new ``v_hat`` (skip-sync), pass the held one again
(:func:`global_v_hat`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pollen.clientside.steps.work import LocalWork, StepOutcome, run_sgd, train_metrics
from pollen.core.layout import segments_from_sizes
from pollen.wire import protocol
from pollen.wire.protocol import (
    CFG_BETA_1,
    CFG_BETA_2,
    CFG_EPS,
    CFG_LOCAL_VHAT,
    CFG_STAT,
    CFG_SYNC,
    CFG_TRUST_RATIO,
    CFG_VHAT_KEEP,
    CFG_VHAT_VERSION,
)
from pollen.wire.records import record_to_arrays

if TYPE_CHECKING:
    import torch

    from pollen.clientside.lamb import LocalLAMB

V_HAT = "adaptive.v_hat"
V_HAT_VERSION = "adaptive.v_hat_version"
MOMENTUM = "adaptive.m"


def _round_v_hat(work: LocalWork, dim: int) -> np.ndarray:
    """This round's ``v_hat``: from the message when sent, else the copy kept in client state.

    A sent ``v_hat`` is kept in client state unless the server says it sends one with every message
    (``pollen.v-hat-keep`` false): then any copy held from before is dropped instead, so the state does not
    carry a d-vector that is never read (in simulation Flower ships it to the client and back with each message).
    """
    version = int(work.config[CFG_VHAT_VERSION])
    record = work.msg.content.array_records.get(protocol.extra_record("v_hat"))
    if record is not None:
        v_hat = np.array(record_to_arrays(record)[protocol.EXTRA_ARRAY], dtype=np.float32)
        if v_hat.shape != (dim,) or not np.isfinite(v_hat).all() or (v_hat < 0).any():
            raise ValueError(f"the server's v_hat has shape {v_hat.shape} or bad values; expected {dim} values >= 0")
        if bool(work.config.get(CFG_VHAT_KEEP, True)):
            work.state.set(V_HAT, v_hat)
            work.state.set(V_HAT_VERSION, np.array(version, dtype=np.int64))
        else:
            work.state.pop(V_HAT)
            work.state.pop(V_HAT_VERSION)
        return v_hat
    held = work.state.get(V_HAT, shape=(dim,), dtype=np.float32)
    held_version = work.state.get(V_HAT_VERSION, shape=(), dtype=np.int64)
    if held is None or held_version is None or int(held_version) != version or held.shape != (dim,):
        raise ValueError(f"this client holds no v_hat of version {version}; the server sends it with the next message")
    return held


def lamb_settings(work: LocalWork) -> dict[str, Any]:
    """LocalLAMB's trust-ratio settings from run-config: ``lamb-zero-norm-guard``, ``lamb-phi`` and, for
    ``phi="clip"``, ``lamb-phi-min`` / ``lamb-phi-max`` (LAMB's ``min(max(a, gamma_l), gamma_u)``)."""
    settings: dict[str, Any] = {
        "zero_norm_guard": bool(work.setting("lamb-zero-norm-guard")),
        "phi": str(work.setting("lamb-phi")),
    }
    if settings["phi"] == "clip":
        settings["phi_clip"] = (float(work.setting("lamb-phi-min")), float(work.setting("lamb-phi-max")))
    return settings


def full_batch_gradient(work: LocalWork, params: list) -> tuple[np.ndarray, int]:  # noqa: ANN001
    """Mean-loss gradient over all local training data at the current model; ``(flat, batches)``.

    The model is in eval mode for the pass, so BatchNorm statistics are not updated.
    """
    import torch

    model, device = work.task.model, work.task.device
    loader, _ = work.task.loaders(int(work.setting("batch-size")))
    was_training = model.training
    model.eval()
    grads = [torch.zeros_like(p) for p in params]
    total, batches = 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        for acc, p in zip(grads, params):
            acc += p.grad
        total += len(y)
        batches += 1
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    flat = torch.cat([(g / max(total, 1)).reshape(-1) for g in grads]).cpu().numpy().astype(np.float32)
    return flat, batches


def run(work: LocalWork) -> StepOutcome:
    """Fed-LAMB / Mime-LAMB / Fed-AMS / Mime local training (see the module docstring)."""
    import torch

    from pollen.clientside.lamb import LocalLAMB

    model = work.task.model.to(work.task.device)
    layout = work.layout()
    named = dict(model.named_parameters())
    if [spec.name for spec in layout.trainable] != list(named):
        raise ValueError("the model's parameters do not match the trainable tensors the server flattens")
    params = list(named.values())
    config = work.config
    sync, stat = bool(config[CFG_SYNC]), str(config[CFG_STAT])
    local_vhat = bool(config.get(CFG_LOCAL_VHAT, False))
    optimizer = LocalLAMB(
        params,
        lr=float(work.setting("local-lr")),
        betas=(float(config[CFG_BETA_1]), float(config[CFG_BETA_2])),
        weight_decay=float(work.setting("weight-decay")),
        eps=float(config[CFG_EPS]),
        trust_ratio=bool(config[CFG_TRUST_RATIO]),
        track_v=stat == "v" or local_vhat,
        local_vhat=local_vhat,
        **lamb_settings(work),
    )
    v_hat = layout.unflatten(_round_v_hat(work, layout.dim))
    set_global_v_hat(optimizer, [torch.from_numpy(v_hat[name]) for name in named])
    momentum = work.state.get(MOMENTUM, shape=(layout.dim,), dtype=np.float32)
    if momentum is not None and momentum.shape == (layout.dim,):
        with torch.no_grad():
            for p, (start, stop) in zip(params, layout.segments):
                optimizer.state[p]["m"].copy_(torch.from_numpy(momentum[start:stop]).reshape(p.shape))
    extras: dict[str, np.ndarray] = {}
    extra_batches = 0
    if sync and stat == "grad":
        extras["grad"], extra_batches = full_batch_gradient(work, params)
    result = run_sgd(work, None, optimizer=optimizer)
    if sync and stat == "v":
        extras["v"] = layout.flatten(
            {name: optimizer.state[p]["v"].detach().cpu().numpy() for name, p in named.items()}
        )
    work.state.set(MOMENTUM, torch.cat([optimizer.state[p]["m"].reshape(-1) for p in params]).cpu().numpy())
    metrics = train_metrics(result)
    metrics["grad-evals"] = int(result.num_steps + extra_batches)
    return StepOutcome(metrics, extras=extras)


# ------------------------------------------------------------------------------------ round I/O


def _params(optimizer: LocalLAMB) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    return [(p, g) for g in optimizer.param_groups for p in g["params"]]


def set_global_v_hat(optimizer: LocalLAMB, v_hat: Any) -> None:
    """Put the server's ``v_hat_{r-1}`` in ``optimizer``'s state for this round and reset the local ``v`` to it.

    ``v_hat`` is either one tensor or array per parameter (shapes equal to the parameters'; groups in
    order, then parameters), or one flat 1-D tensor or array of all parameters in that order. Values
    must be finite and ``>= 0`` after conversion to each parameter's dtype; with ``eps_mode="floor"``
    values below ``eps`` are raised to ``eps``. Everything is checked before any state changes.
    """
    import torch

    pairs = _params(optimizer)
    pieces = _split(v_hat, [p for p, _ in pairs])
    for i, ((p, _), piece) in enumerate(zip(pairs, pieces)):
        if not bool(torch.isfinite(piece).all()):
            raise ValueError(f"v_hat for parameter {i} holds NaN or Inf (as {p.dtype})")
        if bool((piece < 0).any()):
            raise ValueError(
                f"v_hat for parameter {i} has a negative value (min {float(piece.min())!r}); allowed: values >= 0"
            )
    for (p, group), piece in zip(pairs, pieces):
        if group["eps_mode"] == "floor":
            piece.clamp_(min=group["eps"])
        state = optimizer.state[p]
        state["v_hat"] = piece
        if group["track_v"]:
            state["v"] = piece.clone()


def _split(v_hat: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``v_hat`` as one owned tensor per parameter (its device, dtype and shape), or ``ValueError``."""
    import torch

    sizes = [p.numel() for p in params]
    if isinstance(v_hat, (torch.Tensor, np.ndarray)):
        flat = torch.as_tensor(v_hat)
        if flat.dim() != 1 or flat.numel() != sum(sizes):
            raise ValueError(
                f"a flat v_hat must be 1-D with {sum(sizes)} values (all parameters in order); "
                f"got shape {tuple(flat.shape)}"
            )
        chunks = [flat[start:stop].reshape(p.shape) for (start, stop), p in zip(segments_from_sizes(sizes), params)]
    elif isinstance(v_hat, (list, tuple)):
        if len(v_hat) != len(params):
            raise ValueError(
                f"v_hat has {len(v_hat)} tensors; allowed: one per parameter ({len(params)}), or one flat vector"
            )
        chunks = []
        for i, (c, p) in enumerate(zip(v_hat, params)):
            c = torch.as_tensor(c)
            if tuple(c.shape) != tuple(p.shape):
                raise ValueError(
                    f"v_hat[{i}] has shape {tuple(c.shape)}; allowed: the parameter's shape {tuple(p.shape)}"
                )
            chunks.append(c)
    else:  # ValueError like every other bad v_hat: one except clause for a bad broadcast
        raise ValueError(  # noqa: TRY004
            f"v_hat of type {type(v_hat).__name__} is not allowed; allowed: a list of tensors (one per parameter) "
            "or one flat tensor / numpy array"
        )
    return [c.detach().to(device=p.device, dtype=p.dtype, copy=True).contiguous() for c, p in zip(chunks, params)]


def global_v_hat(optimizer: LocalLAMB) -> list[torch.Tensor]:
    """A copy of the ``v_hat`` in ``optimizer``'s state, one tensor per parameter in order."""
    return [optimizer.state[p]["v_hat"].clone() for p, _ in _params(optimizer)]


def local_v(optimizer: LocalLAMB) -> list[torch.Tensor]:
    """A copy of the local ``v`` (what Fed-LAMB / Fed-AMS upload), one tensor per parameter in order."""
    pairs = _params(optimizer)
    if not all(g["track_v"] for _, g in pairs):
        raise RuntimeError("local_v() needs track_v=True in every parameter group of the LocalLAMB")
    return [optimizer.state[p]["v"].clone() for p, _ in pairs]


def flat_local_v(
    optimizer: LocalLAMB, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The local ``v`` of all parameters in order as one 1-D tensor (default: ``float32`` on the CPU)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    return torch.cat([v.reshape(-1).to(device=device, dtype=dtype) for v in local_v(optimizer)])
