"""Client-side differential privacy through Flower's glue (issue 39; privacy spec §4, §6): ``compress_update`` and
``compression_mod`` read the train config's DP entries, keep what is sent within the clip for every codec with error
feedback, noise local uploads, and hold every train message to the node's own floor.

The Flower-free mechanisms (clipping, noise, ``compress_with_feedback``'s privatize step) are tested in
``tests/unit/test_privacy_client.py``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from pollen.clientside.compression_mod import (
    RESIDUAL,
    DpRequest,
    compress_update,
    compression_mod,
    dp_request,
    node_dp_floor,
    private_upload,
    upload_noise_generator,
    wants_compression,
)
from pollen.clientside.state import ClientState
from pollen.compression import ErrorFeedback, decode_payload, make_codec
from pollen.privacy.mechanisms import clip_l2, gaussian_noise, l2_norm, privatize
from pollen.testing.fakes import full_model_reply, global_arrays_of, make_context, train_message
from pollen.wire import protocol
from pollen.wire.records import records_to_payload

pytestmark = pytest.mark.flower_compat

CODECS = ("sign", "topk", "fp16", "none")

C = 0.75
BOUND = C * (1 + 1e-6)
PREFIX = protocol.SETUP_ERROR_PREFIX


def dp_config(mode: str | None = "central", codec: str | None = "sign", error_feedback: bool = True, **extra) -> dict:
    config: dict = {protocol.CFG_SERVER_ROUND: 1}
    if codec is not None:
        config.update(
            {
                protocol.CFG_CODEC: codec,
                protocol.CFG_ERROR_FEEDBACK: error_feedback,
                protocol.CFG_TOPK_RATIO: 0.1,
                protocol.CFG_BUFFER_KEYS: "",
            }
        )
    if mode is not None:
        config.update({protocol.CFG_DP_MODE: mode, protocol.CFG_DP_CLIP: C})
        if mode == "local":
            config[protocol.CFG_DP_NOISE] = 1.0
    config.update(extra)
    return config


def decoded(records: dict, dim: int) -> np.ndarray:
    payload = records_to_payload(records[protocol.UPDATE_RECORD], records[protocol.UPDATE_META_RECORD])
    return decode_payload(payload, dim)


def upload_round(context, config: dict, delta: np.ndarray, server_round: int) -> tuple[np.ndarray, np.ndarray | None]:  # noqa: ANN001
    """One upload through compress_update (what pollen's ClientApp and the mod call); (decoded, e before)."""
    config = ConfigRecord({**config, protocol.CFG_SERVER_ROUND: server_round})
    state = ClientState(context, server_round=server_round)
    before = state.get(RESIDUAL)
    records = compress_update(delta, config, state)
    state.commit()
    return decoded(records, delta.size), before


def deltas(rounds: int, dim: int, seed: int) -> list[np.ndarray]:
    """Updates far above C, near it and far below it, so that some rounds are clipped and some carry a residual."""
    rng = np.random.default_rng(seed)
    scales = [3.0, 0.02, 1.0, 0.001, 10.0, 0.05][:rounds]
    return [(rng.standard_normal(dim) * s / np.sqrt(dim) * 4).astype(np.float32) for s in scales]


# ------------------------------------------------------------------------------------ central DP: what is sent
@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("error_feedback", [True, False])
def test_central_dp_decoded_upload_norm_is_at_most_the_clip_over_rounds_with_a_residual(codec_name, error_feedback):
    """The issue's requirement: the clipped norm holds for what is sent, compressed or not, with error feedback."""
    context = make_context(3)
    config = dp_config("central", codec_name, error_feedback)
    norms = []
    for t, delta in enumerate(deltas(6, 997, seed=2), start=1):
        sent, before = upload_round(context, config, delta, t)
        norms.append(l2_norm(sent))
        assert norms[-1] <= BOUND, (t, norms[-1])
        if not error_feedback:
            continue
        # e <- privatize(p) - decode(msg), with p = delta + e: clipped-away mass is dropped, not carried
        p = delta if before is None else np.add(delta, before, dtype=np.float32)
        clip = C * (1 - 2**-10) if codec_name == "fp16" else C
        after = ClientState(context, server_round=t + 1).get(RESIDUAL)
        np.testing.assert_array_equal(after, privatize(p, "central", clip) - sent)
    assert max(norms) > 0.5 * C  # the large rounds were clipped to about C, not to nothing


@pytest.mark.parametrize("granularity", ["tensor"])
@pytest.mark.parametrize("codec_name", ["sign", "topk"])
def test_central_dp_holds_per_tensor_too(codec_name, granularity):
    context = make_context(4)
    segments = [(0, 300), (300, 310), (310, 997)]
    config = ConfigRecord({**dp_config("central", codec_name), protocol.CFG_GRANULARITY: granularity})
    for t, delta in enumerate(deltas(4, 997, seed=5), start=1):
        state = ClientState(context, server_round=t)
        records = compress_update(
            delta, ConfigRecord({**config, protocol.CFG_SERVER_ROUND: t}), state, segments=segments
        )
        state.commit()
        payload = records_to_payload(records[protocol.UPDATE_RECORD], records[protocol.UPDATE_META_RECORD])
        assert l2_norm(decode_payload(payload, 997, segments=segments)) <= BOUND


def test_fp16_rounding_is_kept_under_the_clip_even_in_the_subnormal_range():
    """float16 rounds to nearest: clipped to exactly C, all entries may round up and the sent norm exceed C.
    The margin C * (1 - 2**-10) covers the normal range; the subnormal range is clipped again, tighter."""
    codec = make_codec("fp16")
    d = 400
    # normal range: entries that float16 rounds up by almost half a unit
    value = np.float32(1.0 + 2.0**-11 * 1.01)  # just above the midpoint of 1 and 1 + 2**-10: rounds up
    delta = np.full(d, 5 * value, dtype=np.float32)
    c = float(value) * np.sqrt(d)
    naive = codec.decode(codec.encode(privatize(delta, "central", c)), d)
    assert l2_norm(naive) > c * (1 + 1e-6)  # what a plain clip to C would send
    payload, _ = private_upload(codec, delta, ErrorFeedback(), DpRequest("central", c))
    assert l2_norm(codec.decode(payload, d)) <= c
    # subnormal range (float16 spacing 2**-24 there): 1.6 units rounds up to 2, +25 %
    tiny = np.full(d, 1.6 * 2.0**-24, dtype=np.float32)
    c = l2_norm(tiny)
    payload, fb = private_upload(codec, tiny * 3, ErrorFeedback(), DpRequest("central", c))
    sent = codec.decode(payload, d)
    assert 0 < l2_norm(sent) <= c * (1 + 1e-6)
    assert l2_norm(fb.residual + sent) <= c  # e + msg is the privatised vector, clipped again, tighter


# ------------------------------------------------------------------------------------------------- local DP
def test_local_dp_noise_has_std_z_times_c_and_is_added_after_the_clip():
    d, z = 1_000_000, 1.3
    context = make_context(5)
    config = ConfigRecord({**dp_config("local", "none", False), protocol.CFG_DP_NOISE: z, protocol.CFG_DP_SEED: 11})
    delta = (np.random.default_rng(6).standard_normal(d) * 0.01).astype(np.float32)  # norm 10 > C
    sent, _ = upload_round(context, config, delta, 1)
    noise = sent.astype(np.float64) - clip_l2(delta, C)[0]
    assert abs(noise.std() / (z * C) - 1) < 0.005
    assert abs(noise.mean()) < 5 * z * C / np.sqrt(d)


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("error_feedback", [True, False])
def test_local_dp_noise_is_fresh_per_upload_reproducible_with_a_seed_and_unpredictable_without(
    codec_name, error_feedback
):
    delta = deltas(1, 500, seed=7)[0]

    def two_rounds(seed: int | None) -> list[np.ndarray]:
        extra = {} if seed is None else {protocol.CFG_DP_SEED: seed}
        context = make_context(6)
        config = dp_config("local", codec_name, error_feedback, **extra)
        return [upload_round(context, config, delta, t)[0] for t in (1, 2)]

    first, again = two_rounds(3), two_rounds(3)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)  # seeded: the same run gives the same uploads
    assert not np.array_equal(first[0], first[1])  # fresh per upload (same delta both rounds)
    assert not np.array_equal(first[0], two_rounds(4)[0])
    unseeded, unseeded_again = two_rounds(None), two_rounds(None)
    assert not np.array_equal(unseeded[0], unseeded_again[0])  # no seed: unpredictable


