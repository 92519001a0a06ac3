"""pollen's ``compression_mod`` called directly, as Flower calls a mod (fedcams §3.6, §7.1.3).

``compression_mod(msg, context, call_next)``: ``call_next`` is the ClientApp's train
function; ``context.state`` keeps the error-feedback residual per node across rounds.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MessageType

from pollen.clientside import compression_mod
from pollen.clientside.compression_mod import RESIDUAL
from pollen.clientside.state import STATE_KEY
from pollen.compression import SignCodec, decode_payload
from pollen.testing.fakes import (
    BUFFERS,
    TRAINABLE,
    error_reply,
    flat_trainable,
    full_model_reply,
    global_arrays_of,
    make_context,
    named_arrays,
    split_trainable,
    tiny_model,
    train_message,
)
from pollen.wire import protocol
from pollen.wire.records import records_to_payload

pytestmark = pytest.mark.flower_compat

D = 19


def sign_config(error_feedback: bool = True, codec: str = "sign", **extra: object) -> dict:
    return {
        protocol.CFG_SERVER_ROUND: 1,
        protocol.CFG_CODEC: codec,
        protocol.CFG_ERROR_FEEDBACK: error_feedback,
        protocol.CFG_GRANULARITY: "model",
        protocol.CFG_TOPK_RATIO: 0.25,
        protocol.CFG_BUFFER_KEYS: protocol.join_keys(BUFFERS),
        **extra,
    }


class Trainer:
    """A ClientApp train function that adds a known delta and records what it did."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        self.true_deltas: list[np.ndarray] = []
        self.replies: list[Message] = []

    def __call__(self, msg: Message, context) -> Message:  # noqa: ANN001
        self.calls += 1
        g = global_arrays_of(msg)
        delta = (self.rng.standard_normal(D) * self.rng.uniform(0.01, 1.0)).astype(np.float32)
        local = dict(g)
        for name, part in split_trainable(delta, g).items():
            local[name] = (g[name] + part).astype(np.float32)
        local["bn.running_mean"] = self.rng.standard_normal(4).astype(np.float32)
        local["bn.num_batches_tracked"] = np.array(self.calls * 7, dtype=np.int64)
        # The delta as the mod sees it: float32(x_local) - float32(x_global).
        self.true_deltas.append(flat_trainable(local) - flat_trainable(g))
        out = full_model_reply(msg, local, num_examples=32, loss=0.25)
        self.replies.append(out)
        return out


def residual(context) -> np.ndarray:  # noqa: ANN001
    return context.state.array_records[STATE_KEY][RESIDUAL].numpy()


def decoded(reply: Message) -> np.ndarray:
    payload = records_to_payload(
        reply.content.array_records[protocol.UPDATE_RECORD], reply.content.config_records[protocol.UPDATE_META_RECORD]
    )
    return decode_payload(payload, D).astype(np.float64)


def global_model(round_: int) -> dict[str, np.ndarray]:
    return tiny_model(100 + round_)  # the server's model moves between rounds


def test_residual_persists_and_telescopes():
    """e_{t+1} = Delta_t + e_t - C(Delta_t + e_t), kept in context.state; and
    sum_t C(.) + e_{T+1} == sum_t Delta_t (fedcams §3.6, per client)."""
    context = make_context(7)
    trainer = Trainer(1)
    previous = np.zeros(D)
    sent_sum = np.zeros(D)
    rounds = 6
    for t in range(1, rounds + 1):
        msg = train_message(global_model(t), sign_config(), node_id=7)
        out = compression_mod(msg, context, trainer)
        c = decoded(out)
        e = residual(context)
        assert e.dtype == np.float32 and e.shape == (D,)
        np.testing.assert_allclose(e, trainer.true_deltas[-1] + previous - c, rtol=1e-5, atol=1e-6)
        # The upload is C(Delta + e_prev), not C(Delta): one scale ||p||_1/d, signs of p.
        p = trainer.true_deltas[-1] + previous
        np.testing.assert_allclose(c, np.where(p >= 0, 1.0, -1.0) * np.abs(p).mean(), rtol=1e-5)
        previous = e.astype(np.float64)
        sent_sum += c
    true_sum = np.sum(trainer.true_deltas, axis=0)
    assert np.linalg.norm(sent_sum + previous - true_sum) <= 1e-5 * np.linalg.norm(true_sum)
    assert np.linalg.norm(previous) > 0  # sign compression does leave a residual


