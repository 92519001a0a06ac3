"""The contract of :class:`~pollen.strategies.engine.parts.EngineParts`: the parts a strategy is built from.

A strategy takes Flower's ``FedAvg`` arguments, its method's own and ``parts=EngineParts(...)``: the model, the
sampler, the outlier screen, the ledger, the round's transaction, the accounting, the round driver and the
checkpoint. A part handed in is the very object the strategy works with; a part left ``None`` is built with its
defaults, or with the method's (``default_parts()``: FedAdaVR's and HA-Fed's samplers ask each node for its
client id) where the caller handed none. A part of the wrong type is refused (a ``ValueError`` naming
``parts.<name>`` and what is allowed), and so is a part that already serves another strategy (a sampler or a
screen holds one strategy's state). The strategy's ``min_available_nodes`` is the sampler's unless the sampler
sets its own. ``parts`` is in the signature (no ``**kwargs``) and in the help text.

:class:`~pollen.strategies.engine.ledger.AppliedLedger` ``(tell=..., keep=...)``: ``None`` follows the strategy
(``decide(error_fed)``: clients are told what was applied of their error-fed compressed uploads, and a record is
kept whenever they are told); an explicit value wins; FedLazy keeps a record always.
"""

from __future__ import annotations

import gc
import inspect
import pydoc

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.strategies import FedAdaVR, FedAMS, FedLazy, HAFed, MeteredFedAvg, Uplink
from pollen.strategies.engine.parts import (
    Accounting,
    AppliedLedger,
    ClientSampler,
    EngineParts,
    GlobalModel,
    MeanAggregate,
    RoundTransaction,
    RunCheckpoint,
    SyncRounds,
    UpdateScreen,
)
from pollen.testing.fakes import FakeGrid, config_of, full_model_reply, model_record, named_arrays, tiny_model
from pollen.wire import protocol

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3]


def every_part(tmp_path) -> EngineParts:  # noqa: ANN001
    """One of each part, none with its default settings."""
    return EngineParts(
        model=GlobalModel(buffer_keys=["bn.running_mean", "bn.num_batches_tracked"]),
        sampler=ClientSampler(seed=11),
        screen=UpdateScreen(rule="clip", factor=4.0),
        ledger=AppliedLedger(tell=True),
        transaction=RoundTransaction(min_replies=2),
        accounting=Accounting(),
        driver=SyncRounds(),
        checkpoint=RunCheckpoint(tmp_path),
        round_aggregate=MeanAggregate(),
    )


#: The parts that hold one strategy's state, each built fresh.
STATEFUL_PARTS = {
    "model": GlobalModel,
    "sampler": ClientSampler,
    "screen": UpdateScreen,
    "ledger": AppliedLedger,
    "transaction": RoundTransaction,
    "accounting": Accounting,
}


#: What each strategy uses of its parts, by part name: where it keeps it. Flower's baselines keep Flower's own
#: model and no ledger; their sampler is the reply collector's (Flower samples the nodes itself).
ADAPTIVE = {name: name for name in EngineParts.__dataclass_fields__}
METERED = {
    "sampler": "replies.sampler",
    "screen": "screen",
    "transaction": "transaction",
    "accounting": "accounting",
    "driver": "driver",
    "checkpoint": "checkpoint",
}
STRATEGIES = {
    "fedams": (FedAMS, ADAPTIVE),
    "fedadavr": (FedAdaVR, ADAPTIVE),
    "hafed": (HAFed, ADAPTIVE),
    "metered-fedavg": (MeteredFedAvg, METERED),
}


def held(strategy: object, where: str) -> object:
    for name in where.split("."):
        strategy = getattr(strategy, name)
    return strategy


# ---------------------------------------------------------------------------- handed in
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_part_handed_in_is_the_object_the_strategy_uses(name: str, tmp_path) -> None:  # noqa: ANN001
    make, uses = STRATEGIES[name]
    parts = every_part(tmp_path)
    strategy = make(parts=parts)
    for part, where in uses.items():
        assert held(strategy, where) is getattr(parts, part), part
    if make is not MeteredFedAvg:
        assert strategy.replies.sampler is parts.sampler  # the collector keys replies by the same sampler


class CountingSampler(ClientSampler):
    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.calls = 0

    def sample(self, *args, **kwargs) -> list[int]:  # noqa: ANN002, ANN003
        self.calls += 1
        return super().sample(*args, **kwargs)