def test_local_dp_residual_holds_only_noised_values():
    """With error feedback, e = privatize(p) - decode(msg): built from the noised vector, never from p itself."""
    context = make_context(8)
    config = ConfigRecord(dp_config("local", "sign", True, **{protocol.CFG_DP_SEED: 9}))
    delta = deltas(1, 400, seed=8)[0]
    state = ClientState(context, server_round=1)
    records = compress_update(delta, config, state)
    dp = dp_request(config)
    noised = privatize(delta, "local", C, 1.0, upload_noise_generator(dp, config, "partition-0"))
    np.testing.assert_array_equal(state.get(RESIDUAL), noised - decoded(records, 400))


def test_local_dp_seed_key_depends_on_client_round_and_message():
    dp = DpRequest("local", 1.0, 1.0, seed=5)
    base = {protocol.CFG_SERVER_ROUND: 3}
    draw = lambda config, cid: upload_noise_generator(dp, config, cid).standard_normal(4)  # noqa: E731
    a = draw(base, "partition-1")
    np.testing.assert_array_equal(a, draw(base, "partition-1"))
    assert not np.array_equal(a, draw(base, "partition-2"))
    assert not np.array_equal(a, draw({protocol.CFG_SERVER_ROUND: 4}, "partition-1"))
    assert not np.array_equal(a, draw({**base, protocol.CFG_PHASE_INDEX: 1}, "partition-1"))


