"""Client side of HA-Fed (:class:`pollen.strategies.HAFed`): local SGD in segments between gossip steps.

``hafed-local`` (:func:`run_local`, the train message) runs segment 0; ``hafed-gossip``
(:func:`run_gossip`, each mid-round message) runs the next one.

A round is ``tau`` local iterations cut into segments that each end with a gossip step: after
iterations ``G, 2G, ...`` (``G`` = ``gossip-every``) and always after the last one. The train
message starts segment 0 from the global model ``x_t``; each ``hafed-gossip`` message carries the
model the server mixed for this client (``sum_j W_ij x_j^{1/2}``, its cluster's row of ``W``) and
starts the next segment from it. Every reply uploads the model after the segment's steps (the
half-step model ``x^{1/2}`` the server mixes next).

What a client keeps between messages lives in client state, not in the message:

- its **data-loader position** (``gossip.position``, samples consumed so far): batches are read in
  order from an endless stream of per-epoch permutations of the local data (epoch ``e``'s order
  is seeded by the run seed, the client and ``e``), so splitting ``tau`` steps into segments
  draws exactly the batches one uninterrupted run of ``tau`` steps would;
- the **activity draws** of partially active clients (``active-prob`` p, HA-Fed spec §3.6) are a
  pure function of (run seed, client, round, iteration), so they need no stored generator and a
  re-run message draws the same ones. An idle iteration computes nothing and reads no batch.

Local SGD is plain: the server sends momentum 0 and weight decay 0 (spec §8 A5). ``train-loss`` is
the mean minibatch loss over the round's steps so far (kept with the position in client state), so
the uploaders' last reply reports the whole round's, as a client that never gossips would.
"""

from __future__ import annotations

import numpy as np

from pollen.clientside.steps.work import LocalWork, StepOutcome
from pollen.gossip import segment_bounds
from pollen.wire import protocol
from pollen.wire.protocol import (
    CFG_GOSSIP_ACTIVE as CFG_ACTIVE,
)
from pollen.wire.protocol import (
    CFG_GOSSIP_EVERY as CFG_EVERY,
)
from pollen.wire.protocol import (
    CFG_GOSSIP_SEGMENT as CFG_SEGMENT,
)
from pollen.wire.protocol import (
    CFG_GOSSIP_TAU as CFG_TAU,
)

POSITION = "gossip.position"
LOSS = "gossip.loss"  # (sum of minibatch losses, steps) over the round's segments so far


def active_iterations(seed: int, client: int, server_round: int, start: int, stop: int, prob: float) -> int:
    """How many of iterations ``start..stop-1`` this client is active in (Bernoulli(prob) each)."""
    if prob >= 1.0:
        return stop - start
    draws = [np.random.default_rng([seed, client, server_round, i]).random() for i in range(start, stop)]
    return int(sum(d < prob for d in draws))


def stream_indices(seed: int, client: int, size: int, position: int, count: int) -> np.ndarray:
    """Sample indices ``position .. position + count - 1`` of this client's endless epoch stream."""
    out, done = np.empty(count, dtype=np.int64), 0
    while done < count:
        epoch, offset = divmod(position + done, size)
        order = np.random.default_rng([seed, client, epoch]).permutation(size)
        take = min(count - done, size - offset)
        out[done : done + take] = order[offset : offset + take]
        done += take
    return out


def run_segment(work: LocalWork, segment: int) -> StepOutcome:
    """Train this client's steps of ``segment`` from the model already loaded; upload it."""
    from torch.utils.data import DataLoader, Subset

    from pollen.task.train import train

    config = work.config
    tau, every = int(config[CFG_TAU]), int(config[CFG_EVERY])
    bounds = segment_bounds(tau, every)
    if not 0 <= segment < len(bounds):
        raise ValueError(f"gossip segment {segment} does not exist; tau={tau}, gossip-every={every} give {len(bounds)}")
    start, stop = bounds[segment]
    run_seed, client = int(work.settings["seed"]), int(work.task.partition_id)
    steps = active_iterations(run_seed, client, work.server_round, start, stop, float(config[CFG_ACTIVE]))
    batch_size = int(work.setting("batch-size"))
    trainloader, _ = work.task.loaders(batch_size)
    dataset = trainloader.dataset
    if len(dataset) == 0:
        raise ValueError("cannot train on an empty dataset")
    metrics: dict[str, int | float] = {protocol.NUM_EXAMPLES: len(dataset), "num-steps": steps, "grad-evals": steps}
    held_loss = work.state.get(LOSS, shape=(2,), dtype=np.float64) if segment > 0 else None
    loss_sum, loss_steps = (float(held_loss[0]), float(held_loss[1])) if held_loss is not None else (0.0, 0.0)
    if steps == 0:  # idle for the whole segment: the model goes to the gossip as it is
        return StepOutcome(_with_round_loss(metrics, work, loss_sum, loss_steps))
    held = work.state.get(POSITION, shape=(), dtype=np.int64)
    position = int(held) if held is not None else 0
    indices = stream_indices(run_seed, client, len(dataset), position, steps * batch_size)
    loader = DataLoader(
        Subset(dataset, indices.tolist()), batch_size=batch_size, shuffle=False, collate_fn=trainloader.collate_fn
    )
    result = train(
        work.task.model,
        loader,
        lr=float(work.setting("local-lr")),
        local_steps=steps,
        momentum=float(work.setting("momentum")),
        weight_decay=float(work.setting("weight-decay")),
        device=work.task.device,
        seed=work.seed,
    )
    work.state.set(POSITION, np.array(position + steps * batch_size, dtype=np.int64))
    return StepOutcome(_with_round_loss(metrics, work, loss_sum + float(result.train_loss) * steps, loss_steps + steps))


def _with_round_loss(metrics: dict, work: LocalWork, loss_sum: float, loss_steps: float) -> dict:
    """``train-loss``: the mean minibatch loss over the round's steps so far (none while idle throughout)."""
    work.state.set(LOSS, np.array([loss_sum, loss_steps], dtype=np.float64))
    if loss_steps > 0:
        metrics["train-loss"] = loss_sum / loss_steps
    return metrics


def run_local(work: LocalWork) -> StepOutcome:
    """The round's first segment, from the global model the train message carries."""
    return run_segment(work, 0)


def run_gossip(work: LocalWork) -> StepOutcome:
    """A later segment, from the mixed model the gossip message carries."""
    if protocol.ARRAYS_RECORD not in work.msg.content.array_records:
        raise ValueError("a gossip message must carry the mixed model in its 'arrays' record")
    return run_segment(work, int(work.config[CFG_SEGMENT]))
