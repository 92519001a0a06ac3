"""Partitioners, train/validation splits, caching, loaders, augmentation and config validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pollen.task import data as D
from pollen.task import partitions as P
from pollen.task import sources as S
from pollen.task.transforms import BatchAugment, BatchCollate, BatchTensorDataset, to_tensor


@pytest.fixture(autouse=True)
def _embedded_only(monkeypatch, tmp_path):
    """Fashion-MNIST from the embedded subset (12,000 / 2,000), no network, fresh caches."""
    import datasets.config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("POLLEN_CACHE_DIR", str(tmp_path / "partition-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setitem(S.SYSTEM_DIRS, "fashion-mnist", ())
    D.clear_caches()
    yield
    D.clear_caches()


LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 100 per class


def _classes(labels, parts):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


def _check_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx))
    assert allidx.min() >= 0 and allidx.max() < n
    return allidx


# --------------------------------------------------------------------------- partitioners


def test_iid_sizes_and_cover():
    parts = P.make_partitions(LABELS, "iid", num_partitions=8, seed=1)
    assert [len(p) for p in parts] == [125] * 8
    assert len(_check_disjoint_cover(parts, 1000)) == 1000
    # Shuffled before splitting: every client sees (almost) every class.
    assert min(len(c) for c in _classes(LABELS, parts)) >= 8


def _label_skew(parts, labels):
    """Mean over clients of the share of the client's most common class."""
    return float(np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]))


def test_dirichlet_label_skew_grows_as_alpha_falls():
    iid = P.make_partitions(LABELS, "iid", num_partitions=10, seed=0)
    lo = P.make_partitions(LABELS, "dirichlet", num_partitions=10, alpha=0.1, seed=0)
    hi = P.make_partitions(LABELS, "dirichlet", num_partitions=10, alpha=100.0, seed=0)
    assert len(_check_disjoint_cover(lo, 1000)) == 1000
    assert _label_skew(lo, LABELS) > 0.5 > 0.25 > _label_skew(hi, LABELS)
    assert _label_skew(iid, LABELS) < 0.25
    assert min(len(p) for p in lo) >= 1


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_k_classes_per_client(k):
    parts = P.make_partitions(LABELS, "pathological", num_partitions=20, classes_per_partition=k, seed=0)
    classes = _classes(LABELS, parts)
    assert all(len(c) == k for c in classes)
    assert all(i % 10 in c for i, c in enumerate(classes))  # first-deterministic: class i % C
    assert len(_check_disjoint_cover(parts, 1000)) == 1000


def test_shards():
    parts = P.make_partitions(LABELS, "shards", num_partitions=10, shards_per_partition=2, seed=0)
    assert [len(p) for p in parts] == [100] * 10  # 20 shards of 50
    # Label-sorted shards of 50 inside classes of 100: each shard is one class.
    assert all(1 <= len(c) <= 2 for c in _classes(LABELS, parts))
    assert len(_check_disjoint_cover(parts, 1000)) == 1000


