"""A checkpoint's round is bounded by the run that resumes it, in every path (issue 43).

A checkpoint holds the last round it completed. Resumed through ``Strategy.start(..., num_rounds=N,
checkpoint=RunCheckpoint(run_dir, resume=True))`` (a bare checkpoint: no fingerprint) or through the app
(the run-config as fingerprint), its round must be a whole number in ``[1, N - 1]``: one beyond the run,
negative or not an int is refused with one line naming the field and the bound, and a round equal to
``N`` (a finished run) is refused saying the run already finished; for a file whose digest the run
directory lists and for a trusted one (``trust_file=True``) alike. Nothing of the strategy changes and
no round runs.

No torch: these run against the newest Flower too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from pollen.core.checkpoint import load_checkpoint, save_checkpoint
from pollen.core.state_fields import StateError
from pollen.strategies import FedAMS, MeteredFedAdam, RunCheckpoint
from pollen.strategies.engine.buffered import AsyncRule, BufferedAsync
from pollen.strategies.engine.parts import EngineParts
from pollen.strategies.engine.resume import CHECKPOINT_FILE, DIGEST_FILE
from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of, model_record, tiny_model

pytestmark = pytest.mark.flower_compat

NODES = [11, 12, 13, 14]
IDS = {node: f"client-{i}" for i, node in enumerate(NODES)}
STRATEGIES = {
    "fedams": lambda: FedAMS(fraction_evaluate=0.0),
    "fadas-async": lambda: FedAMS(
        fraction_evaluate=0.0,
        parts=EngineParts(driver=BufferedAsync(concurrency=4, buffer_size=2, rule=AsyncRule.fadas())),
    ),
    "flower-fedadam": lambda: MeteredFedAdam(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2),
}


class CountingClient:
    """A full-model client that moves every float tensor a little; counts the messages it answered."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, msg):  # noqa: ANN001, ANN204
        self.calls += 1
        arrays = {
            k: v + np.asarray(0.01 * (msg.metadata.dst_node_id - 10), dtype=v.dtype) if v.dtype.kind == "f" else v
            for k, v in global_arrays_of(msg).items()
        }
        return full_model_reply(msg, arrays, num_examples=10)


def run_two_rounds(name: str, run_dir: Path) -> None:
    STRATEGIES[name]().start(
        grid=FakeGrid(NODES, CountingClient(), client_ids=IDS),
        initial_arrays=model_record(tiny_model(1)),
        num_rounds=2,
        checkpoint=RunCheckpoint(run_dir),
    )


def with_round(run_dir: Path, value: object, *, digest: bool) -> None:
    """Write ``value`` as the checkpoint's round; ``digest``: list the new file's sha256 as a run writes it
    (else the old digest stays, and only a trusted resume reads the file)."""
    tree = load_checkpoint(run_dir / CHECKPOINT_FILE)
    tree["round"] = value
    save_checkpoint(run_dir / CHECKPOINT_FILE, tree)
    if digest:
        sha = hashlib.sha256((run_dir / CHECKPOINT_FILE).read_bytes()).hexdigest()
        (run_dir / DIGEST_FILE).write_text(f"{sha}  {CHECKPOINT_FILE}\n")


def resume(name: str, run_dir: Path, num_rounds: int, *, trust_file: bool) -> tuple[object, CountingClient]:
    client = CountingClient()
    strategy = STRATEGIES[name]()
    strategy.start(
        grid=FakeGrid(NODES, client, client_ids=IDS),
        initial_arrays=model_record(tiny_model(1)),
        num_rounds=num_rounds,
        checkpoint=RunCheckpoint(run_dir, resume=True, trust_file=trust_file),
    )
    return strategy, client