class CountingTransaction(RoundTransaction):
    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.settled: list[int] = []

    def settle(self, server_round: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.settled.append(server_round)
        return super().settle(server_round, *args, **kwargs)


def moving_client(msg):  # noqa: ANN001, ANN201
    arrays = {
        k: v + np.asarray(0.01 * msg.metadata.dst_node_id, dtype=v.dtype) if v.dtype.kind == "f" else v
        for k, v in named_arrays(msg.content.array_records[protocol.ARRAYS_RECORD]).items()
    }
    return full_model_reply(msg, arrays, num_examples=10)


def test_a_round_works_with_the_parts_handed_in() -> None:
    parts = EngineParts(
        model=GlobalModel(),
        sampler=CountingSampler(seed=3),
        screen=UpdateScreen(),
        ledger=AppliedLedger(keep=True),
        transaction=CountingTransaction(),
        accounting=Accounting(),
    )
    strategy = FedAMS(fraction_evaluate=0.0, parts=parts)
    grid = FakeGrid(NODES, moving_client)
    messages = strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid)
    strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert parts.sampler.calls == 1
    assert parts.model.params is not None and parts.model.layout.dim == 19
    assert parts.transaction.settled == [1]
    assert parts.accounting.rounds[1].replies == len(NODES)
    assert len(parts.screen.history) == 1 and len(parts.screen.history[0]) == len(NODES)
    assert sorted(parts.ledger.rounds) == [f"node-{node}" for node in NODES]


def test_a_loaded_state_goes_into_the_parts_a_caller_handed_in() -> None:
    """Resume keeps the parts in use: the saved model, ledger, accounting, sampler and screen are loaded into
    the objects the caller handed in, not into new ones the caller never sees."""
    first = FedAMS(
        fraction_evaluate=0.0, parts=EngineParts(sampler=ClientSampler(seed=3), ledger=AppliedLedger(keep=True))
    )
    grid = FakeGrid(NODES, moving_client)
    strategy_round = first.configure_train(1, model_record(tiny_model()), ConfigRecord(), grid)
    first.aggregate_train(1, grid.send_and_receive(strategy_round))
    parts = EngineParts(
        model=GlobalModel(),
        sampler=ClientSampler(seed=3),
        screen=UpdateScreen(),
        ledger=AppliedLedger(keep=True),
        accounting=Accounting(),
    )
    resumed = FedAMS(fraction_evaluate=0.0, parts=parts)
    resumed.load_state_dict(first.state_dict(), server_round=1)
    for name in ("model", "sampler", "screen", "ledger", "accounting"):
        assert getattr(resumed, name) is getattr(parts, name), name
    np.testing.assert_array_equal(parts.model.params, first.params)
    assert parts.ledger.rounds == first.ledger.rounds and sorted(parts.accounting.rounds) == [1]
    assert parts.screen.history == first.screen.history


def test_the_round_aggregate_is_a_part_a_method_or_a_caller_chooses() -> None:
    """FedAdaVR's table aggregate is its default part (the engine's is the mean); a caller's own wins, and one
    without ``sink``/``delta`` is refused naming the part."""
    from pollen.strategies.fedadavr import TableAggregate

    assert isinstance(FedAMS().round_aggregate, MeanAggregate)
    assert isinstance(FedAdaVR().round_aggregate, TableAggregate)
    mean = MeanAggregate()
    assert FedAdaVR(parts=EngineParts(round_aggregate=mean)).round_aggregate is mean
    with pytest.raises(ValueError, match=r"parts\.round_aggregate=.* has no sink"):
        FedAMS(parts=EngineParts(round_aggregate=object()))


# ---------------------------------------------------------------------------- defaults
def test_parts_left_none_are_built_with_their_defaults() -> None:
    strategy = FedAMS()
    assert type(strategy.model) is GlobalModel and strategy.model.buffer_keys is None
    assert type(strategy.sampler) is ClientSampler
    assert (strategy.sampler.seed, strategy.sampler.identify_clients, strategy.sampler.population) == (0, False, 0)
    assert type(strategy.screen) is UpdateScreen
    assert (strategy.screen.rule, strategy.screen.factor, strategy.screen.window, strategy.screen.max_abs) == (
        "clip",
        10.0,
        5,
        1e15,
    )
    assert type(strategy.ledger) is AppliedLedger
    assert strategy.transaction.describe() == {"min_replies": 1, "rollback": True}
    assert type(strategy.accounting) is Accounting and strategy.accounting.rounds == {}
    assert type(strategy.driver) is SyncRounds
    assert strategy.checkpoint is None