# ------------------------------------------------------------------------------------- config and node floor
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({protocol.CFG_DP_MODE: "lcoal", protocol.CFG_DP_CLIP: 1.0}, "'pollen.dp.mode' = 'lcoal'; allowed: one of"),
        ({protocol.CFG_DP_MODE: "central"}, "has no 'pollen.dp.clip'"),
        ({protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: 0.0}, "'pollen.dp.clip' = 0.0; allowed: a finite"),
        ({protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: -1}, "'pollen.dp.clip' = -1; allowed"),
        ({protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: float("nan")}, "'pollen.dp.clip' = nan"),
        ({protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: "1.0"}, "'pollen.dp.clip' = '1.0'"),
        ({protocol.CFG_DP_MODE: "central", protocol.CFG_DP_CLIP: True}, "'pollen.dp.clip' = True"),
        ({protocol.CFG_DP_MODE: "local", protocol.CFG_DP_CLIP: 1.0}, "has no 'pollen.dp.noise-multiplier'"),
        (
            {protocol.CFG_DP_MODE: "local", protocol.CFG_DP_CLIP: 1.0, protocol.CFG_DP_NOISE: 0.0},
            "'pollen.dp.noise-multiplier' = 0.0; allowed: a finite number > 0",
        ),
        (
            {protocol.CFG_DP_MODE: "local", protocol.CFG_DP_CLIP: 1.0, protocol.CFG_DP_NOISE: float("inf")},
            "'pollen.dp.noise-multiplier' = inf",
        ),
        (
            {
                protocol.CFG_DP_MODE: "local",
                protocol.CFG_DP_CLIP: 1.0,
                protocol.CFG_DP_NOISE: 1.0,
                "pollen.dp.seed": -2,
            },
            "'pollen.dp.seed' = -2; allowed: an integer >= 0",
        ),
        ({protocol.CFG_DP_CLIP: 1.0}, "sets \\['pollen.dp.clip'\\] but not 'pollen.dp.mode'"),
    ],
)
def test_bad_dp_config_values_are_refused_with_a_setup_error(config, message):
    with pytest.raises(ValueError, match=message) as err:
        dp_request(ConfigRecord(config))
    assert str(err.value).startswith(PREFIX)