@pytest.mark.parametrize("trust_file", [True, False], ids=["trusted", "digest-listed"])
@pytest.mark.parametrize(
    ("value", "words"),
    [
        (10**12, "is 1000000000000; expected an integer in [1, 3]"),
        (4, "is 4; expected an integer in [1, 3]"),
        (0, "is 0; expected an integer in [1, 3]"),
        (-1, "is -1; expected an integer in [1, 3]"),
        ("2", "is '2' (str); expected an integer in [1, 3]"),
        (2.0, "is 2.0 (float); expected an integer in [1, 3]"),
    ],
    ids=["1e12", "beyond", "zero", "negative", "str", "float"],
)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_round_outside_the_run_is_refused_through_start_with_a_bare_checkpoint(
    name, value, words, trust_file, tmp_path
):  # noqa: ANN001
    run_dir = tmp_path / "run"
    run_two_rounds(name, run_dir)
    with_round(run_dir, value, digest=not trust_file)
    with pytest.raises(StateError) as caught:
        resume(name, run_dir, 3, trust_file=trust_file)
    message = str(caught.value)
    assert "'round'" in message and words in message and "num_rounds=3" in message, message
    assert "\n" not in message and str(run_dir / CHECKPOINT_FILE) in message


@pytest.mark.parametrize("trust_file", [True, False], ids=["trusted", "digest-listed"])
def test_a_finished_run_says_so_instead_of_running_nothing(trust_file, tmp_path):  # noqa: ANN001
    run_dir = tmp_path / "run"
    run_two_rounds("fedams", run_dir)
    if trust_file:
        with_round(run_dir, 2, digest=False)  # the same tree, written again: only the digest differs
    with pytest.raises(StateError, match=r"'round' is 2: the run already finished its last round \(num_rounds=2\)"):
        resume("fedams", run_dir, 2, trust_file=trust_file)
    _, client = resume("fedams", run_dir, 3, trust_file=trust_file)  # one more round: it runs
    assert client.calls == len(NODES)


def test_a_refused_round_runs_nothing_and_leaves_the_strategy_as_it_was(tmp_path):  # noqa: ANN001
    run_dir = tmp_path / "run"
    run_two_rounds("fedams", run_dir)
    with_round(run_dir, 10**12, digest=False)
    client = CountingClient()
    strategy = STRATEGIES["fedams"]()
    before = strategy.state_dict()
    with pytest.raises(StateError):
        strategy.start(
            grid=FakeGrid(NODES, client, client_ids=IDS),
            initial_arrays=model_record(tiny_model(1)),
            num_rounds=3,
            checkpoint=RunCheckpoint(run_dir, resume=True, trust_file=True),
        )
    assert client.calls == 0
    assert strategy.state_dict().keys() == before.keys()
    assert strategy.model.params is None  # no model was loaded


@pytest.mark.parametrize("value", [10**12, -1, "2"], ids=["1e12", "negative", "str"])
def test_the_load_method_takes_the_runs_bound(value, tmp_path):  # noqa: ANN001
    """``RunCheckpoint.load(strategy, num_rounds=...)``: what a driver calls; without ``num_rounds`` the bound
    is the fingerprint's ``num-server-rounds`` (the app's run-config)."""
    run_dir = tmp_path / "run"
    run_two_rounds("fedams", run_dir)
    with_round(run_dir, value, digest=False)
    with pytest.raises(StateError, match=r"'round' is .*; expected an integer in \[1, 3\] \(num_rounds=3"):
        RunCheckpoint(run_dir, resume=True, trust_file=True).load(STRATEGIES["fedams"](), num_rounds=3)
    app = RunCheckpoint(run_dir, resume=True, trust_file=True, fingerprint={"num-server-rounds": 5})
    with pytest.raises(StateError, match=r"'round' is .*; expected an integer in \[1, 5\] \(num-server-rounds=5"):
        app.validate("FedAMS")
    with pytest.raises(StateError, match=r"'round' is .*; expected an integer in \[1, 3\] \(num_rounds=3"):
        app.load(STRATEGIES["fedams"](), num_rounds=3)  # the smaller of the two bounds
