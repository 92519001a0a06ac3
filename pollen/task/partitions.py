"""Splitting a training set among clients with flwr-datasets' partitioners.

The partitioners run on a small label-only ``datasets.Dataset`` (columns ``label`` and ``_idx``), so
the same code partitions data from every source without copying images into Arrow. As
``FederatedDataset`` does, the rows are shuffled with the seed before partitioning.

=============  =========================================================================================
iid            ``IidPartitioner``: equal contiguous shares of the shuffled data.
dirichlet      ``DirichletPartitioner(alpha, self_balancing=True)``: per class, shares drawn from
               Dir(alpha); clients above the average size get no more (niid_bench's rule).
pathological   ``PathologicalPartitioner(class_assignment_mode="first-deterministic")``: client ``i``
               holds class ``i % C`` plus ``k - 1`` random others; each class is split equally among
               its holders (niid_bench's ``label_quantity``).
shards         ``ShardPartitioner``: sort by label, cut into ``num_partitions * s`` equal shards,
               deal ``s`` random shards to each client (McMahan et al. 2017).
=============  =========================================================================================
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from pollen.task.catalog import PARTITIONERS

__all__ = ["PARTITIONERS", "PARTITIONER_SETTINGS", "make_partitions", "split_train_val"]

#: The ``make_partitions`` keyword arguments each partitioner reads besides ``num_partitions`` and
#: ``seed`` (the on-disk partition cache keys on exactly these; keep in step with ``_partitioner``).
PARTITIONER_SETTINGS: dict[str, tuple[str, ...]] = {
    "iid": (),
    "dirichlet": ("alpha",),
    "pathological": ("classes_per_partition",),
    "shards": ("shards_per_partition",),
}


def _partitioner(
    name: str,
    *,
    num_partitions: int,
    num_examples: int,
    alpha: float,
    classes_per_partition: int,
    shards_per_partition: int,
    seed: int,
):
    from flwr_datasets import partitioner as fp  # noqa: PLC0415 - lazy, imports `datasets`

    if name == "iid":
        return fp.IidPartitioner(num_partitions)
    if name == "dirichlet":
        # niid_bench asks for >= 10 examples per client; scale that down for tiny datasets.
        min_size = min(10, max(1, num_examples // (5 * num_partitions)))
        return fp.DirichletPartitioner(
            num_partitions,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=min_size,
            self_balancing=True,
            shuffle=True,
            seed=seed,
        )
    if name == "pathological":
        return fp.PathologicalPartitioner(
            num_partitions,
            partition_by="label",
            num_classes_per_partition=classes_per_partition,
            class_assignment_mode="first-deterministic",
            shuffle=True,
            seed=seed,
        )
    if name == "shards":
        return fp.ShardPartitioner(
            num_partitions,
            partition_by="label",
            num_shards_per_partition=shards_per_partition,
            shuffle=True,
            seed=seed,
        )
    raise ValueError(f"partitioner={name!r} is unknown; allowed: {', '.join(PARTITIONERS)}")


def make_partitions(
    labels: np.ndarray,
    partitioner: str,
    *,
    num_partitions: int,
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    shards_per_partition: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Indices into ``labels`` for each of ``num_partitions`` clients (int64 arrays).

    Raises ``ValueError`` (one line, naming the key) when the partition cannot be made, e.g. more
    partitions than examples, or a partition that comes out empty.
    """
    import datasets  # noqa: PLC0415

    n = len(labels)
    if num_partitions > n:
        raise ValueError(f"num-partitions={num_partitions} is more than the {n} training examples; allowed: 1..{n}")
    if partitioner == "shards" and num_partitions * shards_per_partition > n:
        # flwr-datasets 0.6 divides by a zero shard size here instead of raising.
        raise ValueError(
            f"partitioner='shards' cannot split {n} examples into num-partitions={num_partitions} x "
            f"shards-per-partition={shards_per_partition} shards; use fewer partitions or shards"
        )
    # Seeded shuffle first (as FederatedDataset does), done in numpy so the table has no indices
    # mapping; "arrow" format because flwr-datasets 0.6 reads whole label columns with np.asarray(),
    # which datasets 4 serves row by row (seconds for 60k rows) in the default python format.
    perm = np.random.default_rng(seed).permutation(n)
    labels = np.asarray(labels, dtype=np.int64)[perm]
    table = datasets.Dataset.from_dict({"label": labels, "_idx": perm}).with_format("arrow")
    part = _partitioner(
        partitioner,
        num_partitions=num_partitions,
        num_examples=n,
        alpha=alpha,
        classes_per_partition=classes_per_partition,
        shards_per_partition=shards_per_partition,
        seed=seed,
    )
    part.dataset = table
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # unused classes / Dirichlet resampling notes
            warnings.simplefilter("ignore", FutureWarning)  # pyarrow sort options (ShardPartitioner)
            out = _all_partitions(part, num_partitions)
    except (ValueError, ZeroDivisionError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(
            f"partitioner={partitioner!r} cannot split {n} examples into num-partitions={num_partitions}: {msg}"
        ) from err
    empty = [pid for pid, idx in enumerate(out) if len(idx) == 0]
    if empty:
        raise ValueError(
            f"partitioner={partitioner!r} left {len(empty)} of num-partitions={num_partitions} empty "
            f"(first: {empty[0]}) with {n} examples; use fewer partitions or another partitioner"
        )
    return out


def contiguous_shard_bounds(n: int, num_shards: int) -> np.ndarray:
    """Where each of ``num_shards`` contiguous shards of ``n`` rows starts (and the last one ends), as
    ``datasets.Dataset.shard(contiguous=True)`` cuts them: the first ``n % num_shards`` shards one row longer."""
    size, extra = divmod(n, num_shards)
    index = np.arange(num_shards + 1, dtype=np.int64)
    return index * size + np.minimum(index, extra)


def _read_idx(ds) -> np.ndarray:
    return np.asarray(ds.with_format("numpy")[:]["_idx"], dtype=np.int64)


def _all_partitions(part, num_partitions: int) -> list[np.ndarray]:
    """Every partition's ``_idx`` values.

    The public path is ``part.load_partition(pid)`` per partition (a ``select`` each: about 4-10 ms, so
    40 s for 10,000 clients). The partitioners that assign all partitions at once keep the assignment in
    ``_partition_id_to_indices`` (positions in ``part.dataset``); reading that is 10x faster and gives
    the same indices. ``IidPartitioner`` is ``dataset.shard(num_partitions, pid, contiguous=True)``:
    contiguous runs whose bounds are computed here at once (the first and last are checked against
    ``load_partition``). tests/unit/test_data_partitions.py checks every fast path against the public one.
    """
    first = _read_idx(part.load_partition(0))  # decides the assignment of every partition
    if type(part).__name__ == "IidPartitioner":
        col = np.asarray(part.dataset.with_format("arrow")["_idx"], dtype=np.int64)
        bounds = contiguous_shard_bounds(len(col), num_partitions)
        out = [col[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]
        last = num_partitions - 1
        if np.array_equal(out[0], first) and np.array_equal(out[last], _read_idx(part.load_partition(last))):
            return out
    mapping = getattr(part, "_partition_id_to_indices", None)
    determined = getattr(part, "_partition_id_to_indices_determined", False)
    if determined and isinstance(mapping, dict) and len(mapping) == num_partitions:
        col = np.asarray(part.dataset.with_format("arrow")["_idx"], dtype=np.int64)
        out = [col[np.asarray(mapping[pid], dtype=np.int64)] for pid in range(num_partitions)]
        if np.array_equal(out[0], first):
            return out
    return [first] + [_read_idx(part.load_partition(pid)) for pid in range(1, num_partitions)]


def split_train_val(
    indices: np.ndarray, val_fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded held-out split of one partition: ``floor(val_fraction * n)`` examples for validation.

    At least one example always stays in the training split.
    """
    n = len(indices)
    n_val = min(int(math.floor(val_fraction * n)), n - 1)
    perm = np.random.default_rng([seed, partition_id, 0x5EED]).permutation(n)
    return np.sort(indices[perm[n_val:]]), np.sort(indices[perm[:n_val]])
