"""Secure aggregation's parts: the summable codec, the cryptography, SecAgg+'s graph and the four-stage protocol.

The protocol runs in process (:func:`run_round`): the server's result must be the exact integer sum of the
survivors' encoded updates (``array_equal``), with drop-outs after each stage, wrong shares, malformed
messages, and too few survivors (an abort, nothing released). Spec: ``papers/privacy.md`` §8, §10.1, §12.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pollen.secagg import SecAggAbort, SecAggClient, SecAggError, SecAggServer, SummableCodec, crypto
from pollen.secagg.graph import default_degree, default_threshold, neighbourhoods

#: Pure arithmetic and cryptography, but of the messages Flower carries: CI runs it on the newest Flower too.
pytestmark = pytest.mark.flower_compat

DIM = 64

# --------------------------------------------------------------------------- the codec


def test_widths_leave_headroom_for_the_sum_of_max_clients() -> None:
    codec = SummableCodec(clip=1.0, bits=8, max_clients=8)
    assert codec.levels == 127 and codec.sum_bits == 11 and codec.wire_bits == 16  # 2*8*127+1 = 2033 values
    assert codec.dtype == np.dtype("<u2") and codec.wire_bytes(1000) == 2000
    wide = SummableCodec(clip=1.0, bits=16, max_clients=1024)
    assert wide.sum_bits == 26 and wide.wire_bits == 32  # 2*1024*32767+1 = 67,106,817 < 2**26 values
    widest = SummableCodec(clip=1.0, bits=24, max_clients=1024)
    assert widest.sum_bits == 34 and widest.wire_bits == 64
    integers = np.array([-1, 5, -(2**23 - 1), 2**23 - 1])
    total = widest.to_wire(integers) + widest.to_wire(integers)  # 64-bit lanes wrap as the narrower ones
    assert np.array_equal(widest.signed_sum(total, 2), 2 * integers)


def test_the_sum_of_max_clients_extremes_decodes_exactly_without_wrapping() -> None:
    codec = SummableCodec(clip=0.5, bits=8, max_clients=8)
    rng = np.random.default_rng(0)
    for value in (0.5, -0.5):  # every client at the range's edge: the sum is +-n*L
        wires = [codec.to_wire(codec.quantize(np.full(DIM, value), rng)) for _ in range(8)]
        total = sum(wires[1:], wires[0].copy())
        assert np.array_equal(codec.signed_sum(total, 8), np.full(DIM, 8 * 127 * np.sign(value), dtype=np.int64))
        np.testing.assert_allclose(codec.decode_mean(total, 8), value, rtol=1e-6)


def test_the_wire_sum_equals_the_integer_sum_and_decodes_to_the_mean() -> None:
    codec = SummableCodec(clip=1.0, bits=12, max_clients=16)
    rng = np.random.default_rng(1)
    integers = [codec.quantize(rng.normal(0, 0.6, DIM), rng) for _ in range(16)]
    total = np.zeros(DIM, codec.dtype)
    for q in integers:
        total = total + codec.to_wire(q)  # the lanes wrap modulo 2**W, as under masks
    assert np.array_equal(codec.signed_sum(total, 16), np.sum(integers, axis=0))
    np.testing.assert_allclose(
        codec.decode_mean(total, 16), np.mean([codec.dequantize(q) for q in integers], axis=0), atol=1e-6
    )


def test_stochastic_rounding_is_unbiased_and_clips_to_the_range() -> None:
    codec = SummableCodec(clip=2.0, bits=4, max_clients=2)  # L = 7: one step is 2/7
    rng = np.random.default_rng(2)
    x = np.array([0.1, -0.3, 1.0, 5.0, -5.0])
    draws = np.stack([codec.quantize(x, rng) for _ in range(20_000)])
    np.testing.assert_allclose(draws.mean(axis=0)[:3], x[:3] * 7 / 2, atol=0.02)
    assert set(np.unique(draws[:, 0])) == {0, 1}  # 0.35 of a step: the two neighbours only
    assert np.all(draws[:, 3] == 7) and np.all(draws[:, 4] == -7)  # beyond the range: its edge


def test_error_feedback_carries_what_the_integers_miss() -> None:
    codec = SummableCodec(clip=0.1, bits=4, max_clients=4)
    rng = np.random.default_rng(3)
    updates = [rng.normal(0, 0.08, DIM).astype(np.float32) for _ in range(30)]
    residual, sent = None, np.zeros(DIM, np.float64)
    for update in updates:
        wire, residual = codec.encode(update, residual, rng)
        sent += codec.dequantize(codec.signed_sum(wire, 1))
    # what was sent over all rounds is what was meant, less the last residual (it telescopes)
    np.testing.assert_allclose(sent + residual, np.sum(updates, axis=0), atol=1e-4)
    assert np.abs(residual).max() < 0.3  # bounded: clipping error is paid back, not accumulated


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": 0.0}, "secagg clip=0.0 is invalid; allowed: a finite number > 0"),
        ({"clip": float("inf")}, "secagg clip=inf is invalid"),
        ({"clip": 1.0, "bits": 1}, "secagg bits=1 is invalid; allowed: an integer from 2 to 24"),
        ({"clip": 1.0, "max_clients": 0}, "secagg max_clients=0 is invalid"),
    ],
)
def test_bad_codec_settings_are_refused_by_name(kwargs, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        SummableCodec(**kwargs)


def test_a_sum_of_more_than_max_clients_or_of_another_width_is_refused() -> None:
    codec = SummableCodec(clip=1.0, bits=8, max_clients=4)
    with pytest.raises(ValueError, match="a sum of 5 updates cannot be decoded; allowed: 1 to max_clients=4"):
        codec.decode_mean(np.zeros(3, codec.dtype), 5)
    with pytest.raises(ValueError, match="not this codec's"):
        codec.decode_mean(np.zeros(3, np.uint32), 2)
    with pytest.raises(ValueError, match="not finite"):
        codec.encode(np.array([np.nan], np.float32), None, np.random.default_rng(0))


# --------------------------------------------------------------------------- the cryptography


def test_key_agreement_is_symmetric_and_bound_to_its_purpose() -> None:
    a_private, a_public = crypto.new_key_pair()
    b_private, b_public = crypto.new_key_pair()
    assert crypto.agree(a_private, b_public, b"x") == crypto.agree(b_private, a_public, b"x")
    assert crypto.agree(a_private, b_public, b"x") != crypto.agree(a_private, b_public, b"y")
    assert crypto.public_of(a_private) == a_public
    with pytest.raises(SecAggError, match="a public key has 3 bytes; allowed: 32"):
        crypto.agree(a_private, b"abc", b"x")


def test_masks_are_a_function_of_the_seed_and_uniform() -> None:
    seed = bytes(range(32))  # fixed: the uniformity check below is deterministic
    first = crypto.mask(seed, 200_000, np.dtype("<u2"))
    assert np.array_equal(first, crypto.mask(seed, 200_000, np.dtype("<u2")))
    assert not np.array_equal(first[:100], crypto.mask(crypto.new_seed(), 100, np.dtype("<u2")))
    counts = np.bincount(first & 0xFF, minlength=256)  # the low byte: chi-squared with 255 degrees of freedom
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 350  # p ~ 1e-4 under uniformity
    assert crypto.mask(seed, 5, np.dtype("<u8")).dtype == np.dtype("<u8")


def test_sealed_shares_open_only_unaltered_and_for_their_pair() -> None:
    key = crypto.agree(crypto.new_key_pair()[0], crypto.new_key_pair()[1], b"share")
    sealed = crypto.seal(key, b"share bytes", b"round|1|2")
    assert crypto.unseal(key, sealed, b"round|1|2") == b"share bytes"
    altered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for blob, associated in ((altered, b"round|1|2"), (sealed, b"round|1|3")):
        with pytest.raises(SecAggError, match="failed authentication"):
            crypto.unseal(key, blob, associated)


def test_any_threshold_shares_rebuild_the_secret_and_fewer_do_not() -> None:
    secret = crypto.new_seed()
    shares = crypto.share(secret, 3, 5)
    for subset in itertools.combinations(shares, 3):
        assert crypto.combine(list(subset)) == secret
    for subset in itertools.combinations(shares, 2):  # below the threshold: garbage, or a padding error
        try:
            assert crypto.combine(list(subset)) != secret
        except SecAggError:
            pass
    with pytest.raises(ValueError, match="allowed: 2 <= threshold <= shares"):
        crypto.share(secret, 6, 5)


# --------------------------------------------------------------------------- the graph


def test_the_ring_graph_is_symmetric_of_the_given_degree_and_complete_when_small() -> None:
    ids = list(range(1, 21))
    graph = neighbourhoods(ids, 6, seed=5)
    assert all(len(graph[u]) == 6 and u not in graph[u] for u in ids)
    assert all(u in graph[v] for u in ids for v in graph[u])
    assert graph == neighbourhoods(ids, 6, seed=5) and graph != neighbourhoods(ids, 6, seed=6)
    small = neighbourhoods([3, 1, 2], 4, seed=0)
    assert small == {1: (2, 3), 2: (1, 3), 3: (1, 2)}
    assert default_degree(20) == 10 and default_threshold(11) == 8 and default_threshold(2) == 2
    with pytest.raises(ValueError, match="an even integer >= 2"):
        neighbourhoods(ids, 3, seed=0)


# --------------------------------------------------------------------------- the protocol


def run_round(  # noqa: PLR0913 - the scenario's knobs
    n: int,
    *,
    codec: SummableCodec | None = None,
    degree: int | None = None,
    threshold: int | None = None,
    silent_at_share: tuple[int, ...] = (),
    silent_at_masked: tuple[int, ...] = (),
    silent_at_unmask: tuple[int, ...] = (),
    keys_reply=None,  # noqa: ANN001 - (node, reply) -> reply, to corrupt what a client advertises
    masked_reply=None,  # noqa: ANN001 - (node, vector) -> vector
    unmask_reply=None,  # noqa: ANN001 - (node, answer) -> answer
    seed: int = 0,
    fresh_processes: bool = False,
):
    """One round among clients ``1..n`` with random updates; ``(server, total, count, integers)``.

    ``fresh_processes``: each client answers each stage from its saved state only (``to_bytes`` ->
    ``from_bytes``), as a node does whose ClientApp is a new process per message."""
    codec = codec or SummableCodec(clip=1.0, bits=8, max_clients=64)
    rng = np.random.default_rng(seed)
    ids = list(range(1, n + 1))
    server = SecAggServer(ids, codec, DIM, degree=degree, threshold=threshold, seed=seed)
    clients = _Reloading({u: SecAggClient(u) for u in ids}) if fresh_processes else {u: SecAggClient(u) for u in ids}
    integers = {u: codec.quantize(rng.normal(0, 0.5, DIM), rng) for u in ids}
    setup = server.setup_messages()
    keys = server.receive_keys({u: (keys_reply or (lambda _, r: r))(u, clients[u].advertise(setup[u])) for u in ids})
    shares = server.receive_shares({u: clients[u].share_keys(keys[u]) for u in keys if u not in silent_at_share})
    requests = server.receive_masked(
        {
            u: (masked_reply or (lambda _, v: v))(u, clients[u].masked_input(shares[u], codec.to_wire(integers[u])))
            for u in shares
            if u not in silent_at_masked
        }
    )
    answers = {
        u: (unmask_reply or (lambda _, a: a))(u, clients[u].unmask(**requests[u]))
        for u in requests
        if u not in silent_at_unmask
    }
    total, count = server.receive_unmask(answers)
    return server, total, count, integers


class _Reloading(dict):
    """Clients that live only as their saved bytes between two uses."""

    def __init__(self, clients: dict[int, SecAggClient]) -> None:
        super().__init__({u: c.to_bytes() for u, c in clients.items()})

    def __getitem__(self, node: int) -> SecAggClient:
        outer = self

        class Saving:
            def __getattr__(self, name: str):  # noqa: ANN204
                client = SecAggClient.from_bytes(dict.__getitem__(outer, node), node)

                def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                    result = getattr(client, name)(*args, **kwargs)
                    dict.__setitem__(outer, node, client.to_bytes())
                    return result

                return call

        return Saving()


def _sum_of(integers: dict[int, np.ndarray], nodes) -> np.ndarray:  # noqa: ANN001
    return np.sum([integers[u] for u in nodes], axis=0)


def test_the_unmasked_sum_is_the_exact_sum_of_every_encoded_update() -> None:
    server, total, count, integers = run_round(8)
    assert count == 8 and server.dropped == [] and server.refused == {}
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, range(1, 9)))


def test_a_client_answering_each_stage_from_its_saved_state_gives_the_same_exact_sum() -> None:
    server, total, count, integers = run_round(7, silent_at_masked=(5,), fresh_processes=True)
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 2, 3, 4, 6, 7]))


def test_a_damaged_or_foreign_saved_state_is_refused() -> None:
    client = SecAggClient(3)
    client.advertise({"neighbours": [1, 2], "threshold": 2, "codec": {"clip": 1.0}, "dim": 4, "round": b"r"})
    saved = client.to_bytes()
    assert SecAggClient.from_bytes(saved, 3).s_public == client.s_public
    with pytest.raises(SecAggError, match="is node 3's, not 4's"):
        SecAggClient.from_bytes(saved, 4)
    for damaged in (saved[:-5], saved.replace(b'"dim": 4', b'"dim": "x"'), b"\x80not json"):
        with pytest.raises(SecAggError, match="saved secure-aggregation state is damaged"):
            SecAggClient.from_bytes(damaged, 3)


def test_the_server_never_holds_an_unmasked_update() -> None:
    """What the server receives from each client is its encoded update plus masks: uniform, unrelated to it."""
    captured = {}

    def keep(node, vector):  # noqa: ANN001, ANN202
        captured[node] = vector.copy()
        return vector

    server, total, count, integers = run_round(6, masked_reply=keep)
    for u, vector in captured.items():
        plain = server.codec.to_wire(integers[u])
        assert np.mean(vector == plain) < 0.05  # 1/65536 expected per coordinate by chance
        assert np.mean(vector.astype(np.int64) < 2**15) == pytest.approx(0.5, abs=0.2)  # spread over the lanes
    # only the whole round's sum comes out
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, captured))


@pytest.mark.parametrize("dropped", [(3,), (2, 5)])
def test_clients_dropping_after_sharing_are_recovered_through_their_neighbours(dropped) -> None:  # noqa: ANN001
    server, total, count, integers = run_round(8, silent_at_masked=dropped)
    assert server.dropped == sorted(dropped) and count == 8 - len(dropped)
    survivors = [u for u in range(1, 9) if u not in dropped]
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, survivors))


def test_a_client_silent_before_sharing_is_left_out_cleanly() -> None:
    server, total, count, integers = run_round(6, silent_at_share=(4,))
    assert count == 5 and 4 not in server.u2
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 2, 3, 5, 6]))


def test_secagg_plus_on_a_sparse_graph_survives_drop_outs_at_every_stage() -> None:
    server, total, count, integers = run_round(
        20, degree=6, threshold=4, silent_at_share=(7,), silent_at_masked=(2, 13), silent_at_unmask=(19,), seed=4
    )
    assert all(len(server.graph[u]) == 6 for u in server.graph)
    survivors = sorted(server.u3)
    assert 7 not in survivors and 2 not in survivors and 19 in survivors  # silent at unmask: its input still counts
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, survivors))


def test_too_few_survivors_abort_the_round_and_release_nothing() -> None:
    with pytest.raises(SecAggAbort, match="3 masked vectors arrived; secure aggregation needs 4"):
        run_round(6, threshold=4, silent_at_masked=(1, 2, 3))
    with pytest.raises(SecAggAbort, match=r"shares of the seed of \d+ arrived; rebuilding it needs 5"):
        run_round(6, threshold=5, silent_at_unmask=(1, 2))


def test_a_malformed_advertisement_leaves_that_client_out_with_its_reason() -> None:
    def short_key(node, reply):  # noqa: ANN001, ANN202
        return {**reply, "s_pk": reply["s_pk"][:10]} if node == 2 else reply

    server, total, count, integers = run_round(6, keys_reply=short_key)
    assert "not three 32-byte values" in server.refused[2] and count == 5
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 3, 4, 5, 6]))


def test_a_malformed_masked_vector_is_refused_and_its_masks_removed_as_a_drop_out() -> None:
    def wrong_shape(node, vector):  # noqa: ANN001, ANN202
        return vector[:-1] if node == 4 else vector

    server, total, count, integers = run_round(6, masked_reply=wrong_shape)
    assert "masked vector is uint16(63,)" in server.refused[4] and server.dropped == [4]
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 2, 3, 5, 6]))


def test_a_wrong_share_at_unmasking_is_found_and_left_out() -> None:
    def corrupt(node, answer):  # noqa: ANN001, ANN202
        if node == 1:  # client 1 lies about every seed share it holds
            answer = {**answer, "b": {v: blob[:4] + bytes(len(blob) - 4) for v, blob in answer["b"].items()}}
        return answer

    server, total, count, integers = run_round(6, threshold=3, unmask_reply=corrupt)
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, range(1, 7)))


def test_one_wrong_share_among_the_default_thirteen_holders_is_left_out() -> None:
    """40 clients, the spec's defaults: k = 2 ceil(log2 40) + 1 = 13 holders of each secret, t = 9."""

    def corrupt(node, answer):  # noqa: ANN001, ANN202
        if node == 1:
            answer = {**answer, "b": {v: blob[:4] + bytes(len(blob) - 4) for v, blob in answer["b"].items()}}
        return answer

    server, total, count, integers = run_round(40, unmask_reply=corrupt, seed=3)
    assert server.threshold == 9 and all(len(n) == 12 for n in server.graph.values())
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, range(1, 41)))


