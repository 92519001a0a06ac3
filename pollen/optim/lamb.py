"""LAMB server optimiser exactly as FedAdaVR App. B, Alg. 7 (eqs. 29-37).

Sign convention: ``delta = x_local - x_global`` (downhill); ``x_new = x + step``.
(FedAdaVR writes ``G = -Delta`` and subtracts; norms do not see the sign.)

::

    m_t, v_t as in Adam;  m_hat = m_t / (1 - beta1**t);  v_hat = v_t / (1 - beta2**t)
    r_hat = m_hat / (sqrt(v_hat) + eps)
    weight_norm = ||x_t||,  update_norm = ||r_hat||          # per tensor (default) or whole model
    r = weight_norm / update_norm  if both > 0  else 1.0
    x_{t+1} = x_t + eta * r * r_hat

No ``lambda * x`` inside ``r_hat`` and no clipping function ``phi`` (as in the paper).
The paper does not say whether the norms are per layer; the spec recommends per tensor
(You et al. 2020): ``segments`` gives one ``(start, stop)`` slice of the flat vector per
tensor, and ``layerwise=False`` uses whole-model norms instead. With per-tensor norms each
tensor with non-zero weights and update moves by exactly ``eta * ||x_l||`` per round; a
tensor whose weights are all zero (e.g. freshly initialised biases) or whose update is all
zero falls back to ``r = 1`` (spec §7 item 11).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from numbers import Integral

import numpy as np

from pollen.core.layout import segments_from_sizes

from .adam import update_moments
from .base import OptimizerState, ServerOptimizer, adaptive_step, check_bool

__all__ = ["Lamb", "segments_from_sizes"]


class Lamb(ServerOptimizer):
    """LAMB server optimiser (FedAdaVR App. B); ``update`` needs ``params``.

    Parameters
    ----------
    eta : float, default 0.01
        Server learning rate (> 0).
    beta1 : float, default 0.9
        First-moment decay, ``0 <= beta1 < 1``.
    beta2 : float, default 0.999
        Second-moment decay, ``0 <= beta2 < 1``.
    eps : float, default 1e-8
        Added to ``sqrt(v_hat)`` (outside the sqrt), ``>= 0``.
    bias_correction : bool, default True
        Correct ``m`` and ``v`` with the round counter (as FedAdaVR).
    segments : sequence of (int, int), optional
        ``(start, stop)`` slices of the flat vector, one per tensor, in order, tiling
        ``[0, d)`` without gaps (see :func:`segments_from_sizes`). Required when
        ``layerwise=True``.
    layerwise : bool, default True
        True: one trust ratio per segment. False: one trust ratio from whole-model norms.
    """

    name = "lamb"
    needs_params = True
    slot_names = ("m", "v")

    def __init__(
        self,
        *,
        eta: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        bias_correction: bool = True,
        segments: Sequence[tuple[int, int]] | None = None,
        layerwise: bool = True,
    ) -> None:
        self._set_moment_settings(eta, beta1, beta2, eps, bias_correction)
        self.layerwise = check_bool(self.name, "layerwise", layerwise)
        self.segments = None if segments is None else self._check_segments(segments)
        if self.layerwise and self.segments is None:
            raise ValueError(
                "lamb: segments=None with layerwise=True; allowed: segments=[(start, stop), ...] "
                "one per tensor (see segments_from_sizes), or layerwise=False for whole-model norms"
            )

    @staticmethod
    def _check_segments(segments: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        try:
            pairs = [tuple(p) for p in segments]
        except TypeError:
            raise ValueError(f"lamb: segments={segments!r} is not a sequence of (start, stop) pairs") from None
        expected = 0
        for i, p in enumerate(pairs):
            if len(p) != 2 or not all(isinstance(x, Integral) and not isinstance(x, bool) for x in p):
                raise ValueError(f"lamb: segments[{i}]={p!r} is not an (int start, int stop) pair")
            start, stop = int(p[0]), int(p[1])
            if start != expected or stop < start:
                raise ValueError(
                    f"lamb: segments[{i}]=({start}, {stop}) is invalid; allowed: start == {expected} "
                    "(the previous stop) and stop >= start (segments must tile [0, d) in order)"
                )
            expected = stop
        if not pairs or expected == 0:
            raise ValueError(f"lamb: segments={segments!r} covers no elements")
        return tuple((int(a), int(b)) for a, b in pairs)

    def _check_dim(self, dim: int) -> None:
        if self.segments is not None and self.segments[-1][1] != dim:
            raise ValueError(
                f"lamb: segments cover [0, {self.segments[-1][1]}) but the vector has d={dim}; "
                "allowed: segments that tile exactly [0, d)"
            )

    def hyperparameters(self) -> dict[str, float | int | str | bool]:
        return {
            "eta": self.eta,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "bias_correction": self.bias_correction,
            "layerwise": self.layerwise,
            "num_segments": len(self.segments) if self.segments is not None else 0,
        }

    def _step(
        self, t: int, slots: dict[str, np.ndarray], delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        m, v = slots["m"], slots["v"]
        update_moments(m, v, delta, self.beta1, self.beta2, scratch=out)
        adaptive_step(                                      # r_hat = m_hat / (sqrt(v_hat) + eps)
            m, v, out, eta=1.0, eps=self.eps, t=t,
            beta1=self.beta1, beta2=self.beta2, bias_correction=self.bias_correction,
        )

    def _finish(
        self, state: OptimizerState, delta: np.ndarray, params: np.ndarray | None, out: np.ndarray
    ) -> None:
        assert params is not None  # checked in update()
        r_hat = out
        segments = self.segments if self.layerwise else ((0, delta.shape[0]),)
        for start, stop in segments:
            w, r = params[start:stop], r_hat[start:stop]
            weight_norm = math.sqrt(float(np.dot(w, w)))    # ||x_t||
            update_norm = math.sqrt(float(np.dot(r, r)))    # ||r_hat||
            ratio = weight_norm / update_norm if weight_norm > 0.0 and update_norm > 0.0 else 1.0
            r *= self.eta * ratio                           # step = eta * r * r_hat