@pytest.mark.parametrize("name", P.PARTITIONERS)
def test_partitions_are_deterministic_and_seeded(name):
    a = P.make_partitions(LABELS, name, num_partitions=7, alpha=0.5, seed=3)
    b = P.make_partitions(LABELS, name, num_partitions=7, alpha=0.5, seed=3)
    c = P.make_partitions(LABELS, name, num_partitions=7, alpha=0.5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("name", P.PARTITIONERS)
def test_fast_path_matches_flower_public_api(name):
    """Reading the partitioner's assignment directly gives what load_partition() returns."""
    import datasets

    fast = P.make_partitions(LABELS, name, num_partitions=6, seed=2)
    perm = np.random.default_rng(2).permutation(len(LABELS))
    table = datasets.Dataset.from_dict({"label": LABELS[perm], "_idx": perm}).with_format("arrow")
    part = P._partitioner(
        name, num_partitions=6, num_examples=1000, alpha=0.5, classes_per_partition=2, shards_per_partition=2, seed=2
    )
    part.dataset = table
    slow = [P._read_idx(part.load_partition(pid)) for pid in range(6)]
    assert all(np.array_equal(x, y) for x, y in zip(fast, slow))


@pytest.mark.parametrize(("n", "parts"), [(1000, 7), (997, 10), (60, 60), (61, 3)])
def test_iid_bounds_cut_as_datasets_shard_does(n, parts):
    import datasets

    table = datasets.Dataset.from_dict({"_idx": np.arange(n)})
    bounds = P.contiguous_shard_bounds(n, parts)
    for pid in range(parts):
        shard = np.asarray(table.shard(num_shards=parts, index=pid, contiguous=True)["_idx"])
        assert np.array_equal(shard, np.arange(bounds[pid], bounds[pid + 1]))
    fast = P.make_partitions(np.arange(n) % 10, "iid", num_partitions=parts, seed=3)
    assert sorted(np.concatenate(fast).tolist()) == list(range(n))


def test_more_partitions_than_examples():
    with pytest.raises(ValueError, match=r"num-partitions=11 is more than the 10 training examples"):
        P.make_partitions(np.arange(10) % 2, "iid", num_partitions=11)


def test_impossible_shards_name_the_partitioner():
    with pytest.raises(ValueError, match="partitioner='shards' cannot split"):
        P.make_partitions(np.arange(10) % 2, "shards", num_partitions=8, shards_per_partition=2)


def test_train_val_split():
    idx = np.arange(100, 200)
    tr, va = P.split_train_val(idx, 0.1, seed=0, partition_id=3)
    assert len(va) == 10 and len(tr) == 90
    assert set(tr) | set(va) == set(idx) and not set(tr) & set(va)
    tr2, va2 = P.split_train_val(idx, 0.1, seed=0, partition_id=3)
    assert np.array_equal(va, va2) and np.array_equal(tr, tr2)
    assert not np.array_equal(va, P.split_train_val(idx, 0.1, seed=1, partition_id=3)[1])
    assert len(P.split_train_val(idx[:1], 0.5, 0, 0)[0]) == 1  # never empties the train split
    assert len(P.split_train_val(idx, 0.0, 0, 0)[1]) == 0


# --------------------------------------------------------------------------- load_partition / load_test_set


def test_load_partition_on_embedded_subset():
    cfg = D.DataConfig(num_partitions=10, val_fraction=0.1)
    train, val = D.load_partition(cfg, 0, batch_size=64)
    assert len(train.dataset) == 1080 and len(val.dataset) == 120
    x, y = next(iter(train))
    assert x.shape == (64, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    # Normalised with Fashion-MNIST's mean/std: roughly zero mean, unit spread.
    xs = train.dataset.tensors[0]
    assert abs(xs.mean().item()) < 0.1 and 0.8 < xs.std().item() < 1.2
    test = D.load_test_set(cfg, batch_size=500)
    assert len(test.dataset) == 2000 and sum(len(b[1]) for b in test) == 2000
    # Partitions of one config are disjoint and cover the training split.
    table = D.partition_indices(cfg)
    allidx = np.concatenate([np.concatenate(p) for p in table])
    assert len(allidx) == len(np.unique(allidx)) == 12_000


def test_test_examples_keep_a_seeded_subset_of_the_split_in_its_order():
    cfg = D.DataConfig(num_partitions=10, seed=3)
    whole = D.load_test_set(cfg, batch_size=500).dataset
    subset = D.load_test_set(cfg, batch_size=64, examples=300).dataset
    assert len(subset) == 300
    # the same subset for every call with this seed (and batch size), a different one for another seed
    assert torch.equal(D.load_test_set(cfg, batch_size=7, examples=300).dataset.tensors[1], subset.tensors[1])
    other = D.load_test_set(dataclasses.replace(cfg, seed=4), batch_size=64, examples=300).dataset
    assert not torch.equal(other.tensors[0], subset.tensors[0])
    # each kept example is the split's own, in the split's order
    rows = {bytes(x.numpy().tobytes()): i for i, x in enumerate(whole.tensors[0])}
    positions = [rows[bytes(x.numpy().tobytes())] for x in subset.tensors[0]]
    assert positions == sorted(positions) and len(set(positions)) == 300
    assert torch.equal(whole.tensors[1][positions], subset.tensors[1])
    assert len(D.load_test_set(cfg, 64, examples=len(whole)).dataset) == len(whole)
    assert D.load_test_set(cfg, 64, examples=0).dataset is whole


@pytest.mark.parametrize(
    ("examples", "allowed"), [(-1, "an integer >= 0"), (2.5, "an integer >= 0"), (2001, "1 to 2000")]
)
def test_test_examples_outside_the_split_are_refused(examples, allowed):
    with pytest.raises(ValueError, match=f"test-examples={examples}.*allowed: .*{allowed}"):
        D.load_test_set(D.DataConfig(), 64, examples=examples)


def test_partition_cache_hit():
    cfg = D.DataConfig(partitioner="dirichlet", num_partitions=20, alpha=0.3, seed=5)
    a_train, a_val = D.load_partition(cfg, 7, 32)
    b_train, b_val = D.load_partition(cfg, 7, 16)
    assert a_train.dataset is b_train.dataset and a_val.dataset is b_val.dataset
    assert D.partition_indices(cfg) is D.partition_indices(dataclasses.replace(cfg))
    assert D._partition_table.cache_info().misses == 1
    assert D.load_test_set(cfg, 8).dataset is D.load_test_set(cfg, 64).dataset
    assert D._raw.cache_info().misses == 1  # the raw arrays were loaded once


def test_partition_contents_match_labels():
    cfg = D.DataConfig(partitioner="pathological", classes_per_partition=2, num_partitions=10)
    train, val = D.load_partition(cfg, 4, 256)
    labels = set(torch.cat([y for _, y in train]).tolist()) | set(torch.cat([y for _, y in val]).tolist())
    assert len(labels) == 2 and 4 in labels


def test_load_partition_rejects_bad_ids_and_batch_sizes():
    cfg = D.DataConfig(num_partitions=4)
    with pytest.raises(ValueError, match=r"partition-id=4 .*0\.\.3"):
        D.load_partition(cfg, 4, 32)
    with pytest.raises(ValueError, match="batch-size=0"):
        D.load_partition(cfg, 0, 0)


def test_more_partitions_than_examples_through_the_api():
    with pytest.raises(ValueError, match="num-partitions=20000"):
        D.load_partition(D.DataConfig(num_partitions=20_000), 0, 32)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value,key",
    [
        ("dataset", "imagenet", "dataset"),
        ("partitioner", "quantity", "partitioner"),
        ("num_partitions", 0, "num-partitions"),
        ("num_partitions", 2.5, "num-partitions"),
        ("alpha", 0.0, "dirichlet-alpha"),
        ("alpha", float("nan"), "dirichlet-alpha"),
        ("classes_per_partition", 11, "classes-per-partition"),
        ("shards_per_partition", 0, "shards-per-partition"),
        ("val_fraction", 1.0, "val-fraction"),
        ("val_fraction", -0.1, "val-fraction"),
        ("seed", -1, "seed"),
        ("seed", True, "seed"),
    ],
)
def test_validation_names_key_value_and_allowed(field, value, key):
    cfg = dataclasses.replace(D.DataConfig(), **{field: value})
    with pytest.raises(ValueError) as info:
        D.validate_data_config(cfg)
    msg = str(info.value)
    assert msg.startswith(f"{key}=") and repr(value) in msg and "allowed:" in msg


def test_unknown_dataset_lists_the_choices():
    with pytest.raises(ValueError, match="fashion-mnist, mnist, cifar10, cifar100"):
        D.load_partition(D.DataConfig(dataset="svhn"), 0, 32)
    with pytest.raises(ValueError, match="iid, dirichlet, pathological, shards"):
        D.load_partition(D.DataConfig(partitioner="natural"), 0, 32)
    with pytest.raises(ValueError, match="dataset='svhn'"):
        D.dataset_info("svhn")


def test_dataset_info():
    assert D.dataset_info("fashion-mnist") == D.DatasetInfo(1, 28, 10)
    assert D.dataset_info("mnist") == D.DatasetInfo(1, 28, 10)
    assert D.dataset_info("cifar10") == D.DatasetInfo(3, 32, 10)
    assert D.dataset_info("cifar100") == D.DatasetInfo(3, 32, 100)


# --------------------------------------------------------------------------- transforms


def test_to_tensor_layouts_and_normalisation():
    grey = np.full((2, 4, 4), 255, np.uint8)
    t = to_tensor(grey, (0.5,), (0.25,))
    assert t.shape == (2, 1, 4, 4) and torch.allclose(t, torch.full_like(t, 2.0))
    rgb = np.zeros((3, 4, 4, 3), np.uint8)
    rgb[..., 1] = 255
    t = to_tensor(rgb, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert t.shape == (3, 3, 4, 4) and t[:, 1].eq(1).all() and t[:, 0].eq(0).all()


def test_batch_fetch_and_fallback_collate():
    ds = BatchTensorDataset(torch.arange(10.0).view(10, 1, 1, 1), torch.arange(10))
    x, y = BatchCollate()(ds.__getitems__([3, 1]))
    assert y.tolist() == [3, 1] and x.flatten().tolist() == [3.0, 1.0]
    x, y = BatchCollate()([ds[2], ds[5]])  # per-sample fetch still works
    assert y.tolist() == [2, 5]


def test_augment_crop_flip_shapes_and_padding_value():
    torch.manual_seed(0)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
    aug = BatchAugment(mean, std, padding=4, hflip=True)
    x = torch.randn(64, 3, 32, 32)
    out = aug(x)
    assert out.shape == x.shape
    fill = -torch.tensor(mean) / torch.tensor(std)
    # Some crops reach into the padding, which holds the normalised value of a black pixel.
    assert any(torch.isclose(out[:, c], fill[c]).any() for c in range(3))
    # A crop at offset (4, 4) without flip is the identity; every output is a shifted/flipped input.
    aug0 = BatchAugment(mean, std, padding=0, hflip=False)
    assert torch.equal(aug0(x), x)


def test_cifar_style_augmentation_through_loader(tmp_path, monkeypatch):
    # MNIST digits must not be flipped; Fashion-MNIST and CIFAR may be.
    assert not S.SPECS["mnist"].hflip and S.SPECS["cifar10"].hflip
    train, _ = D.load_partition(D.DataConfig(num_partitions=12), 0, 50, augment=True)
    plain, _ = D.load_partition(D.DataConfig(num_partitions=12), 0, 50)
    assert train.dataset is plain.dataset  # augmentation works on batches, data stays cached
    x, _ = next(iter(train))
    assert x.shape == (50, 1, 28, 28)
