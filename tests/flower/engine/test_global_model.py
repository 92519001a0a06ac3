"""The contract of :class:`~pollen.strategies.engine.model.GlobalModel`, the global model a strategy holds.

It takes the ``ArrayRecord`` Flower hands a strategy (:meth:`adopt`), keeps the trainable arrays as one
flat float32 vector ``params`` (what the server optimiser steps) and the buffers (integer counters,
normalisation statistics) apart, and gives a record back (:meth:`to_record`) in the record's own key
order with each array's own dtype. Buffers are averaged over the clients, never stepped. It refuses a
record that does not fit the model it knows with a ``ValueError`` naming the array, and saves and restores
itself (a saved state that does not describe a usable model is a ``StateError`` naming the field, and the
model stays as it was).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from pollen.core.state_fields import StateError
from pollen.strategies.engine.model import GlobalModel
from pollen.testing.fakes import model_record, named_arrays

pytestmark = pytest.mark.flower_compat


def mixed_model() -> OrderedDict[str, np.ndarray]:
    """Buffers between trainable arrays, and three float dtypes: what a real PyTorch state dict can hold."""
    return OrderedDict(
        [
            ("fc.weight", np.array([[0.5, -1.5], [2.0, 4.0]], dtype=np.float32)),
            ("bn.running_mean", np.array([1.0, 3.0], dtype=np.float32)),
            ("fc.bias", np.array([0.25, -0.75], dtype=np.float64)),
            ("bn.num_batches_tracked", np.array(7, dtype=np.int64)),
            ("head.weight", np.array([8.0, -2.0, 0.125], dtype=np.float16)),
        ]
    )


def adopted(arrays: OrderedDict[str, np.ndarray] | None = None, **kwargs) -> GlobalModel:  # noqa: ANN003
    model = GlobalModel(**kwargs)
    model.adopt(model_record(mixed_model() if arrays is None else arrays))
    return model


# ---------------------------------------------------------------------------- adopt
def test_adopt_flattens_the_trainable_arrays_in_record_order_into_one_float32_vector() -> None:
    model = GlobalModel()
    assert model.adopt(model_record(mixed_model())) is True  # this made the layout known
    assert model.params.dtype == np.float32 and model.params.shape == (9,)
    np.testing.assert_array_equal(model.params, [0.5, -1.5, 2.0, 4.0, 0.25, -0.75, 8.0, -2.0, 0.125])


def test_adopt_keeps_the_buffers_apart_with_their_own_dtypes() -> None:
    model = adopted()
    assert model.layout.buffer_keys == ("bn.running_mean", "bn.num_batches_tracked")  # inferred: a suffix, an int
    assert model.layout.dim == 4 + 2 + 3
    assert model.buffers["bn.num_batches_tracked"].dtype == np.int64
    assert int(model.buffers["bn.num_batches_tracked"]) == 7
    np.testing.assert_array_equal(model.buffers["bn.running_mean"], [1.0, 3.0])


def test_explicit_buffer_keys_override_the_inference() -> None:
    model = adopted(buffer_keys=["bn.num_batches_tracked", "fc.bias"])
    assert model.layout.buffer_keys == ("fc.bias", "bn.num_batches_tracked")  # in record order
    assert model.layout.dim == 4 + 2 + 3  # bn.running_mean is trained now, fc.bias is not
    np.testing.assert_array_equal(model.params[4:6], [1.0, 3.0])


def test_a_second_adopt_of_the_same_layout_does_not_make_the_layout_known_again() -> None:
    model = adopted()
    layout = model.layout
    changed = mixed_model()
    changed["fc.weight"] = changed["fc.weight"] * 2
    assert model.adopt(model_record(changed)) is False
    assert model.layout is layout
    np.testing.assert_array_equal(model.params[:4], [1.0, -3.0, 4.0, 8.0])


# ---------------------------------------------------------------------------- to_record
def test_to_record_gives_back_the_record_with_its_key_order_and_dtypes() -> None:
    back = named_arrays(adopted().to_record())
    original = mixed_model()
    assert list(back) == list(original)
    for name, array in original.items():
        assert back[name].dtype == array.dtype, name
        assert back[name].shape == array.shape, name
        np.testing.assert_array_equal(back[name], array)


def test_to_record_writes_the_current_params_back_into_their_tensors() -> None:
    model = adopted()
    model.params[:] = np.arange(9, dtype=np.float32)
    back = named_arrays(model.to_record())
    np.testing.assert_array_equal(back["fc.weight"], [[0.0, 1.0], [2.0, 3.0]])
    np.testing.assert_array_equal(back["fc.bias"], [4.0, 5.0])
    np.testing.assert_array_equal(back["head.weight"], np.array([6.0, 7.0, 8.0], dtype=np.float16))
    np.testing.assert_array_equal(back["bn.running_mean"], [1.0, 3.0])  # buffers are not params


def test_record_of_orders_any_whole_model_by_the_model_key_order() -> None:
    model = adopted()
    shuffled = dict(reversed(list(mixed_model().items())))
    assert list(named_arrays(model.record_of(shuffled))) == list(mixed_model())


# ---------------------------------------------------------------------------- returned
def test_the_record_it_returned_is_adopted_again_without_decoding() -> None:
    model = adopted()
    record = model.returned(model.to_record())
    assert model.last_returned is record
    model.params[0] = 42.0  # what the strategy holds now; the record still says 0.5
    assert model.adopt(record) is False
    assert model.params[0] == 42.0  # not decoded from the record again
    model.adopt(model_record(mixed_model()))  # any other record is decoded
    assert model.params[0] == 0.5


def test_before_anything_is_returned_last_returned_is_none() -> None:
    assert adopted().last_returned is None


# ---------------------------------------------------------------------------- refusals
def test_a_record_with_a_wrong_shape_is_refused_and_the_model_is_unchanged() -> None:
    model = adopted()
    params, buffers = model.params.copy(), {k: v.copy() for k, v in model.buffers.items()}
    bad = mixed_model()
    bad["fc.bias"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"array 'fc.bias' has shape \(3,\), the model has \(2,\)"):
        model.adopt(model_record(bad))
    np.testing.assert_array_equal(model.params, params)
    assert all(np.array_equal(model.buffers[k], v) for k, v in buffers.items())
    assert list(named_arrays(model.to_record())) == list(mixed_model())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("extra", r"array names do not match the model \(missing \[\], unexpected \['extra'\]\)"),
        ("missing", r"array names do not match the model \(missing \['fc.bias'\], unexpected \[\]\)"),
    ],
)
def test_a_record_with_other_array_names_is_refused_with_the_names(change: str, message: str) -> None:
    bad = mixed_model()
    if change == "extra":
        bad["extra"] = np.zeros(2, dtype=np.float32)
    else:
        del bad["fc.bias"]
    with pytest.raises(ValueError, match=message):
        adopted().adopt(model_record(bad))


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_a_refused_record_with_other_names_leaves_the_model_unchanged(change: str) -> None:
    model = adopted()
    bad = mixed_model()
    if change == "extra":
        bad["extra"] = np.zeros(2, dtype=np.float32)
    else:
        del bad["fc.bias"]
    with pytest.raises(ValueError, match="array names do not match the model"):
        model.adopt(model_record(bad))
    assert model.key_order == tuple(mixed_model())
    assert list(named_arrays(model.to_record())) == list(mixed_model())


# ---------------------------------------------------------------------------- average_buffers
def test_average_buffers_is_the_weighted_mean_rounded_for_integers() -> None:
    model = adopted()
    clients = [
        {"bn.running_mean": np.array([1.0, 2.0], np.float32), "bn.num_batches_tracked": np.array(1)},
        {"bn.running_mean": np.array([5.0, -2.0], np.float32), "bn.num_batches_tracked": np.array(4)},
    ]
    model.average_buffers(clients, [0.25, 0.75])
    np.testing.assert_array_equal(model.buffers["bn.running_mean"], [4.0, -1.0])
    assert model.buffers["bn.running_mean"].dtype == np.float32
    assert model.buffers["bn.num_batches_tracked"].dtype == np.int64
    assert int(model.buffers["bn.num_batches_tracked"]) == 3  # 0.25 + 3.0 = 3.25, rounded
    np.testing.assert_array_equal(model.params[:4], [0.5, -1.5, 2.0, 4.0])  # params are not buffers


def test_average_buffers_of_no_clients_changes_nothing() -> None:
    model = adopted()
    model.average_buffers([], [])
    np.testing.assert_array_equal(model.buffers["bn.running_mean"], [1.0, 3.0])
    assert int(model.buffers["bn.num_batches_tracked"]) == 7


# ---------------------------------------------------------------------------- state
def test_state_dict_is_empty_before_the_model_is_known() -> None:
    assert GlobalModel().state_dict() == {}


def test_state_round_trip_restores_params_buffers_key_order_and_dtypes() -> None:
    model = adopted()
    model.params[:] = np.arange(9, dtype=np.float32) / 4
    model.returned(model.to_record())
    state = model.state_dict()
    model.params[0] = 99.0  # the saved state is a copy
    again = GlobalModel()
    again.load_state_dict(state)
    assert again.key_order == tuple(mixed_model())
    assert again.layout == model.layout
    np.testing.assert_array_equal(again.params, np.arange(9, dtype=np.float32) / 4)
    back = named_arrays(again.to_record())
    assert {k: v.dtype for k, v in back.items()} == {k: v.dtype for k, v in mixed_model().items()}
    assert int(back["bn.num_batches_tracked"]) == 7
    assert again.last_returned is None  # a loaded model decodes the next record it is given


def good_state() -> dict:
    return adopted().state_dict()


@pytest.mark.parametrize(
    ("edit", "field", "expected"),
    [
        (lambda s: s.update(params=s["params"][:-1]), "model/params", r"has shape \(8,\); expected \(9,\)"),
        (lambda s: s["params"].__setitem__(2, np.nan), "model/params", "expected finite values"),
        (lambda s: s["dtypes"].update({"fc.bias": "<i8"}), "model/dtypes/fc.bias", "expected a floating dtype"),
        (lambda s: s["dtypes"].update({"fc.bias": "float32"}), "model/dtypes/fc.bias", "expected a numeric dtype"),
        (lambda s: s.update(buffer_keys=["nope"]), "model/buffer_keys", "outside 'key_order'"),
        (lambda s: s["key_order"].append("fc.bias"), "model/key_order", "names one array twice"),
        (
            lambda s: s["buffers"].update({"bn.running_mean": np.zeros(5, np.float32)}),
            "model/buffers/bn.running_mean",
            r"has shape \(5,\); expected \(2,\)",
        ),
        (lambda s: s.pop("shapes"), "model/shapes", "is missing"),
    ],
    ids=[
        "short-params",
        "nan-param",
        "int-trainable",
        "bad-dtype",
        "stray-buffer",
        "twice",
        "buffer-shape",
        "no-shapes",
    ],
)
def test_a_bad_saved_state_is_refused_naming_the_field_and_the_model_is_unchanged(edit, field, expected) -> None:  # noqa: ANN001
    model = adopted()
    model.params[:] = 3.0
    record = model.returned(model.to_record())
    state = good_state()
    edit(state)
    with pytest.raises(StateError, match=expected) as refused:
        model.load_state_dict(state, "model")
    assert refused.value.field == field and field in str(refused.value)
    np.testing.assert_array_equal(model.params, np.full(9, 3.0, np.float32))
    assert model.last_returned is record
    assert list(named_arrays(model.to_record())) == list(mixed_model())