def test_replies_of_the_wrong_types_are_refused_not_raised() -> None:
    def bad_shares(node, answer):  # noqa: ANN001, ANN202
        return {"b": list(answer["b"].values()), "s": {}} if node == 2 else answer

    def bad_vector(node, vector):  # noqa: ANN001, ANN202
        return vector.tolist() if node == 3 else vector

    server, total, count, integers = run_round(7, threshold=3, masked_reply=bad_vector, unmask_reply=bad_shares)
    assert "is a list, not a numpy array" in server.refused[3] and server.dropped == [3]
    assert "not two maps ('b', 's') from integer node ids" in server.refused[2]
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 2, 4, 5, 6, 7]))


def test_a_low_order_public_key_is_refused_before_it_can_spoil_its_neighbours() -> None:
    def zero_key(node, reply):  # noqa: ANN001, ANN202
        return {**reply, "s_pk": bytes(32)} if node == 5 else reply

    server, total, count, integers = run_round(6, keys_reply=zero_key)
    assert server.refused[5] == "its s_pk is not a usable X25519 public key" and count == 5
    assert np.array_equal(server.codec.signed_sum(total, count), _sum_of(integers, [1, 2, 3, 4, 6]))


def _advertised(nodes: list[int], threshold: int):  # noqa: ANN202
    """A round by hand, through stage 1: ``(codec, server, clients, setup, keys)``."""
    codec = SummableCodec(clip=1.0, bits=8, max_clients=8)
    server = SecAggServer(nodes, codec, DIM, threshold=threshold)
    clients = {u: SecAggClient(u) for u in nodes}
    setup = server.setup_messages()
    keys = server.receive_keys({u: clients[u].advertise(setup[u]) for u in clients})
    return codec, server, clients, setup, keys