def test_each_strategy_gets_parts_of_its_own() -> None:
    first, second = FedAdaVR(), FedAdaVR()
    for name in ("model", "sampler", "screen", "ledger", "transaction", "accounting"):
        assert getattr(first, name) is not getattr(second, name), name


@pytest.mark.parametrize("make", [FedAdaVR, HAFed], ids=["fedadavr", "hafed"])
def test_a_methods_default_sampler_asks_for_client_ids(make: type) -> None:
    assert make.default_parts().sampler.identify_clients is True
    assert make().sampler.identify_clients is True
    assert FedAMS.default_parts() is None and FedAMS().sampler.identify_clients is False


def test_a_methods_defaults_apply_only_where_the_caller_handed_none() -> None:
    own = ClientSampler(seed=5)
    strategy = FedAdaVR(parts=EngineParts(sampler=own))
    assert strategy.sampler is own and own.identify_clients is False  # the caller's sampler, as it was built
    screened = FedAdaVR(parts=EngineParts(screen=UpdateScreen(rule="off")))
    assert screened.sampler.identify_clients is True  # another part handed in: the method's sampler still


# ---------------------------------------------------------------------------- refused
@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("model", "GlobalModel"),
        ("sampler", "ClientSampler"),
        ("screen", "UpdateScreen"),
        ("ledger", "AppliedLedger"),
        ("transaction", "RoundTransaction"),
        ("accounting", "Accounting"),
        ("checkpoint", "RunCheckpoint"),
    ],
)
@pytest.mark.parametrize("make", [FedAMS, MeteredFedAvg], ids=["fedams", "metered-fedavg"])
def test_a_part_of_the_wrong_type_is_refused_naming_it_and_what_is_allowed(make: type, name: str, kind: str) -> None:
    wrong = UpdateScreen() if name != "screen" else ClientSampler()
    with pytest.raises(ValueError, match=rf"^parts\.{name}=.* is not a {kind}; allowed: a {kind}\(\.\.\.\) or None$"):
        make(parts=EngineParts(**{name: wrong}))


def test_a_driver_without_run_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^parts\.driver=.* has no run\(strategy, grid, \.\.\.\); allowed: a round"):
        FedAMS(parts=EngineParts(driver=object()))


@pytest.mark.parametrize("make", [FedAMS, MeteredFedAvg], ids=["fedams", "metered-fedavg"])
def test_parts_that_are_not_engine_parts_are_refused(make: type) -> None:
    with pytest.raises(
        ValueError, match=r"^parts=\{.*\} is not an EngineParts; allowed: EngineParts\(\.\.\.\) or None$"
    ):
        make(parts={"sampler": ClientSampler()})


@pytest.mark.parametrize("name", list(STATEFUL_PARTS))
@pytest.mark.parametrize("second", [FedAMS, HAFed, MeteredFedAvg], ids=["fedams", "hafed", "metered-fedavg"])
def test_a_part_that_serves_another_strategy_is_refused(second: type, name: str) -> None:
    part = STATEFUL_PARTS[name]()
    first = FedAMS(parts=EngineParts(**{name: part}))
    with pytest.raises(ValueError, match=rf"^parts\.{name} \({type(part).__name__}\) already serves another strategy"):
        second(parts=EngineParts(**{name: part}))
    assert getattr(first, name) is part


def test_a_driver_holds_nothing_and_may_serve_several_strategies() -> None:
    driver = SyncRounds()
    assert FedAMS(parts=EngineParts(driver=driver)).driver is FedAMS(parts=EngineParts(driver=driver)).driver


def test_a_part_whose_strategy_is_gone_may_serve_a_new_one() -> None:
    sampler = ClientSampler()
    FedAMS(parts=EngineParts(sampler=sampler))
    gc.collect()
    assert FedAMS(parts=EngineParts(sampler=sampler)).sampler is sampler


def test_a_refused_construction_claims_none_of_its_parts() -> None:
    taken = ClientSampler()
    first = FedAMS(parts=EngineParts(sampler=taken))
    model = GlobalModel()
    with pytest.raises(ValueError, match="parts.sampler") as refused:  # the refusal is kept, as a notebook keeps it
        FedAMS(parts=EngineParts(model=model, sampler=taken))
    assert refused.value is not None and first.sampler is taken
    assert FedAMS(parts=EngineParts(model=model)).model is model  # the caller retries with a sampler of its own


