"""A corpus of altered checkpoints, one real checkpoint per strategy family (issue 24).

Each family's checkpoint after two rounds of a tiny model (pollen's ClientApp in-process) is altered
field by field (removed, renamed, wrong dtype or shape, a huge declared size, NaN, Inf, out of range,
swapped with another strategy's); a deterministic sample covers every alteration kind for every
top-level part of the state. Each file must be refused with one line naming the altered field, or load
to the same meaning, or to a valid state that only differs in what the run reports (byte counts,
metric records, the app's rows); nothing is allocated from a declared size, and the run directory is
left as it was. ``benchmarks/fuzz_checkpoints.py`` runs the whole corpus for every registered strategy.
"""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pollen.core.checkpoint import CheckpointError
from pollen.core.state_fields import StateError
from pollen.testing import altered_files as corpus

# Not a flower_compat module: the corpus is made from real runs of pollen's ClientApp (torch), which the
# newest-Flower environment does not install.

#: A strategy of each family whose state has its own kind of part (the benchmark covers every one).
FAMILIES = ("fedadam", "fedadavr", "fedams", "fed-lamb", "fedbaca")
#: Fields that only report what happened (a changed value is a valid, different report), and the model's
#: own values (any finite model is a valid one: only the digest tells an edited model from the real one).
REPORTED = ("strategy/accounting", "result", "app", "fingerprint")
#: Per-client bookkeeping whose entries may be forgotten safely (the server resends v_hat, starts a new reference).
FORGETTING = ("strategy/client_versions/", "strategy/ledger/", "strategy/sampler/node_clusters")
MODEL_VALUES = ("arrays", "strategy/params", "strategy/current_arrays", "strategy/buffers", "strategy/optimizer")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):  # noqa: ANN001, ANN201
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)  # two rounds of five strategies log a lot; put back for the other tests
    try:
        root = tmp_path_factory.mktemp("runs")
        return {name: corpus.make_base(name, root) for name in FAMILIES}
    finally:
        logger.setLevel(level)


def sample(cases):  # noqa: ANN001, ANN201
    """The first case of every (kind, part of the state): deterministic, every kind for every part."""
    seen, out = set(), []
    for kind, path, tree in cases:
        part = "/".join(map(str, path[:2] if path[0] == "strategy" else path[:1]))
        if (kind, part) not in seen:
            seen.add((kind, part))
            out.append((kind, path, tree))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_every_altered_field_is_refused_with_its_name_or_loads_harmlessly(bases, name, tmp_path):
    base = bases[name]
    reference = corpus.state_of(corpus.resume(base, base.run_dir, trust_file=False))
    donors = [other for other in bases.values() if other is not base][:2]
    cases = sample(corpus.alterations(base, donors))
    assert {kind for kind, _, _ in cases} >= {"removed", "renamed", "dtype", "shape", "nan", "range", "swapped"}
    for kind, path, tree in cases:
        run_dir = corpus.write_altered(base, tree, tmp_path / "altered")
        before = corpus.directory_listing(run_dir)
        outcome = corpus.resume_outcome(base, run_dir, reference, corpus.field_name(path))
        where = "/".join(map(str, path))
        assert outcome.kind != "escaped", f"{kind} {where}: {outcome.message}"
        assert corpus.directory_listing(run_dir) == before, f"{kind} {where} changed the run directory"
        if outcome.kind == "refused" and path[0] not in ("strategy_class", "fingerprint"):
            assert outcome.names_field or "is missing" in outcome.message or "not a field" in outcome.message, (
                f"{kind} {where}: {outcome.message}"
            )
        if outcome.kind == "loaded-other":
            valid_model = kind in ("range", "swapped") and where.startswith(MODEL_VALUES)
            valid_model |= where.startswith("strategy/screen/history/")  # fewer or other valid norms
            valid_model |= kind in ("removed", "renamed") and where.startswith(FORGETTING)
            assert where.startswith(REPORTED) or valid_model, f"{kind} {where} loaded a different state"


def test_a_member_declaring_a_huge_shape_is_refused_before_any_allocation(bases, tmp_path):
    base = bases["fedams"]
    run_dir = corpus.write_altered(base, base.tree, tmp_path / "huge")
    member = corpus.huge_header(run_dir / corpus.CHECKPOINT_FILE)
    tracemalloc.start()
    with pytest.raises(CheckpointError, match=rf"{member}.npy declaring shape \(1000000000000,\)"):
        corpus.resume(base, run_dir)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20