def test_shares_keyed_by_something_else_than_node_ids_are_refused() -> None:
    _, server, clients, _, keys = _advertised([1, 2, 3, 4], threshold=2)
    replies = {u: clients[u].share_keys(keys[u]) for u in clients}
    replies[4] = {str(v): blob for v, blob in replies[4].items()}
    forwarded = server.receive_shares(replies)
    assert "by integer node id" in server.refused[4] and 4 not in forwarded
    with pytest.raises(RuntimeError, match="server stage 2 called after stage 2; the stages run in order"):
        server.receive_shares(replies)


def test_a_client_answers_one_unmask_request_only_also_after_a_restart() -> None:
    codec, server, clients, _, keys = _advertised([1, 2, 3], threshold=2)
    shares = server.receive_shares({u: clients[u].share_keys(keys[u]) for u in clients})
    requests = server.receive_masked(
        {u: clients[u].masked_input(shares[u], codec.to_wire(np.zeros(DIM, np.int64))) for u in clients}
    )
    clients[1].unmask(**requests[1])
    restarted = SecAggClient.from_bytes(clients[1].to_bytes(), 1)
    for client in (clients[1], restarted):
        with pytest.raises(SecAggError, match="a stage-4 message arrived at stage 5"):
            client.unmask(alive=[1], dropped=[2, 3], survivors=2)  # a second request: the other clients' keys


