"""SecAgg+ as two state machines, one per client and one for the server, over four exchanges.

The server learns the sum of the surviving clients' encoded updates and nothing else about any one of
them (semi-honest server: it follows the protocol; without the consistency round of the active version it
could tell two clients different survivor lists). Each exchange is one message each way per client; the
messages are plain dicts of bytes, ints and one numpy vector, for any transport:

1. **advertise keys**: the server sends each client its neighbours, the threshold and the codec; the client
   answers with two X25519 public keys (one to encrypt shares, one to agree masks) and a commitment to its
   self-mask seed ``b``.
2. **share keys**: the server sends each client its surviving neighbours' keys; the client splits its mask
   private key and ``b`` into Shamir shares among those neighbours and itself (any ``threshold`` of them
   rebuild either) and seals each neighbour's pair of shares for that neighbour (AES-GCM under their agreed
   key), which the server forwards.
3. **masked input**: the client adds to its encoded update a mask from ``b`` and, for each neighbour that
   shared, a pairwise mask from their agreed key, ``+`` towards a larger id and ``-`` towards a smaller one,
   all modulo ``2**W``.
4. **unmask**: the server names the survivors and the dropped; each survivor returns its shares of the
   survivors' ``b`` and of the dropped clients' mask keys, never both for one client. The server rebuilds
   them (each checked: ``b`` against its commitment, a key against its public key, so a wrong share is
   found and left out), removes the masks and is left with the sum.

A client that drops after sharing is recovered as long as ``threshold`` of its neighbours answer the
unmask; fewer than ``threshold`` survivors, or a secret that cannot be rebuilt, abort the round
(:class:`SecAggAbort`): nothing is released. A malformed or forged message from a client drops that
client at that stage (its reason kept in :attr:`SecAggServer.refused`); one to a client is refused by it
(:class:`~pollen.secagg.crypto.SecAggError`).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import struct
from typing import Any

import numpy as np

import pollen.secagg.crypto as crypto  # not through the package: its __init__ imports this module
from pollen.secagg.codec import SummableCodec
from pollen.secagg.crypto import KEY_BYTES, SecAggError
from pollen.secagg.graph import default_degree, default_threshold, neighbourhoods

SHARE_PURPOSE = b"pollen-secagg-share"
MASK_PURPOSE = b"pollen-secagg-mask"
#: t-subsets tried per secret when its shares do not all agree (a wrong share among them).
MAX_COMBINATIONS = 2048


class SecAggAbort(RuntimeError):
    """The round cannot finish securely (too few survivors, a secret that cannot be rebuilt): nothing is released."""


def _associated(round_key: bytes, sender: int, receiver: int) -> bytes:
    return round_key + struct.pack("<QQ", sender, receiver)  # Flower node ids are unsigned 64-bit


def _pack_shares(b_share: bytes, s_share: bytes) -> bytes:
    return struct.pack("<HH", len(b_share), len(s_share)) + b_share + s_share


def _unpack_shares(blob: bytes) -> tuple[bytes, bytes]:
    if len(blob) < 4:
        raise SecAggError("a share pair is too short")
    b_len, s_len = struct.unpack("<HH", blob[:4])
    if len(blob) != 4 + b_len + s_len:
        raise SecAggError("a share pair's lengths do not add up")
    return blob[4 : 4 + b_len], blob[4 + b_len :]


def _pairwise_sign(me: int, other: int) -> int:
    return 1 if me < other else -1


class SecAggClient:
    """One client's side of a round: keys, shares, its masked vector, its part of the unmasking."""

    def __init__(self, node_id: int) -> None:
        self.node_id = int(node_id)
        self.stage = 0
        self._held: dict[int, tuple[bytes, bytes]] = {}  # sender -> (share of its b, share of its mask key)
        self._peers: dict[int, dict[str, bytes]] = {}

    def advertise(self, setup: dict[str, Any]) -> dict[str, bytes]:
        """Stage 1: check the round's settings, make the keys and the seed, return the public parts."""
        self._expect(0)
        try:
            neighbours = [int(v) for v in setup["neighbours"]]
            threshold, dim, round_key = int(setup["threshold"]), int(setup["dim"]), bytes(setup["round"])
            codec = SummableCodec(**setup["codec"])
        except (KeyError, TypeError, ValueError) as err:
            raise SecAggError(f"the server's setup is malformed: {type(err).__name__}: {err}") from None
        if self.node_id in neighbours or len(set(neighbours)) != len(neighbours):
            raise SecAggError("the server's neighbour list repeats a client or names this one")
        if not (2 <= threshold <= len(neighbours) + 1):
            raise SecAggError(f"threshold {threshold} with {len(neighbours)} neighbours; allowed: 2 to neighbours + 1")
        if dim < 1:
            raise SecAggError(f"the server's setup asks for {dim} coordinates; allowed: at least 1")
        self.neighbours, self.threshold, self.codec = set(neighbours), threshold, codec
        self.dim, self.round_key = dim, round_key
        self._c_private, c_public = crypto.new_key_pair()
        self._s_private, self.s_public = crypto.new_key_pair()
        self._seed = crypto.new_seed()
        self.stage = 1
        return {"c_pk": c_public, "s_pk": self.s_public, "b_commit": crypto.commit(self._seed)}

    def share_keys(self, keys: dict[int, dict[str, bytes]]) -> dict[int, bytes]:
        """Stage 2: shares of the mask key and the seed among ``keys``' owners and this client, each neighbour's
        sealed for it."""
        self._expect(1)
        keys = {int(v): k for v, k in keys.items()}
        if not set(keys) <= self.neighbours:
            raise SecAggError("the server sent keys of clients that are not this client's neighbours")
        if len(keys) + 1 < self.threshold:
            raise SecAggError(f"{len(keys)} neighbours left; the threshold {self.threshold} needs {self.threshold - 1}")
        self._peers = keys
        holders = sorted([*keys, self.node_id])
        b_shares = crypto.share(self._seed, self.threshold, len(holders))
        s_shares = crypto.share(self._s_private, self.threshold, len(holders))
        sealed = {}
        for holder, b_share, s_share in zip(holders, b_shares, s_shares):
            if holder == self.node_id:
                self._held[self.node_id] = (b_share, s_share)
                continue
            key = crypto.agree(self._c_private, keys[holder]["c_pk"], SHARE_PURPOSE)
            sealed[holder] = crypto.seal(
                key, _pack_shares(b_share, s_share), _associated(self.round_key, self.node_id, holder)
            )
        self.stage = 2
        return sealed

    def masked_input(self, sealed: dict[int, bytes], update_wire: np.ndarray) -> np.ndarray:
        """Stage 3: open the neighbours' shares, mask the encoded update with the seed and every sharer."""
        self._expect(2)
        sealed = {int(v): blob for v, blob in sealed.items()}
        if not set(sealed) <= set(self._peers):
            raise SecAggError("the server forwarded shares from clients this one holds no keys of")
        update_wire = np.asarray(update_wire)
        if update_wire.dtype != self.codec.dtype or update_wire.shape != (self.dim,):
            raise SecAggError(
                f"the update is {update_wire.dtype}{update_wire.shape}, not {self.codec.dtype}({self.dim},)"
            )
        for sender, blob in sealed.items():
            key = crypto.agree(self._c_private, self._peers[sender]["c_pk"], SHARE_PURPOSE)
            self._held[sender] = _unpack_shares(
                crypto.unseal(key, blob, _associated(self.round_key, sender, self.node_id))
            )
        masked = update_wire + crypto.mask(self._seed, self.dim, self.codec.dtype)
        for other in sorted(sealed):
            pairwise = crypto.mask(
                crypto.agree(self._s_private, self._peers[other]["s_pk"], MASK_PURPOSE), self.dim, self.codec.dtype
            )
            masked = masked + pairwise if _pairwise_sign(self.node_id, other) > 0 else masked - pairwise
        self.stage = 3
        return masked

    def unmask(self, alive: list[int], dropped: list[int], survivors: int) -> dict[str, dict[int, bytes]]:
        """Stage 4: shares of the survivors' seeds and of the dropped clients' mask keys; once, never both for one.

        ``alive`` and ``dropped`` are this client's neighbours (and itself) on each side; ``survivors`` the
        round's count, which must reach the threshold (a sum of fewer is refused)."""
        self._expect(3)
        alive_set, dropped_set = {int(v) for v in alive}, {int(v) for v in dropped}
        if alive_set & dropped_set or self.node_id not in alive_set:
            raise SecAggError("the server's survivor and drop-out lists overlap or leave this client out")
        if not (alive_set | dropped_set) <= set(self._held):
            raise SecAggError("the server asks for shares of clients that did not share with this one")
        if int(survivors) < self.threshold:
            raise SecAggError(f"the server names {survivors} survivors; unmasking needs at least {self.threshold}")
        self.stage = 4
        return {
            "b": {v: self._held[v][0] for v in sorted(alive_set)},
            "s": {v: self._held[v][1] for v in sorted(dropped_set)},
        }

    def to_bytes(self) -> bytes:
        """This client's round so far, for a node that answers each stage in a fresh process (Flower's deployment
        starts a ClientApp per message): keep it in the node's ``context.state``, never send it. JSON, no pickle."""
        if self.stage == 0:
            return json.dumps({"node": self.node_id, "stage": 0}).encode()

        def b64(data: bytes) -> str:
            return base64.b64encode(data).decode()

        return json.dumps(
            {
                "node": self.node_id,
                "stage": self.stage,
                "neighbours": sorted(self.neighbours),
                "threshold": self.threshold,
                "codec": [self.codec.clip, self.codec.bits, self.codec.max_clients],
                "dim": self.dim,
                "round": b64(self.round_key),
                "keys": [b64(self._c_private), b64(self._s_private), b64(self._seed)],
                "peers": {str(v): {k: b64(x) for k, x in keys.items()} for v, keys in self._peers.items()},
                "held": {str(v): [b64(b), b64(sk)] for v, (b, sk) in self._held.items()},
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, node_id: int) -> SecAggClient:
        """The client :meth:`to_bytes` saved; :class:`SecAggError` if it is damaged or another node's."""
        try:
            saved = json.loads(data)
            client = cls(int(saved["node"]))
            if client.node_id != int(node_id):
                raise SecAggError(f"saved secure-aggregation state is node {client.node_id}'s, not {node_id}'s")
            client.stage = int(saved["stage"])
            if not 0 <= client.stage <= 4:
                raise SecAggError(f"saved secure-aggregation state is at stage {client.stage}; allowed: 0 to 4")
            if client.stage == 0:
                return client
            unb64 = base64.b64decode
            client.neighbours, client.threshold = {int(v) for v in saved["neighbours"]}, int(saved["threshold"])
            clip, bits, max_clients = saved["codec"]
            client.codec = SummableCodec(clip=float(clip), bits=int(bits), max_clients=int(max_clients))
            client.dim, client.round_key = int(saved["dim"]), unb64(saved["round"])
            client._c_private, client._s_private, client._seed = (unb64(x) for x in saved["keys"])
            client.s_public = crypto.public_of(client._s_private)
            client._peers = {int(v): {k: unb64(x) for k, x in keys.items()} for v, keys in saved["peers"].items()}
            client._held = {int(v): (unb64(b), unb64(sk)) for v, (b, sk) in saved["held"].items()}
        except SecAggError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise SecAggError(f"saved secure-aggregation state is damaged: {type(err).__name__}: {err}") from None
        return client

    def _expect(self, stage: int) -> None:
        if self.stage != stage:
            raise SecAggError(f"a stage-{stage + 1} message arrived at stage {self.stage + 1} of this round")


class SecAggServer:
    """The server's side of one round over ``participants``: what to send at each stage, the sum at the end.

    ``refused`` maps a client to why it left the protocol (a malformed message); ``dropped`` lists who
    stopped answering after sharing (their masks removed through their neighbours' shares).
    """

    def __init__(  # noqa: PLR0913 - the round's settings
        self,
        participants: list[int],
        codec: SummableCodec,
        dim: int,
        *,
        degree: int | None = None,
        threshold: int | None = None,
        seed: int = 0,
    ) -> None:
        self.participants = sorted(int(p) for p in participants)
        if len(self.participants) > codec.max_clients:
            raise ValueError(f"{len(self.participants)} participants; the codec sums at most {codec.max_clients}")
        self.codec, self.dim = codec, int(dim)
        degree = default_degree(len(self.participants)) if degree is None else degree
        self.graph = neighbourhoods(self.participants, degree, seed)
        holders = min(degree, len(self.participants) - 1) + 1
        if holders > 255:
            raise ValueError(f"secagg degree={degree} gives {holders} share holders; allowed: at most 255 (Shamir)")
        self.threshold = default_threshold(holders) if threshold is None else int(threshold)
        if not (2 <= self.threshold <= holders):
            raise ValueError(
                f"secagg threshold={self.threshold}; allowed: 2 to {holders} (a client and its neighbours)"
            )
        self.round_key = os.urandom(16)
        self.refused: dict[int, str] = {}
        #: The refused clients a caller has already reported (it adds to it; the protocol does not read it).
        self.reported: set[int] = set()
        self.dropped: list[int] = []
        self.stage = 0
        self.keys: dict[int, dict[str, bytes]] = {}
        self.u1: set[int] = set()
        self.u2: set[int] = set()
        self.u3: set[int] = set()
        #: The running sum of the well-formed masked vectors (modulo 2**W): no client's vector is kept.
        self.masked_sum: np.ndarray | None = None
        #: Each survivor's unmask request (:meth:`receive_masked`): its answer must cover exactly these shares.
        self.requests: dict[int, dict[str, Any]] = {}
        self._probe = crypto.new_key_pair()[0]  # to test an advertised key before anyone agrees with it

    def _advance(self, stage: int) -> None:
        if self.stage != stage - 1:
            raise RuntimeError(f"secagg: server stage {stage} called after stage {self.stage}; the stages run in order")
        self.stage = stage

    # ------------------------------------------------------------------ stage 1

    def setup_messages(self) -> dict[int, dict[str, Any]]:
        """Each participant's first message: its neighbours, the threshold, the codec, the vector size, the round."""
        codec = {"clip": self.codec.clip, "bits": self.codec.bits, "max_clients": self.codec.max_clients}
        return {
            u: {
                "neighbours": list(self.graph[u]),
                "threshold": self.threshold,
                "codec": codec,
                "dim": self.dim,
                "round": self.round_key,
            }
            for u in self.participants
        }

    def receive_keys(self, replies: dict[int, dict[str, bytes]]) -> dict[int, dict[int, dict[str, bytes]]]:
        """Keep the well-formed advertisements (U1); each client's message: its U1 neighbours' keys."""
        self._advance(1)
        for u, reply in replies.items():
            problem = self._bad_keys(u, reply)
            if problem:
                self.refused[u] = problem
            else:
                self.keys[u] = {name: bytes(reply[name]) for name in ("c_pk", "s_pk", "b_commit")}
        self.u1 = self._with_enough_neighbours(set(self.keys))
        return {u: {v: self.keys[v] for v in self.graph[u] if v in self.u1} for u in sorted(self.u1)}

    def _bad_keys(self, u: int, reply: Any) -> str | None:
        if u not in self.graph:
            return "not a participant of this round"
        if not isinstance(reply, dict) or not all(
            isinstance(reply.get(name), (bytes, bytearray)) and len(reply[name]) == KEY_BYTES
            for name in ("c_pk", "s_pk", "b_commit")
        ):
            return f"advertised keys are not three {KEY_BYTES}-byte values (c_pk, s_pk, b_commit)"
        if reply["c_pk"] == reply["s_pk"]:
            return "the encryption and masking public keys are the same"
        for name in ("c_pk", "s_pk"):  # a low-order point would make every neighbour's key agreement fail
            try:
                crypto.agree(self._probe, bytes(reply[name]), b"probe")
            except SecAggError:
                return f"its {name} is not a usable X25519 public key"
        return None

    def _with_enough_neighbours(self, alive: set[int]) -> set[int]:
        """Drop clients with fewer than ``threshold - 1`` neighbours left, until none has; abort below threshold."""
        while True:
            short = {u for u in alive if sum(v in alive for v in self.graph[u]) + 1 < self.threshold}
            if not short:
                break
            for u in short:
                self.refused.setdefault(u, "too few of its neighbours are left to hold its shares")
            alive -= short
        if len(alive) < self.threshold:
            raise SecAggAbort(f"{len(alive)} clients left in the round; secure aggregation needs {self.threshold}")
        return alive

    # ------------------------------------------------------------------ stage 2

    def receive_shares(self, replies: dict[int, dict[int, bytes]]) -> dict[int, dict[int, bytes]]:
        """Keep the clients that sealed a share pair for each of their U1 neighbours (U2); forward them."""
        self._advance(2)
        shared: dict[int, dict[int, bytes]] = {}
        for u, reply in replies.items():
            expected = {v for v in self.graph.get(u, ()) if v in self.u1}
            if u not in self.u1:
                self.refused.setdefault(u, "shares from a client that did not advertise keys")
            elif not isinstance(reply, dict) or not all(isinstance(v, int) for v in reply) or set(reply) != expected:
                self.refused[u] = "its sealed shares do not address exactly its neighbours (by integer node id)"
            elif not all(isinstance(blob, (bytes, bytearray)) and 32 <= len(blob) <= 4096 for blob in reply.values()):
                self.refused[u] = "a sealed share is not a byte string of a plausible length"
            else:
                shared[u] = {int(v): bytes(blob) for v, blob in reply.items()}
        self.u2 = self._with_enough_neighbours(set(shared))
        return {v: {u: shared[u][v] for u in self.graph[v] if u in self.u2} for v in sorted(self.u2)}

    # ------------------------------------------------------------------ stage 3

    def receive_masked(self, replies: dict[int, np.ndarray]) -> dict[int, dict[str, Any]]:
        """Keep the well-formed masked vectors (U3); each survivor's unmask request (its neighbourhood's part)."""
        self._advance(3)
        for u, vector in replies.items():
            if u not in self.u2:
                self.refused.setdefault(u, "a masked vector from a client that did not share its keys")
                continue
            if not isinstance(vector, np.ndarray):
                self.refused[u] = f"its masked vector is a {type(vector).__name__}, not a numpy array"
                continue
            if vector.dtype != self.codec.dtype or vector.shape != (self.dim,):
                self.refused[u] = (
                    f"its masked vector is {vector.dtype}{vector.shape}, not {self.codec.dtype}({self.dim},)"
                )
                continue
            if self.masked_sum is None:
                self.masked_sum = np.zeros(self.dim, dtype=self.codec.dtype)
            self.masked_sum += vector  # wraps modulo 2**W, as the masks do
            self.u3.add(u)
        u3 = set(self.u3)
        if len(u3) < self.threshold:
            raise SecAggAbort(f"{len(u3)} masked vectors arrived; secure aggregation needs {self.threshold}")
        self.u3, self.dropped = u3, sorted(self.u2 - u3)
        self.requests = {
            u: {
                "alive": sorted(v for v in (*self.graph[u], u) if v in u3 and (v == u or v in self.u2)),
                "dropped": [v for v in self.dropped if v in self.graph[u]],
                "survivors": len(u3),
            }
            for u in sorted(u3)
        }
        return self.requests

    # ------------------------------------------------------------------ stage 4

    def receive_unmask(self, replies: dict[int, dict[str, dict[int, bytes]]]) -> tuple[np.ndarray, int]:
        """Rebuild the survivors' seeds and the dropped clients' mask keys, remove every mask: ``(sum, count)``,
        the sum modulo ``2**W`` of the survivors' encoded updates. :class:`SecAggAbort` when a secret cannot be
        rebuilt from the shares that came."""
        self._advance(4)
        b_shares: dict[int, list[bytes]] = {u: [] for u in self.u3}
        s_shares: dict[int, list[bytes]] = {v: [] for v in self.dropped}
        for holder, reply in replies.items():
            if holder not in self.u3:
                self.refused.setdefault(holder, "an unmask answer from a client that is not a survivor")
                continue
            parts = [reply.get(kind) for kind in ("b", "s")] if isinstance(reply, dict) else [None]
            if not all(isinstance(part, dict) and all(isinstance(o, int) for o in part) for part in parts):
                self.refused[holder] = "its unmask answer is not two maps ('b', 's') from integer node ids to shares"
                continue
            asked = self.requests.get(holder, {})
            if set(parts[0]) != set(asked.get("alive", ())) or set(parts[1]) != set(asked.get("dropped", ())):
                self.refused[holder] = "its unmask answer does not hold exactly the shares it was asked for"
                continue
            for part, wanted, into in ((parts[0], self.u3, b_shares), (parts[1], set(self.dropped), s_shares)):
                for owner, blob in part.items():
                    if owner in wanted and (owner == holder or owner in self.graph[holder]) and isinstance(blob, bytes):
                        into[owner].append(blob)
        total = self.masked_sum.copy() if self.masked_sum is not None else np.zeros(self.dim, dtype=self.codec.dtype)
        for u in sorted(self.u3):
            seed = self._rebuild(
                b_shares[u], lambda s, u=u: crypto.commit(s) == self.keys[u]["b_commit"], f"seed of {u}"
            )
            total -= crypto.mask(seed, self.dim, self.codec.dtype)
        for v in self.dropped:
            private = self._rebuild(
                s_shares[v],
                lambda s, v=v: len(s) == KEY_BYTES and crypto.public_of(s) == self.keys[v]["s_pk"],
                f"mask key of dropped client {v}",
            )
            for u in sorted(w for w in self.graph[v] if w in self.u3):
                pairwise = crypto.mask(
                    crypto.agree(private, self.keys[u]["s_pk"], MASK_PURPOSE), self.dim, self.codec.dtype
                )
                # u added +mask towards a larger id, -mask towards a smaller one: take it back
                if _pairwise_sign(u, v) > 0:
                    total -= pairwise
                else:
                    total += pairwise
        return total, len(self.u3)

    def _rebuild(self, shares: list[bytes], valid: Any, what: str) -> bytes:
        """The secret behind ``shares`` that ``valid`` accepts: all of them, then leaving one out, then two, then
        t-subsets (at most :data:`MAX_COMBINATIONS` tries), so a wrong share or two is found and left out."""
        if len(shares) < self.threshold:
            raise SecAggAbort(f"{len(shares)} shares of the {what} arrived; rebuilding it needs {self.threshold}")
        count = len(shares)
        fewer = (itertools.combinations(shares, count - left) for left in (1, 2) if count - left >= self.threshold)
        candidates = itertools.chain([shares], *fewer, itertools.combinations(shares, self.threshold))
        for subset in itertools.islice(candidates, MAX_COMBINATIONS):
            try:
                secret = crypto.combine(list(subset))
            except SecAggError:
                continue
            if valid(secret):
                return secret
        raise SecAggAbort(f"the {what} could not be rebuilt from its {len(shares)} shares (some are wrong)")


__all__ = ["MAX_COMBINATIONS", "SecAggAbort", "SecAggClient", "SecAggServer"]