def test_dp_request_reads_good_values():
    assert dp_request(ConfigRecord({})) is None
    assert dp_request(ConfigRecord(dp_config("central"))) == DpRequest("central", C, 0.0, None)
    local = ConfigRecord(dp_config("local", **{protocol.CFG_DP_NOISE: 2, protocol.CFG_DP_SEED: 4}))
    assert dp_request(local) == DpRequest("local", C, 2.0, 4)


def test_wants_compression_for_a_codec_or_local_dp_only():
    assert wants_compression(ConfigRecord(dp_config(None, "sign")))
    assert wants_compression(ConfigRecord(dp_config("local", None)))
    assert not wants_compression(ConfigRecord(dp_config("central", None)))
    assert not wants_compression(ConfigRecord({})) and not wants_compression(None)


MIN_Z = "dp-min-noise-multiplier"
MAX_CLIP = "dp-max-clip"


@pytest.mark.parametrize(
    ("node", "config", "message"),
    [
        (
            {MIN_Z: 1.0},
            {},
            f"its node-config '{MIN_Z}' = 1 requires local DP on every upload, but the server asked for no DP",
        ),
        (
            {MAX_CLIP: 0.5},
            dp_config("central", None),
            f"node-config '{MAX_CLIP}' = 0.5 requires local DP on every upload, but the server asked for central DP",
        ),
        (
            {MIN_Z: "1.5"},
            dp_config("local", None),
            f"node-config '{MIN_Z}' = 1.5, but the server asked for local DP with 'pollen.dp.noise-multiplier' = 1",
        ),
        (
            {MIN_Z: 1.0, MAX_CLIP: 0.5},
            dp_config("local", None),
            f"node-config '{MAX_CLIP}' = 0.5, but the server asked for local DP with 'pollen.dp.clip' = 0.75",
        ),
        ({MIN_Z: "abc"}, dp_config("local", None), f"node-config '{MIN_Z}' = 'abc'; allowed: a finite number > 0"),
        ({MAX_CLIP: -1.0}, dp_config("local", None), f"node-config '{MAX_CLIP}' = -1.0; allowed"),
    ],
)
def test_a_node_floor_refuses_weaker_dp_than_it_demands_before_training(node, config, message):
    context = make_context(9)
    context.node_config.update(node)
    calls = []
    msg = train_message(OrderedDict(w=np.zeros(3, dtype=np.float32)), config, node_id=9)
    with pytest.raises(ValueError, match=message) as err:
        compression_mod(msg, context, lambda m, c: calls.append(m))
    assert str(err.value).startswith(PREFIX) and not calls  # refused before the ClientApp trained
    # compress_update (pollen's own ClientApp) refuses alike
    with pytest.raises(ValueError, match=message):
        compress_update(np.ones(3, dtype=np.float32), ConfigRecord(config), ClientState(context, server_round=1))


def test_a_node_floor_lets_strong_enough_local_dp_through():
    assert node_dp_floor({}) == (None, None) and node_dp_floor({MIN_Z: "", MAX_CLIP: None}) == (None, None)
    assert node_dp_floor({MIN_Z: 2, MAX_CLIP: "0.5"}) == (2.0, 0.5)
    config = ConfigRecord(dp_config("local", None, **{protocol.CFG_DP_NOISE: 1.0}))
    assert dp_request(config, {MIN_Z: 1.0, MAX_CLIP: C}) == DpRequest("local", C, 1.0, None)


def test_local_dp_refuses_data_dependent_buffers_and_the_lazy_uplink():
    context = make_context(10)
    with pytest.raises(ValueError, match="local DP cannot privatise the model's non-trainable buffers"):
        compress_update(
            np.ones(3, dtype=np.float32),
            ConfigRecord(dp_config("local", "sign")),
            ClientState(context, server_round=1),
            buffers={"bn.running_mean": np.zeros(2, dtype=np.float32)},
        )
    lazy = dp_config("local", None, **{protocol.CFG_LAZY_UP_RULE: "nla"})
    msg = train_message(OrderedDict(w=np.zeros(3, dtype=np.float32)), lazy, node_id=10)
    with pytest.raises(ValueError, match="lazy family's uplink .* does not take client-side local DP"):
        compression_mod(msg, context, lambda m, c: None)