def test_wrong_shares_beyond_what_the_threshold_tolerates_abort() -> None:
    def corrupt(node, answer):  # noqa: ANN001, ANN202
        if node != 6:
            answer = {**answer, "b": {v: blob[:4] + bytes(len(blob) - 4) for v, blob in answer["b"].items()}}
        return answer

    with pytest.raises(SecAggAbort, match="could not be rebuilt from its 6 shares"):
        run_round(6, threshold=3, unmask_reply=corrupt)


def test_a_client_refuses_what_a_server_must_not_ask() -> None:
    codec, server, clients, setup, keys = _advertised([1, 2, 3, 4], threshold=3)
    with pytest.raises(SecAggError, match="a stage-1 message arrived at stage 2"):
        clients[1].advertise(setup[1])
    shares = server.receive_shares({u: clients[u].share_keys(keys[u]) for u in clients})
    tampered = {v: blob[:-1] + bytes([blob[-1] ^ 1]) for v, blob in shares[1].items()}
    with pytest.raises(SecAggError, match="failed authentication"):
        clients[1].masked_input(tampered, codec.to_wire(np.zeros(DIM, np.int64)))
    for u in (2, 3, 4):
        clients[u].masked_input(shares[u], codec.to_wire(np.zeros(DIM, np.int64)))
    with pytest.raises(SecAggError, match="overlap or leave this client out"):
        clients[2].unmask(alive=[2, 3], dropped=[3], survivors=3)  # both shares of client 3: would unmask it
    with pytest.raises(SecAggError, match="names 2 survivors; unmasking needs at least 3"):
        clients[2].unmask(alive=[2, 3], dropped=[], survivors=2)
    with pytest.raises(SecAggError, match="the server's neighbour list repeats a client or names this one"):
        SecAggClient(9).advertise({**setup[1], "neighbours": [9, 2]})


def test_the_server_refuses_settings_that_cannot_work() -> None:
    codec = SummableCodec(clip=1.0, bits=8, max_clients=4)
    with pytest.raises(ValueError, match="5 participants; the codec sums at most 4"):
        SecAggServer([1, 2, 3, 4, 5], codec, DIM)
    with pytest.raises(ValueError, match=r"threshold=5; allowed: 2 to 4"):
        SecAggServer([1, 2, 3, 4], codec, DIM, threshold=5)
    many = SummableCodec(clip=1.0, bits=4, max_clients=400)
    with pytest.raises(ValueError, match="gives 301 share holders; allowed: at most 255"):
        SecAggServer(list(range(1, 400)), many, DIM, degree=300)
