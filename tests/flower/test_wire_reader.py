"""The fast array reader agrees with Flower's ``Array.numpy()`` and refuses what it must not trust.

No torch: these run against the newest Flower too.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from pollen.clientside import compression_mod
from pollen.testing.fakes import full_model_reply, tiny_model, train_message
from pollen.wire import protocol
from pollen.wire.records import array_to_numpy, record_to_arrays

pytestmark = pytest.mark.flower_compat


def npy_array(header_shape, dtype: str, payload: bytes) -> Array:
    """An Array whose .npy header declares ``header_shape`` of ``dtype`` but carries ``payload``."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": dtype, "fortran_order": False, "shape": header_shape})
    data = stream.getvalue()
    data = b"\x93NUMPY\x01\x00" + data[8:] if not data.startswith(b"\x93NUMPY") else data
    return Array(dtype=dtype, shape=tuple(header_shape), stype="numpy.ndarray", data=data + payload)


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(2.5, dtype=np.float32),
        np.array(7, dtype=np.int64),
        np.zeros((0,), np.float64),
        np.zeros((3, 0), np.float16),
        np.array([True, False]),
        np.arange(6, dtype=np.uint8),
        np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        np.arange(10, dtype=np.float32)[::3],
        np.array([1e300, -1e-300]),
    ],
)
def test_reader_agrees_with_flower(value):
    array = Array(value)
    want = array.numpy()
    got = array_to_numpy(array)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert not got.flags.writeable  # a view of the message bytes, not a copy


@pytest.mark.parametrize(
    ("array", "reason"),
    [
        (npy_array((2**31,), "<f4", b""), "declares shape"),  # 8 GB declared, nothing sent: refused, not allocated
        (npy_array((4,), "<f4", b"\x00" * 12), "declares shape"),
        (npy_array((4,), "<f4", b"\x00" * 20), "declares shape"),
        (npy_array((2,), "<c8", b"\x00" * 16), "not allowed"),
        (npy_array((2,), "<m8[s]", b"\x00" * 16), "not allowed"),
        (npy_array((2,), "|O", b"\x00" * 16), "not allowed"),
        (npy_array((2,), "<U3", b"\x00" * 24), "not allowed"),
        (Array(dtype="<f4", shape=(1,), stype="numpy.ndarray", data=b"not npy at all"), "not .npy"),
        (Array(dtype="<f4", shape=(1,), stype="torch.Tensor", data=b"\x93NUMPY"), "serialisation type"),
    ],
)
def test_reader_refuses_untrustworthy_arrays(array, reason):
    with pytest.raises(ValueError, match=reason):
        array_to_numpy(array)
    with pytest.raises(ValueError, match="cannot be decoded"):
        record_to_arrays(ArrayRecord({"x": array}))


def test_compression_mod_keeps_records_it_does_not_own():
    """The mod replaces only the full model; extras, flags and a user's own records pass through intact."""
    msg = train_message(
        tiny_model(),
        {
            protocol.CFG_CODEC: "sign",
            protocol.CFG_SERVER_ROUND: 1,
            protocol.CFG_BUFFER_KEYS: "bn.running_mean\nbn.num_batches_tracked",
        },
    )
    own = ArrayRecord({"sketch": Array(np.arange(5, dtype=np.float32))})
    extra = ArrayRecord({protocol.EXTRA_ARRAY: Array(np.ones(3, dtype=np.float32))})
    flags = ConfigRecord({"skip": False})

    def client_app(message, context):  # noqa: ANN001, ANN202
        local = {k: (v + 0.5).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in tiny_model().items()}
        out = full_model_reply(message, local)
        out.content["user.sketch"] = own
        out.content[protocol.extra_record("v")] = extra
        out.content[protocol.FLAGS_RECORD] = flags
        out.content["user.metrics"] = MetricRecord({"a": 1.0})
        return out

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    out = compression_mod(msg, context, client_app)
    assert protocol.ARRAYS_RECORD not in out.content and protocol.UPDATE_RECORD in out.content
    assert out.content["user.sketch"] is own and out.content[protocol.extra_record("v")] is extra
    assert out.content[protocol.FLAGS_RECORD] is flags and out.content["user.metrics"]["a"] == 1.0
