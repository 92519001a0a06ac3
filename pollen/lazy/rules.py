"""The lazy (NLA) and accelerated (AA) aggregation rules, both directions (spec ``papers/fedbaca.md`` §4-5).

Everything here is pure numpy and shared by the server and the client, so both sides compute the same
bits from the same inputs (a client and the server must agree on every stored copy).

A *judgement* compares a candidate vector with the reference the receiver already holds (the last
vector that crossed the wire between the two, ``ref``)::

    no reference (None, or all zeros)          -> send:  used = cand,        new ref = cand
    NLA and ||cand - ref|| <= tau ||ref||      -> skip:  used = ref,         ref unchanged (a 1-bit flag travels)
    AA  and ||cand - ref|| <= tau ||ref||      -> aa:    used = ref + cand,  new ref = cand
    otherwise                                  -> send:  used = cand,        new ref = cand

``tau`` is the effective threshold ``C / (alpha |S_t|)`` (or ``D / (alpha |S_t|)``; §4). Norms are taken
in float64; ``used`` is float32. With ``tau = 0`` nothing fires unless ``cand == ref`` exactly.

The downlink (Algorithm 2) follows the spec's *increment reading* (§5.3): the server keeps a mirror
``x_i`` of each client's model and the last increment ``c_prev_i`` that travelled (for AA the new
candidate, not the merged sum); each round it judges the compressed increment ``C(theta - x_i)`` against
``c_prev_i`` and both sides add the judged result to ``x_i``.
Two ablations: ``model-keep`` (Variant B: skip when ``||c|| <= tau ||x_i||``, the client keeps its model)
and ``literal`` (Variant C: error feedback on the raw model, the client *replaces* its model by the
judged vector; the spec's negative control).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

RULES = ("none", "nla", "aa")
DOWNLINK_MODES = ("increment", "model-keep", "literal")
EF_MODES = ("applied", "compressed")
REF_MODES = ("last-transmitted", "consecutive-only")
#: What ``tau-up`` / ``tau-down`` are: the effective thresholds, or the paper's C and D (scaled by 1/(alpha |S_t|)).
TAU_SCALINGS = ("effective", "paper")
#: What a judgement decided; ``keep`` is Variant B's skip (nothing applied).
KINDS = ("send", "skip", "aa", "keep")


@dataclass(frozen=True)
class Judgement:
    """The outcome of one NLA / AA test.

    ``kind`` is ``send``, ``skip`` or ``aa``; ``used`` the vector the receiver applies; ``new_ref`` the
    reference both sides keep afterwards; ``transmit`` whether the candidate crosses the wire; ``rel``
    is ``||cand - ref|| / ||ref||`` (``nan`` without a reference), the quantity compared with ``tau``.
    """

    kind: str
    used: np.ndarray
    new_ref: np.ndarray | None
    rel: float

    @property
    def transmit(self) -> bool:
        return self.kind in ("send", "aa")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else ``ValueError`` naming what is allowed."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is unknown; allowed: {', '.join(allowed)}")
    return value


def check_tau(name: str, tau: float) -> float:
    """A threshold as a float, or ``ValueError`` unless it is finite and >= 0."""
    tau = float(tau)
    if not (np.isfinite(tau) and tau >= 0):
        raise ValueError(f"{name}={tau!r} is out of range; allowed: a finite number >= 0")
    return tau


def norm64(vector: np.ndarray) -> float:
    """Euclidean norm accumulated in float64 with numpy's pairwise sum (no BLAS: the same bits on any machine,
    and no BLAS threads spinning against the training process)."""
    return float(np.sqrt(np.sum(np.square(vector, dtype=np.float64))))


def judge(cand: np.ndarray, ref: np.ndarray | None, rule: str, tau: float) -> Judgement:
    """Apply NLA (``rule="nla"``), AA (``"aa"``) or nothing (``"none"``) to ``cand`` against ``ref``."""
    cand = np.asarray(cand, dtype=np.float32)
    ref_norm = 0.0 if ref is None else norm64(ref)
    if rule == "none" or ref is None or ref_norm == 0.0:
        return Judgement("send", cand, cand, float("nan"))
    gap = norm64(np.subtract(cand, ref, dtype=np.float32))
    rel = gap / ref_norm
    if gap <= tau * ref_norm:
        if rule == "nla":
            return Judgement("skip", np.asarray(ref, dtype=np.float32), ref, rel)
        if rule == "aa":
            return Judgement("aa", np.add(ref, cand, dtype=np.float32), cand, rel)
        raise ValueError(f"rule={rule!r} is unknown; allowed: {', '.join(RULES)}")
    return Judgement("send", cand, cand, rel)


def replay(kind: str, received: np.ndarray | None, ref: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The receiver's side of :func:`judge`: ``(used, new_ref)`` from the kind, what arrived and its ref.

    Raises ``ValueError`` when the message cannot be applied (a skip or aa without a stored reference, a
    skip that carries a vector, a send or aa without one).
    """
    if kind == "skip":
        if received is not None:
            raise ValueError("a skip flag together with a vector")
        if ref is None:
            raise ValueError("a skip flag, but no stored copy to reuse")
        return np.asarray(ref, dtype=np.float32), ref
    if kind == "keep":
        if received is not None:
            raise ValueError("a keep flag together with a vector")
        return None, ref  # type: ignore[return-value]
    if received is None:
        raise ValueError(f"a {kind!r} message without its vector")
    received = np.asarray(received, dtype=np.float32)
    if kind == "aa":
        if ref is None:
            raise ValueError("an aa flag, but no stored copy to add")
        return np.add(ref, received, dtype=np.float32), received
    if kind == "send":
        return received, received
    raise ValueError(f"kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")