# ---------------------------------------------------------------------------- min_available_nodes
def test_the_strategys_min_available_nodes_is_the_samplers_when_it_sets_none() -> None:
    sampler = ClientSampler()
    FedAMS(min_available_nodes=5, parts=EngineParts(sampler=sampler))
    assert sampler.min_available_nodes == 5
    assert FedAMS().sampler.min_available_nodes == 2  # Flower's default


def test_a_samplers_own_min_available_nodes_wins() -> None:
    sampler = ClientSampler(min_available_nodes=3)
    FedAMS(min_available_nodes=5, parts=EngineParts(sampler=sampler))
    assert sampler.min_available_nodes == 3


# ---------------------------------------------------------------------------- signature and help
@pytest.mark.parametrize("make", [FedAMS, FedAdaVR, HAFed, MeteredFedAvg])
def test_the_signature_shows_parts_and_no_catch_all(make: type) -> None:
    parameters = inspect.signature(make).parameters
    assert parameters["parts"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["parts"].default is None
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters.values())
    assert list(parameters)[:10] == list(inspect.signature(FedAMS).parameters)[:10]  # Flower's FedAvg arguments


@pytest.mark.parametrize(
    "make",
    [
        FedAMS,
        FedAdaVR,
        HAFed,
        MeteredFedAvg,
    ],
)
def test_the_help_text_documents_parts(make: type) -> None:
    text = pydoc.render_doc(make, renderer=pydoc.plaintext)
    documented = make.__doc__.split("Parameters", 1)[-1]
    assert "parts" in documented and "EngineParts" in documented
    assert "EngineParts" in text


# ---------------------------------------------------------------------------- the ledger
@pytest.mark.parametrize(
    ("error_fed", "tell", "keep", "told", "kept"),
    [
        (True, None, None, True, True),
        (False, None, None, False, False),
        (False, True, None, True, True),
        (True, False, None, False, False),
        (True, False, True, False, True),
        (True, True, False, True, False),
    ],
)
def test_decide_settles_only_what_was_left_open(error_fed: bool, tell, keep, told: bool, kept: bool) -> None:  # noqa: ANN001
    ledger = AppliedLedger(tell=tell, keep=keep)
    ledger.decide(error_fed)
    assert (ledger.tell, ledger.keep) == (told, kept)


@pytest.mark.parametrize(
    ("uplink", "told"),
    [
        (Uplink("topk", topk_ratio=0.25), True),
        (Uplink("sign"), True),
        (None, False),
        (Uplink("topk", topk_ratio=0.25, error_feedback=False), False),
        (Uplink("none"), False),
    ],
    ids=["topk-error-fed", "sign-error-fed", "no-uplink", "topk-without-error-feedback", "dense-uplink"],
)
def test_a_ledger_left_open_follows_the_strategy(uplink: Uplink | None, told: bool) -> None:
    strategy = FedAMS(uplink=uplink)
    assert (strategy.ledger.tell, strategy.ledger.keep) == (told, told)


def test_an_explicit_ledger_setting_wins_over_the_strategys() -> None:
    quiet = FedAMS(uplink=Uplink("topk", topk_ratio=0.25), parts=EngineParts(ledger=AppliedLedger(tell=False)))
    assert (quiet.ledger.tell, quiet.ledger.keep) == (False, False)
    telling = FedAMS(parts=EngineParts(ledger=AppliedLedger(tell=True)))
    assert (telling.ledger.tell, telling.ledger.keep) == (True, True)
    recording = FedAMS(parts=EngineParts(ledger=AppliedLedger(keep=True)))
    assert (recording.ledger.tell, recording.ledger.keep) == (False, True)


@pytest.mark.parametrize(("tell", "told"), [(None, True), (False, False)])
def test_a_train_message_carries_the_ledgers_word_only_when_it_tells(tell, told: bool) -> None:  # noqa: ANN001
    strategy = FedAMS(
        fraction_evaluate=0.0,
        uplink=Uplink("topk", topk_ratio=0.25),
        parts=EngineParts(ledger=AppliedLedger(tell=tell)),
    )
    messages = strategy.configure_train(1, model_record(tiny_model()), ConfigRecord(), FakeGrid(NODES, moving_client))
    assert [protocol.CFG_APPLIED_ROUND in config_of(message) for message in messages] == [told] * len(NODES)


