"""Every pollen strategy, with its constructor defaults, dropped into Flower's own examples: against FedAvg.

The projects are Flower's examples rebuilt with local data (``pollen/testing/foreign/``): ``fl-tabular``
(an MLP on census-like rows, local Adam, 5 clients) and ``quickstart-pytorch`` (LeNet on CIFAR-like
32x32 images, SGD with momentum, 4 clients), their ``ClientApp`` as the examples write it, run in
process as a local simulation runs them. A user swaps ``FedAvg(...)`` for a pollen strategy and keeps
only the sampling; the bar is Flower's ``FedAvg()`` in the same test, and the promise of the README is
"within 5 points of FedAvg" (mean over seeds 1-3).

- every strategy that works with a foreign ClientApp, on ``fl-tabular``, 5 rounds;
- the flagship FedAMS and FedCAMS (+ ``compression_mod``), FedAdaVR and FedOpt('adabelief') on
  ``quickstart-pytorch`` after 5 rounds (where issue 44 found FedAMS and FedCAMS 50-70 points behind: the
  outlier screen threw honest replies away and the server learning rate was too small for a project whose
  clients train a whole epoch; FedAdaVR and AdaBelief with the paper's bias-corrected moments were 11 points
  behind);
- in none of these runs does the outlier screen reject or clip a reply (every client is honest).

The whole table (three projects, 20 rounds, spread over seeds) is ``benchmarks/bench_dropin.py`` and
``docs/results/dropin.md``. Strategies whose method needs pollen's own client step cannot be dropped into
a foreign ClientApp: for them every reply is rejected with a reason that says what is missing (or the run
stops before round 1 with one line), never a run that silently "works".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import cache

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from pollen.strategies import FedCAMS, FedLAMB, HAFed
from pollen.strategies.engine.rounds import SetupError
from pollen.testing.foreign import harness
from pollen.testing.foreign.fl_tabular import PROJECT as TABULAR
from pollen.testing.foreign.quickstart_pytorch import PROJECT as QUICKSTART
from pollen.testing.relay_demo import RelayAverage

SEEDS = (1, 2, 3)
TOLERANCE = 0.05  # no strategy may end more than 5 points below Flower's FedAvg()
TABULAR_ROUNDS = 5
QUICKSTART_ROUNDS = 5
FLAGSHIP = ("FedAMS()", "FedCAMS() + compression_mod", "FedAdaVR()", "FedOpt('adabelief')")

#: The three tests that use the runs below share one xdist worker, so each run is made once.
DROPIN_GROUP = pytest.mark.xdist_group("dropin-references")


@cache
def drop_in(name: str) -> harness.DropIn:
    return next(d for d in harness.drop_ins() if d.name == name)


@cache
def outcome(project_name: str, name: str, seed: int) -> tuple[float, int]:
    """One run: the accuracy after the project's last round, and the replies the outlier screen rejected or
    clipped."""
    project = {TABULAR.name: TABULAR, QUICKSTART.name: QUICKSTART}[project_name]
    rounds = TABULAR_ROUNDS if project is TABULAR else QUICKSTART_ROUNDS
    d = drop_in(name)
    strategy = d.make(project.fraction_train)
    curve = harness.run_project(project, strategy, seed=seed, num_rounds=rounds, mods=d.mods)
    accounting = getattr(strategy, "accounting", None)
    rejected = (
        sum("outlier screen" in why for stats in accounting.rounds.values() for why in stats.failure_reasons)
        if accounting is not None
        else 0
    )
    return curve[-1], rejected + int(getattr(getattr(strategy, "screen", None), "clipped", 0))


def mean_accuracy(project_name: str, name: str) -> float:
    return statistics.fmean(outcome(project_name, name, seed)[0] for seed in SEEDS)


def behind_fedavg(project_name: str, names: list[str]) -> list[tuple[str, float, float]]:
    bar = mean_accuracy(project_name, "FedAvg()")
    rows = [(name, mean_accuracy(project_name, name)) for name in names]
    print(f"\n{project_name}, mean over seeds {SEEDS}: FedAvg() {bar:.3f}")
    for name, value in rows:
        print(f"  {name:<30} {value:.3f} ({value - bar:+.3f})")
    return [(name, round(value, 3), round(bar, 3)) for name, value in rows if not value >= bar - TOLERANCE]


POLLEN_DROP_INS = [d.name for d in harness.drop_ins() if d.name not in ("FedAvg()", "FedAdam()")]


@pytest.mark.slow  # 11 strategies and FedAvg x 3 seeds x 5 rounds of the tabular MLP: about 35 s
@DROPIN_GROUP
def test_every_strategy_with_its_defaults_keeps_up_with_fedavg_in_fl_tabular() -> None:
    assert not behind_fedavg(TABULAR.name, POLLEN_DROP_INS)
    assert all(math.isfinite(outcome(TABULAR.name, n, s)[0]) for n in POLLEN_DROP_INS for s in SEEDS)


@pytest.mark.slow  # FedAvg and four strategies x 3 seeds x 5 rounds of LeNet: about 2 minutes
@DROPIN_GROUP
def test_the_adaptive_servers_keep_up_with_fedavg_in_quickstart_pytorch_after_5_rounds() -> None:
    """Within 5 points of FedAvg after 5 rounds (``docs/results/dropin.md``): FedAMS, FedCAMS sending 1 bit a
    coordinate (issue 44 found it 42 points behind, 0.48 against 1.00), FedAdaVR and AdaBelief (11 behind with
    the paper's bias-corrected moments)."""
    assert mean_accuracy(QUICKSTART.name, "FedAvg()") >= 0.6  # the project learns in 5 rounds: the bar means something
    assert not behind_fedavg(QUICKSTART.name, list(FLAGSHIP))


@pytest.mark.slow
@DROPIN_GROUP
def test_the_screen_neither_rejects_nor_clips_an_honest_reply_in_these_runs() -> None:
    runs = [(TABULAR.name, n) for n in POLLEN_DROP_INS] + [(QUICKSTART.name, n) for n in FLAGSHIP]
    rejected = {(p, n, s): outcome(p, n, s)[1] for p, n in runs for s in SEEDS}
    assert not {k: v for k, v in rejected.items() if v}, rejected


@pytest.mark.slow
def test_fedcams_really_compresses_in_the_foreign_project() -> None:
    """The mod compressed: a scaled-sign upload of LeNet's 62k parameters is 1/23.7 of float32 (bytes measured
    from the records): d/8 bytes of signs plus, for each of its 10 tensors, a scale and its record entries
    (about 270 bytes a tensor; one scale for the model would be about 1/31)."""
    d = drop_in("FedCAMS() + compression_mod")
    strategy = d.make(1.0)
    assert isinstance(strategy, FedCAMS) and strategy.granularity == "tensor"
    harness.run_project(QUICKSTART, strategy, seed=1, num_rounds=1, mods=d.mods)
    stats = strategy.accounting.round(1)
    assert 0 < 20 * stats.uplink_update_bytes < stats.uplink_fp32_bytes, stats


def test_the_foreign_evaluate_answers() -> None:
    """The project's ``@app.evaluate()`` works on a model the server sends (Flower's federated evaluation)."""
    net = QUICKSTART.net()
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord()})
    msg = Message(content=content, dst_node_id=1, message_type="evaluate")
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": QUICKSTART.num_clients},
        state=RecordDict(),
        run_config={"seed": 1},
    )
    metrics = QUICKSTART.make_app([])(msg, context).content["metrics"]
    assert metrics["num-examples"] == 250 and 0.0 <= metrics["eval_acc"] <= 1.0