def test_unsampled_node_keeps_its_residual_bit_identical():
    a, b = make_context(1), make_context(2)
    trainer_a, trainer_b = Trainer(2), Trainer(3)
    compression_mod(train_message(global_model(1), sign_config(), node_id=1), a, trainer_a)
    compression_mod(train_message(global_model(1), sign_config(), node_id=2), b, trainer_b)
    snapshot_b = residual(b).copy()
    snapshot_a = residual(a).copy()
    for t in (2, 3, 4):  # only node 1 is sampled
        compression_mod(train_message(global_model(t), sign_config(), node_id=1), a, trainer_a)
    assert residual(b).tobytes() == snapshot_b.tobytes()
    assert residual(b).dtype == snapshot_b.dtype
    assert not np.array_equal(residual(a), snapshot_a)
    assert trainer_b.calls == 1 and trainer_a.calls == 4


def test_without_error_feedback_no_residual_is_stored():
    context = make_context(3)
    trainer = Trainer(4)
    for t in (1, 2, 3):
        out = compression_mod(
            train_message(global_model(t), sign_config(error_feedback=False), node_id=3), context, trainer
        )
        assert STATE_KEY not in context.state.array_records
        # Plain C(Delta): nothing carried over from earlier rounds.
        want = SignCodec().decode(SignCodec().encode(trainer.true_deltas[-1].astype(np.float32)), D)
        np.testing.assert_array_equal(decoded(out), want.astype(np.float64))
    assert len(context.state) == 0


def test_train_message_without_codec_passes_through_untouched():
    context = make_context(4)
    trainer = Trainer(5)
    config = sign_config()
    del config[protocol.CFG_CODEC]
    msg = train_message(global_model(1), config, node_id=4)
    out = compression_mod(msg, context, trainer)
    assert out is trainer.replies[-1]
    assert set(out.content.array_records) == {protocol.ARRAYS_RECORD}
    assert len(context.state) == 0


@pytest.mark.parametrize("message_type", [MessageType.EVALUATE, MessageType.QUERY, "query.pollen_identify"])
def test_non_train_messages_pass_through_untouched(message_type):
    context = make_context(5)
    trainer = Trainer(6)
    msg = train_message(global_model(1), sign_config(), node_id=5, message_type=message_type)
    out = compression_mod(msg, context, trainer)
    assert out is trainer.replies[-1] and trainer.calls == 1
    assert len(context.state) == 0


def test_error_reply_passes_through():
    context = make_context(6)
    msg = train_message(global_model(1), sign_config(), node_id=6)
    failing = error_reply(msg, "out of memory")
    out = compression_mod(msg, context, lambda m, c: failing)
    assert out is failing and out.has_error()
    assert len(context.state) == 0


def test_reply_layout_buffers_travel_uncompressed():
    context = make_context(8)
    trainer = Trainer(7)
    msg = train_message(global_model(1), sign_config(), node_id=8)
    out = compression_mod(msg, context, trainer)
    local = named_arrays(trainer.replies[-1].content[protocol.ARRAYS_RECORD])

    content = out.content
    assert set(content.array_records) == {protocol.UPDATE_RECORD, protocol.BUFFERS_RECORD}
    assert protocol.ARRAYS_RECORD not in content
    assert set(content[protocol.UPDATE_RECORD].keys()) == {"bits", "scale"}
    update = named_arrays(content[protocol.UPDATE_RECORD])
    assert update["bits"].dtype == np.uint8 and update["bits"].size == -(-D // 8)
    meta = content.config_records[protocol.UPDATE_META_RECORD]
    assert meta[protocol.META_CODEC] == "sign" and meta[protocol.META_DIM] == D

    buffers = named_arrays(content[protocol.BUFFERS_RECORD])
    assert list(buffers) == list(BUFFERS)
    for name in BUFFERS:
        assert buffers[name].dtype == local[name].dtype
        np.testing.assert_array_equal(buffers[name].reshape(local[name].shape), local[name])
    assert buffers["bn.num_batches_tracked"].dtype == np.int64
    # The trainable part went through the codec; the metrics came along unchanged.
    assert dict(content.metric_records[protocol.METRICS_RECORD]) == {"num-examples": 32, "loss": 0.25}
    assert out.metadata.reply_to_message_id == msg.metadata.message_id
    assert out.metadata.src_node_id == 8
    assert set(TRAINABLE).isdisjoint(update)


def test_topk_through_the_mod_keeps_k_entries():
    context = make_context(9)
    trainer = Trainer(8)
    msg = train_message(global_model(1), sign_config(codec="topk"), node_id=9)
    out = compression_mod(msg, context, trainer)
    c = decoded(out)
    k = int(np.floor(0.25 * D))
    assert np.count_nonzero(c) == k
    true = trainer.true_deltas[-1]
    kept = np.argsort(-np.abs(true), kind="stable")[:k]
    np.testing.assert_allclose(c[kept], true[kept], rtol=1e-6)
    np.testing.assert_allclose(residual(context), true - c, rtol=1e-6, atol=1e-7)