@pytest.mark.parametrize(
    ("compressor", "ledger", "told"),
    [("none", None, False), ("topk", None, True), ("none", AppliedLedger(keep=False), False)],
    ids=["dense", "error-fed-topk", "keep-false-handed-in"],
)
def test_fedlazy_keeps_a_ledger_always(compressor: str, ledger: AppliedLedger | None, told: bool) -> None:
    strategy = FedLazy(compressor=compressor, up_tau=0.5, parts=EngineParts(ledger=ledger))
    assert strategy.ledger.keep is True  # ref_mode="consecutive-only" asks who took part in the last round
    assert strategy.ledger.tell is told


def test_fedlazy_keeps_an_explicit_tell() -> None:
    strategy = FedLazy(compressor="topk", up_tau=0.5, parts=EngineParts(ledger=AppliedLedger(tell=False)))
    assert strategy.ledger.tell is False


# ---------------------------------------------------------------------- the lazy family's uplink part
def test_the_lazy_familys_codec_is_its_uplink_part() -> None:
    from pollen.strategies.lazy_uplink import LazyUplink

    strategy = FedLazy(up_rule="aa", compressor="sign")
    assert isinstance(strategy.uplink, LazyUplink)
    assert strategy.uplink.decodes == "sign added to the stored copy (aa)"
    config = strategy.round_config(1)
    # lazy_mod's entries, never compression_mod's: a foreign ClientApp with both mods compresses once
    assert config[protocol.CFG_LAZY_UP_CODEC] == "sign" and config[protocol.CFG_LAZY_UP_RULE] == "aa"
    assert protocol.CFG_CODEC not in config and protocol.CFG_LAZY_UP_TAU in config
    assert FedLazy(compressor="sign", up_rule="nla").uplink.decodes == "sign"


def test_an_aggregator_is_checked_against_what_the_lazy_uplink_decodes_as() -> None:
    FedLazy(compressor="sign", up_rule="nla", error_feedback=False, aggregator="majority-vote")  # plain signs: fits
    with pytest.raises(ValueError, match=r"needs scaled-sign uploads .*'sign added to the stored copy \(aa\)'"):
        FedLazy(compressor="sign", up_rule="aa", aggregator="majority-vote")


def test_a_lazy_uplink_refuses_an_unknown_rule_and_drops_feedback_without_a_codec() -> None:
    from pollen.strategies.lazy_uplink import LazyUplink

    with pytest.raises(ValueError, match=r"up_rule='lazy' is unknown; allowed: "):
        LazyUplink(rule="lazy")
    assert LazyUplink(codec="none", error_feedback=True).error_feedback is False


# ---------------------------------------------------------------------- the screen's one call, a caller's quantity
class _Judged:
    def __init__(self, move: float | None) -> None:
        self.delta, self.norm, self.move, self.record_norms, self.applied_scale = np.zeros(2), 1.0, move, {}, 1.0


def test_filter_judges_the_callers_quantity_against_the_larger_of_its_round_and_its_reference() -> None:
    from pollen.strategies.engine.screening import UpdateScreen

    screen = UpdateScreen(factor=10.0)
    updates = [_Judged(m) for m in (1.0, 1.2, 0.9, 30.0, None)]
    refused: list[tuple[float | None, str]] = []
    kept = screen.filter(
        updates, lambda u, why: refused.append((u.move, why)), reorder=False, norm_of=lambda u: u.move, reference=None
    )
    assert [u.move for u in kept] == [1.0, 1.2, 0.9, None]  # 30 > 10 x the others' median; None is not judged
    assert refused[0][0] == 30.0 and "exceeds 10 " in refused[0][1]
    # a caller's reference stands in for the history: the larger of it and the round's bound
    kept = screen.filter(updates, lambda u, why: None, reorder=False, norm_of=lambda u: u.move, reference=400.0)
    assert len(kept) == 5
    assert not screen.history  # the screen's own history was neither read nor written


def test_filter_rejects_a_callers_quantity_beyond_its_bound_even_when_the_rule_clips() -> None:
    from pollen.strategies.engine.screening import UpdateScreen

    screen = UpdateScreen(rule="clip", factor=10.0)
    updates = [_Judged(m) for m in (1.0, 1.1, 50.0)]
    kept = screen.filter(updates, lambda u, why: None, norm_of=lambda u: u.move, reference=None, reorder=False)
    assert [u.move for u in kept] == [1.0, 1.1] and updates[2].applied_scale == 1.0  # nothing scaled