def uplink_residual(
    delta: np.ndarray, residual: np.ndarray | None, used: np.ndarray, cand: np.ndarray, ef_mode: str
) -> np.ndarray:
    """The client's new error-feedback residual (Algorithm 3 line 13).

    ``applied`` (default, Lemma F.4): ``e <- Delta + e - used``; ``compressed`` (proof identities
    D.1/E.1): ``e <- Delta + e - cand``, whatever the judgement did.
    """
    check_choice("ef_mode", ef_mode, EF_MODES)
    p = np.asarray(delta, dtype=np.float32).copy() if residual is None else np.add(delta, residual, dtype=np.float32)
    p -= used if ef_mode == "applied" else cand
    return p


def checksum(vector: np.ndarray) -> str:
    """A short digest of a float32 vector's bytes: both sides compare copies without sending them."""
    data = np.ascontiguousarray(vector, dtype=np.float32)
    return hashlib.blake2b(data.tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class DownlinkStep:
    """What the server sends one client and what both sides hold afterwards.

    ``kind`` is ``send``, ``skip``, ``aa`` or ``keep``; ``payload_vector`` the decoded candidate that
    travels (``None`` for skip / keep); ``new_x`` the client's model after applying it, ``new_c_prev``
    the stored last vector, ``new_error`` Variant C's model error (``None`` otherwise), ``apply`` whether
    the client adds (``add``) or replaces (``set``).
    """

    kind: str
    payload_vector: np.ndarray | None
    new_x: np.ndarray
    new_c_prev: np.ndarray | None
    new_error: np.ndarray | None
    apply: str
    rel: float


def apply_downlink(
    kind: str, received: np.ndarray | None, x: np.ndarray, c_prev: np.ndarray | None, apply: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """The client's side (and the server's mirror): ``(new_x, new_c_prev)`` from one downlink message."""
    used, new_ref = replay(kind, received, c_prev)
    if kind == "keep":
        return np.asarray(x, dtype=np.float32), new_ref
    if apply == "set":
        return used, new_ref
    return np.add(x, used, dtype=np.float32), new_ref


def downlink_step(
    theta: np.ndarray,
    x: np.ndarray,
    c_prev: np.ndarray | None,
    error: np.ndarray | None,
    codec,  # noqa: ANN001 - a pollen.compression Codec
    *,
    rule: str,
    tau: float,
    mode: str = "increment",
):  # noqa: ANN201 - (DownlinkStep, Payload | None)
    """The server's downlink decision for one client; returns ``(DownlinkStep, payload or None)``.

    ``x`` is the server's mirror of the client's model, ``c_prev`` the last vector the client stored,
    ``error`` Variant C's model error ``E_i``. The mirror update uses :func:`apply_downlink`, the very
    function the client runs, so the two copies stay bit-identical.
    """
    theta = np.asarray(theta, dtype=np.float32)
    if mode == "literal":
        target = theta.copy() if error is None else np.add(theta, error, dtype=np.float32)
    else:
        target = np.subtract(theta, x, dtype=np.float32)
    payload = codec.encode(target)
    cand = codec.decode(payload, target.size)
    if mode == "model-keep":
        x_norm = norm64(x)
        rel = norm64(cand) / x_norm if x_norm > 0 else float("nan")
        kind = "keep" if rule != "none" and x_norm > 0 and norm64(cand) <= tau * x_norm else "send"
        received = None if kind == "keep" else cand
        new_x, new_c_prev = apply_downlink(kind, received, x, c_prev, "add")
        return DownlinkStep(kind, received, new_x, new_c_prev, None, "add", rel), (None if kind == "keep" else payload)
    verdict = judge(cand, c_prev, rule, tau)
    received = cand if verdict.transmit else None
    apply = "set" if mode == "literal" else "add"
    new_x, new_c_prev = apply_downlink(verdict.kind, received, x, c_prev, apply)
    new_error = np.subtract(target, verdict.used, dtype=np.float32) if mode == "literal" else None
    return DownlinkStep(verdict.kind, received, new_x, new_c_prev, new_error, apply, verdict.rel), (
        payload if verdict.transmit else None
    )


#: Below this effective threshold a top-k or sign candidate with error feedback is almost never close enough
#: to the last one to be skipped or merged (pollen's calibration, docs/results/lazy.md: relative changes 1.19-1.66,
#: none at or below 1.1 on the MLP or the CNN; the spec's numpy one: 1.07-1.54).
UPLINK_EF_FLOOR = 1.2


def threshold_warnings(  # noqa: PLR0913 - both directions' rule and threshold
    up_rule: str, up_tau: float, compressor: str, error_feedback: bool, down_rule: str, down_tau: float
) -> list[str]:
    """Why the effective thresholds ``up_tau`` / ``down_tau`` cannot fire, one line each (a strategy logs them
    once: when built, or with ``tau_scaling="paper"`` in the first round, when ``|S_t|`` is known)."""
    lines = []
    if up_rule != "none" and up_tau == 0.0:
        lines.append(f"tau-up = 0: the uplink {up_rule} rule never fires (the run is plain FedAMS/FedCAMS)")
    elif up_rule != "none" and error_feedback and up_tau < UPLINK_EF_FLOOR:
        lines.append(
            f"uplink threshold {up_tau:g} with {compressor} and error feedback: a compensated candidate "
            f"differs from the last by about 1.2-1.7 x its norm (pollen's calibration, docs/results/lazy.md), so a "
            f"threshold below {UPLINK_EF_FLOOR:g} rarely fires"
        )
    if down_rule != "none" and down_tau == 0.0:
        lines.append(f"tau-down = 0: the downlink {down_rule} rule never fires")
    return lines
