"""Methods as compositions: any server optimiser x any uplink x mean / weighted / FedAdaVR's table.

The papers' methods are named points of that space (``FedCAMS`` is ``FedAMS`` with an ``Uplink``);
combinations no paper ran need no class: AdaBelief with scaled-sign uploads (``FedOpt``), FedAdaVR
with error-fed top-k uploads (``FedAdaVR(uplink=...)``). These tests run such combinations through
pollen's real compression mod on the fake grid and check them against the named methods bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.strategies import FedAdaVR, FedAMS, FedCAMS, FedOpt, Uplink
from pollen.strategies.engine.parts import ClientSampler, EngineParts
from pollen.testing.fakes import FakeGrid, make_context, model_record, named_arrays, tiny_model
from pollen.wire import protocol
from tests.flower.test_strategy_fedams import mod_client

pytestmark = pytest.mark.flower_compat
NODES = [5, 6, 7, 8, 9, 10]
SAMPLING = dict(fraction_train=0.5, fraction_evaluate=0.0)


def parts(identify_clients: bool = False) -> EngineParts:
    """Each strategy's own parts: the seeded sampler these runs compare under (by node ids unless asked)."""
    return EngineParts(sampler=ClientSampler(seed=11, identify_clients=identify_clients))


def run(strategy, rounds: int = 4):  # noqa: ANN001, ANN201
    contexts = {n: make_context(n) for n in NODES}
    codecs: list = []
    grid = FakeGrid(NODES, mod_client(contexts, codecs))
    result = strategy.start(grid=grid, initial_arrays=model_record(tiny_model(3)), num_rounds=rounds)
    return strategy, grid, codecs, named_arrays(result.arrays)


def test_fedcams_is_fedams_given_an_uplink_bit_for_bit() -> None:
    settings = dict(eta=0.3, beta_1=0.9, beta_2=0.9, eps=1e-3, bias_correction=False, **SAMPLING)
    named, _, _, final_named = run(FedCAMS(compressor="topk", topk_ratio=0.25, parts=parts(), **settings))
    composed, _, _, final_composed = run(FedAMS(uplink=Uplink("topk", topk_ratio=0.25), parts=parts(), **settings))
    np.testing.assert_array_equal(named.params, composed.params)
    for name in final_named:
        np.testing.assert_array_equal(final_named[name], final_composed[name])
    assert named.accounting.rounds[4].uplink_update_bytes == composed.accounting.rounds[4].uplink_update_bytes


def test_fedopt_amsgrad_is_fedams_bit_for_bit() -> None:
    fedams, _, _, _ = run(FedAMS(eta=0.3, beta_2=0.9, eps=1e-3, option=1, parts=parts(), **SAMPLING))
    fedopt, _, _, _ = run(
        FedOpt(
            optimizer="amsgrad",
            eta=0.3,
            beta_2=0.9,
            eps=1e-3,
            eps_mode="max",
            bias_correction=False,
            parts=parts(),
            **SAMPLING,
        )
    )
    np.testing.assert_array_equal(fedams.params, fedopt.params)


def test_adabelief_with_scaled_sign_uploads_runs_and_compresses() -> None:
    strategy, grid, codecs, _ = run(
        FedOpt(optimizer="adabelief", eta=0.01, uplink=Uplink("sign"), parts=parts(), **SAMPLING)
    )
    assert set(codecs) == {"sign"}
    assert all(
        set(r.content.array_records) == {protocol.UPDATE_RECORD, protocol.BUFFERS_RECORD}
        for r in grid.replies
        if r.has_content()
        if r.metadata.message_type == "train"
    )
    dim = strategy.layout.dim
    stats = strategy.accounting.rounds[4]
    assert stats.replies == 3 and stats.failures == 0
    metas = [
        r.content.config_records[protocol.UPDATE_META_RECORD]
        for r in grid.replies
        if r.has_content() and protocol.UPDATE_RECORD in r.content.array_records
    ]
    assert metas and {meta[protocol.META_CODEC] for meta in metas} == {"sign"}
    assert np.isfinite(strategy.params).all() and strategy.opt_state.step == 4
    assert strategy.params.shape == (dim,)


def test_fedadavr_with_error_fed_topk_uploads_fills_its_table() -> None:
    strategy, grid, codecs, _ = run(
        FedAdaVR(uplink=Uplink("topk", topk_ratio=0.25), eta=0.01, parts=parts(identify_clients=True), **SAMPLING)
    )
    assert set(codecs) == {"topk"}
    stats = strategy.accounting.rounds[4]
    assert stats.replies == 3 and stats.failures == 0
    metas = [
        r.content.config_records[protocol.UPDATE_META_RECORD]
        for r in grid.replies
        if r.has_content() and protocol.UPDATE_RECORD in r.content.array_records
    ]
    assert metas and {meta[protocol.META_CODEC] for meta in metas} == {"topk"}
    assert strategy.table.known_clients == len({n for call in grid.sampled_per_call() for n in call})


def test_a_setting_the_optimiser_has_no_use_for_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"sgd takes no setting beta_1=0.5; allowed: eta$"):
        FedOpt(optimizer="sgd", beta_1=0.5)
    with pytest.raises(ValueError, match="optimizer='rmsprop' is unknown; allowed: sgd"):
        FedOpt(optimizer="rmsprop")
    with pytest.raises(ValueError, match="uplink codec='zip' is unknown"):
        Uplink("zip")