@pytest.mark.parametrize(
    ("name", "path", "value", "words"),
    [
        ("fed-lamb", ("strategy", "v_hat"), "1e30", "expected values <= 1e+15 (a second moment)"),
        ("fedams", ("strategy", "optimizer", "slots", "v"), "-1", "expected values >= 0 (a second moment)"),
        ("fedams", ("round",), 10**12, "expected an integer in [1, 3]"),
        ("fedams", ("strategy", "screen", "history", 0, 0), 1e-30, "expected 0 (no move) or a norm >= 1e-12"),
        ("fedadam", ("strategy", "v_t", 0, 1), "-1", "expected values >= 0 (a second moment)"),
        # Flower's baselines' saved model and moments, held like everyone's (issue 43): the model's dtype (or the
        # float64 Flower's arithmetic gives it), finite, within the screen's hard limit
        ("fedadam", ("arrays", 1, 1), "1e30", "expected values <= 1e+15"),
        ("fedadam", ("arrays", 1, 1), np.int64, "has dtype int64; expected float32 (the model's) or float64"),
        ("fedadam", ("strategy", "current_arrays", 1, 1), "1e30", "expected values <= 1e+15"),
        ("fedadam", ("strategy", "current_arrays", 1, 1), np.int64, "has dtype int64; expected float32"),
        ("fedadam", ("strategy", "m_t", 1, 1), np.int64, "has dtype int64; expected float32"),
        ("fedadam", ("strategy", "v_t", 1, 1), np.float16, "has dtype float16; expected float32"),
        ("fedadam", ("strategy", "v_t", 1, 1), "1e30", "expected values <= 1e+15 (a second moment)"),
    ],
    ids=[
        "v_hat-1e30",
        "adam-v-negative",
        "round-1e12",
        "screen-history-1e-30",
        "flower-v_t-negative",
        "flower-model-1e30",
        "flower-model-int64",
        "flower-current-1e30",
        "flower-current-int64",
        "flower-m_t-int64",
        "flower-v_t-float16",
        "flower-v_t-1e30",
    ],
)
def test_well_formed_but_wrong_edits_are_refused(bases, name, path, value, words, tmp_path):
    base = bases[name]
    old = corpus.get(base.tree, path)
    if isinstance(value, str):  # one coordinate of an array
        new = np.array(old, copy=True)
        new.reshape(-1)[0] = float(value)
    elif isinstance(value, type):  # the array in another dtype
        new = old.astype(value)
    else:
        new = value
    run_dir = corpus.write_altered(base, corpus._set(base.tree, path, new), tmp_path / "edit")
    with pytest.raises(StateError) as caught:
        corpus.resume(base, run_dir)
    message = str(caught.value)
    assert words in message and "\n" not in message and corpus.field_name(path) in message


def test_two_nodes_mapped_to_one_client_id_are_refused(bases, tmp_path):
    base = bases["fedams"]
    keys = dict(base.tree["strategy"]["sampler"]["node_keys"])
    first, second = list(keys)[:2]
    keys[second] = keys[first]
    tree = corpus._set(base.tree, ("strategy", "sampler", "node_keys"), keys)
    run_dir = corpus.write_altered(base, tree, tmp_path / "twice")
    with pytest.raises(StateError, match=rf"node_keys/{second}' maps node {second} to client id .* held by node"):
        corpus.resume(base, run_dir)


def test_a_refused_load_leaves_the_strategy_untouched(bases, tmp_path):
    base = bases["fedadavr"]
    strategy, _ = corpus.resume(base, base.run_dir, trust_file=False)
    before = corpus.state_of((strategy, corpus.resume(base, base.run_dir)[1]))
    tree = base.tree["strategy"]
    bad = corpus._set(tree, ("screen", "history", 0, 0), float("nan"))  # the last part checked before the table
    with pytest.raises(StateError, match="strategy/screen/history/0/0"):
        strategy.load_state_dict(bad, server_round=2)
    assert corpus.same_state(corpus.state_of((strategy, corpus.resume(base, base.run_dir)[1])), before)


def test_the_digest_recorded_with_a_checkpoint_refuses_an_edited_file(bases, tmp_path):
    base = bases["fedams"]
    run_dir = corpus.write_altered(base, corpus._set(base.tree, ("app", "elapsed"), 2.0), tmp_path / "edited")
    with pytest.raises(CheckpointError, match=r"sha256 .* not the .* recorded in checkpoint.npz.sha256"):
        corpus.resume(base, run_dir, trust_file=False)
    corpus.resume(base, run_dir, trust_file=True)  # resume-trust-file=true: every field checked, then loaded
    corpus.resume(base, base.run_dir, trust_file=False)  # the untouched run still resumes
    (run_dir / "checkpoint.npz.sha256").unlink()
    with pytest.raises(CheckpointError, match="checkpoint.npz.sha256 is missing or unreadable"):
        corpus.resume(base, run_dir, trust_file=False)


def test_the_digest_file_is_in_sha256sum_format(bases):
    import hashlib

    base = bases["fedams"]
    digest = hashlib.sha256((base.run_dir / "checkpoint.npz").read_bytes()).hexdigest()
    assert (base.run_dir / "checkpoint.npz.sha256").read_text() == f"{digest}  checkpoint.npz\n"
    assert Path(base.run_dir).is_dir()