# --------------------------------------------------------------------------- methods that need pollen's client
#: Each needs something only pollen's ClientApp does: Fed-LAMB / Mime-LAMB / Fed-AMS / Mime upload a
#: statistic with the model (local ``v`` or a full-batch gradient) and run pollen's local step;
#: RelayAverage answers a mid-round ``train.pollen_phase`` message; HA-Fed with gossip (below) needs
#: each node's cluster id and answers gossip messages.
SAMPLING = {"fraction_train": 1.0, "fraction_evaluate": 0.0}
NEEDS_POLLEN_CLIENT = [
    ("FedLAMB()", lambda: FedLAMB(**SAMPLING), "reply lacks the extra record 'pollen.x.v'"),
    (
        "FedLAMB(variant='mime-lamb')",
        lambda: FedLAMB(variant="mime-lamb", **SAMPLING),
        "reply lacks the extra record 'pollen.x.grad'",
    ),
    (
        "FedLAMB(variant='fed-ams')",
        lambda: FedLAMB(variant="fed-ams", **SAMPLING),
        "reply lacks the extra record 'pollen.x.v'",
    ),
    (
        "FedLAMB(variant='mime')",
        lambda: FedLAMB(variant="mime", **SAMPLING),
        "reply lacks the extra record 'pollen.x.grad'",
    ),
    ("RelayAverage()", lambda: RelayAverage(**SAMPLING), "No train function registered with name 'pollen_phase'"),
]


@pytest.mark.parametrize(("name", "make", "reason"), NEEDS_POLLEN_CLIENT, ids=[n for n, _, _ in NEEDS_POLLEN_CLIENT])
def test_methods_that_need_pollens_client_reject_every_reply_with_a_reason(
    name: str, make: Callable, reason: str
) -> None:
    strategy = make()
    accuracy = harness.run_project(TABULAR, strategy, seed=1, num_rounds=1)
    reasons = strategy.accounting.round(1).failure_reasons
    assert len(reasons) >= TABULAR.num_clients and all(reason in r for r in reasons[: TABULAR.num_clients]), reasons
    assert accuracy[1] == accuracy[0]  # the model did not move


def test_hafed_with_gossip_stops_before_round_1_without_cluster_ids() -> None:
    """HA-Fed's gossip needs clusters that pollen's ClientApp reports; a foreign one cannot."""
    with pytest.raises(SetupError, match="cluster id"):
        harness.run_project(TABULAR, HAFed(**SAMPLING), seed=1, num_rounds=1)
