"""The field checks of saved states: one line naming the field and what was expected, no allocation."""

from __future__ import annotations

import numpy as np
import pytest

from pollen.core import state_fields as fields
from pollen.core.checkpoint import CheckpointError


def test_a_refusal_is_one_line_naming_the_field_and_a_checkpoint_error() -> None:
    with pytest.raises(fields.StateError) as caught:
        fields.whole(-1, "strategy/v_hat_version")
    err = caught.value
    assert isinstance(err, CheckpointError) and isinstance(err, ValueError)
    assert str(err) == "state field 'strategy/v_hat_version' is -1; expected an integer in [0, 9223372036854775807]"
    assert str(err.in_file("run/checkpoint.npz")).startswith("run/checkpoint.npz: state field 'strategy/")


@pytest.mark.parametrize("value", [True, 1.0, "1", None, np.float32(1), [1]])
def test_a_whole_number_is_an_integer_and_nothing_else(value) -> None:  # noqa: ANN001
    with pytest.raises(fields.StateError, match="'round' is .*expected an integer"):
        fields.whole(value, "round")
    assert fields.whole(np.int64(3), "round") == 3 and fields.whole(np.array(3), "round") == 3


def test_arrays_are_checked_for_dtype_shape_finiteness_and_range() -> None:
    v = np.ones(5, np.float32)
    assert fields.float_vector(v, "v", 5) is v
    with pytest.raises(fields.StateError, match="'v' has dtype float64; expected float32"):
        fields.float_vector(v.astype(np.float64), "v", 5)
    with pytest.raises(fields.StateError, match=r"'v' has shape \(5,\); expected \(6,\)"):
        fields.float_vector(v, "v", 6)
    bad = v.copy()
    bad[3] = np.nan
    with pytest.raises(fields.StateError, match="'v' holds .*nan.* at index 3; expected finite values"):
        fields.float_vector(bad, "v", 5)
    bad[3] = -2
    with pytest.raises(fields.StateError, match="at index 3; expected values >= 0 \\(a second moment\\)"):
        fields.float_vector(bad, "v", 5, low=0.0, what="(a second moment)")
    bad[3] = 1e30
    with pytest.raises(fields.StateError, match="expected values <= 1e\\+15"):
        fields.float_vector(bad, "v", 5, high=1e15)


def test_mappings_name_the_missing_or_unknown_field() -> None:
    with pytest.raises(fields.StateError, match="'sampler/rng' is missing"):
        fields.mapping({"seed": 1}, "sampler", keys=("seed", "rng"))
    with pytest.raises(fields.StateError, match="'sampler/extra' is not a field of sampler"):
        fields.mapping({"seed": 1, "extra": 2}, "sampler", keys=("seed",))
    with pytest.raises(fields.StateError, match="'x' is .*expected a mapping"):
        fields.mapping([1], "x")


def test_a_client_id_map_is_one_to_one() -> None:
    assert fields.one_to_one({"3": "a", "4": "b"}, "node_keys") == {3: "a", 4: "b"}
    with pytest.raises(fields.StateError, match="'node_keys/4' maps node 4 to client id 'a', held by node 3 too"):
        fields.one_to_one({"3": "a", "4": "a"}, "node_keys")
    with pytest.raises(fields.StateError, match="not an integer"):
        fields.one_to_one({"x": "a"}, "node_keys")


def test_a_generator_state_is_well_formed() -> None:
    good = np.random.default_rng(5).bit_generator.state
    assert fields.bit_generator_state(good, "rng") == good
    for change, words in (
        ({"bit_generator": "MT19937"}, "'rng/bit_generator' is 'MT19937'"),
        ({"has_uint32": 2}, "'rng/has_uint32' is 2"),
        ({"state": {"state": 1, "inc": 2}}, "'rng/state/inc' is even"),
        ({"state": {"state": 2**200, "inc": 3}}, "'rng/state/state' is"),
    ):
        with pytest.raises(fields.StateError, match=words):
            fields.bit_generator_state({**good, **change}, "rng")
