"""Client side of Fed-LAMB, Mime-LAMB, Fed-AMS and Mime (:class:`pollen.strategies.FedLAMB`): the ``adaptive-local`` local step.

One train message: take ``v_hat`` from the message (the server sends it when this client does not
hold its current version) or from client state; restore this client's momentum ``m`` from client
state; on a Mime sync round first take the full-batch gradient of the local data at the received
model (extra ``grad``, BatchNorm statistics left as they are); then run the local steps with
:class:`~pollen.clientside.lamb.LocalLAMB` (LAMB trust ratio or plain AMSGrad step, as the server
says), keep ``m`` for the next round, and on a Fed-* sync round upload the local ``v`` (extra ``v``).
The model itself is uploaded as usual (full, or compressed when the server asks).
"""

from __future__ import annotations

import numpy as np

from pollen.wire import protocol
from pollen.clientside.steps.work import LocalWork, StepOutcome, run_sgd, train_metrics
from pollen.wire.protocol import (
    CFG_BETA1,
    CFG_BETA2,
    CFG_EPS,
    CFG_STAT,
    CFG_SYNC,
    CFG_TRUST_RATIO,
    CFG_VHAT_VERSION,
)
from pollen.wire.records import record_to_arrays

V_HAT = "adaptive.v_hat"
V_HAT_VERSION = "adaptive.v_hat_version"
MOMENTUM = "adaptive.m"


def _global_v_hat(work: LocalWork, dim: int) -> np.ndarray:
    """This round's ``v_hat``: from the message when sent, else the copy kept in client state."""
    version = int(work.config[CFG_VHAT_VERSION])
    record = work.msg.content.array_records.get(protocol.extra_record("v_hat"))
    if record is not None:
        v_hat = np.array(record_to_arrays(record)[protocol.EXTRA_ARRAY], dtype=np.float32)
        if v_hat.shape != (dim,) or not np.isfinite(v_hat).all() or (v_hat < 0).any():
            raise ValueError(f"the server's v_hat has shape {v_hat.shape} or bad values; expected {dim} values >= 0")
        work.state.set(V_HAT, v_hat)
        work.state.set(V_HAT_VERSION, np.array(version, dtype=np.int64))
        return v_hat
    held, held_version = work.state.get(V_HAT), work.state.get(V_HAT_VERSION)
    if held is None or held_version is None or int(held_version) != version or held.shape != (dim,):
        raise ValueError(f"this client holds no v_hat of version {version}; the server sends it with the next message")
    return held


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
    optimizer = LocalLAMB(
        params,
        lr=float(work.setting("local-lr")),
        betas=(float(config[CFG_BETA1]), float(config[CFG_BETA2])),
        weight_decay=float(work.setting("weight-decay")),
        eps=float(config[CFG_EPS]),
        trust_ratio=bool(config[CFG_TRUST_RATIO]),
        track_v=stat == "v",
    )
    optimizer.set_global_v_hat(_global_v_hat(work, layout.dim))
    momentum = work.state.get(MOMENTUM)
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
        extras["v"] = optimizer.flat_local_v().numpy()
    work.state.set(MOMENTUM, torch.cat([optimizer.state[p]["m"].reshape(-1) for p in params]).cpu().numpy())
    metrics = train_metrics(result)
    metrics["grad-evals"] = int(result.num_steps + extra_batches)
    return StepOutcome(metrics, extras=extras)