# ------------------------------------------------------------------------------- end to end: a foreign ClientApp
def foreign_model(seed: int) -> OrderedDict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return OrderedDict(
        [("w", rng.standard_normal((6, 5)).astype(np.float32)), ("b", rng.standard_normal(6).astype(np.float32))]
    )


class ForeignTrain:
    """A ClientApp's train function that knows nothing of pollen: x_local = x_global + a step (norm ~ 3)."""

    def __init__(self) -> None:
        self.deltas: list[np.ndarray] = []
        self.rng = np.random.default_rng(12)

    def __call__(self, msg: Message, context) -> Message:  # noqa: ANN001
        g = global_arrays_of(msg)
        local = OrderedDict((k, (v + 0.5 * self.rng.standard_normal(v.shape)).astype(np.float32)) for k, v in g.items())
        self.deltas.append(np.concatenate([(local[k] - g[k]).ravel() for k in g]))
        return full_model_reply(msg, local, num_examples=7, loss=0.5)


def test_compression_mod_on_a_foreign_clientapp_sends_local_dp_without_a_codec():
    context, train = make_context(2), ForeignTrain()
    config = dp_config("local", None, **{protocol.CFG_DP_NOISE: 0.8, protocol.CFG_DP_SEED: 21})
    msg = train_message(foreign_model(1), config, node_id=2)
    reply = compression_mod(msg, context, train)
    assert not reply.has_error()
    assert protocol.ARRAYS_RECORD not in reply.content.array_records  # the full model never leaves the node
    assert reply.content.metric_records[protocol.METRICS_RECORD]["num-examples"] == 7  # the rest passes through
    meta = reply.content.config_records[protocol.UPDATE_META_RECORD]
    sent = decoded(reply.content, 36)
    payload = records_to_payload(reply.content.array_records[protocol.UPDATE_RECORD], meta)
    assert payload.codec == "none"  # dense
    delta = train.deltas[0]
    assert l2_norm(delta) > C  # so the clip did something
    dp = dp_request(ConfigRecord(config))
    noise = gaussian_noise(36, 0.8 * C, upload_noise_generator(dp, config, "partition-0"))
    clean = clip_l2(delta, C)[0]
    np.testing.assert_array_equal(sent, clean + noise)  # exactly: clip(delta) + N(0, (zC)^2), nothing else
    assert l2_norm(clean) <= C and l2_norm(sent - clean) > C  # its clean part is clipped; the noise dominates
    assert len(context.state.array_records) == 0  # no error feedback without a codec: nothing kept


def test_compression_mod_central_dp_without_a_codec_leaves_the_reply_alone_and_with_one_clips():
    context, train = make_context(3), ForeignTrain()
    msg = train_message(foreign_model(2), dp_config("central", None), node_id=3)
    reply = compression_mod(msg, context, train)
    assert reply is not None and protocol.ARRAYS_RECORD in reply.content.array_records  # the server clips
    for t in (1, 2, 3):
        config = dp_config("central", "sign", **{protocol.CFG_SERVER_ROUND: t})
        reply = compression_mod(train_message(foreign_model(2), config, node_id=3), context, train)
        assert l2_norm(decoded(reply.content, 36)) <= BOUND


def test_compression_mod_refuses_to_send_an_unnoised_model_under_local_dp():
    """A message without a global model cannot be measured from: the ClientApp's full model must not leave."""
    context = make_context(4)
    msg = train_message(foreign_model(3), dp_config("local", None), node_id=4)
    msg = Message(
        RecordDict({protocol.CONFIG_RECORD: msg.content.config_records[protocol.CONFIG_RECORD]}),
        dst_node_id=4,
        message_type=MessageType.TRAIN,
    )
    model = foreign_model(3)
    with pytest.raises(ValueError, match="would leave the node un-noised"):
        compression_mod(msg, context, lambda m, c: full_model_reply(m, model, num_examples=1, loss=0.0))
