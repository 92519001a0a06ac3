"""Client-side differential privacy, the Flower-free part (issue 39; privacy spec §4, §6): joint L2 clipping,
Gaussian noise and its generator, and error feedback that privatises ``p = Delta + e`` before the codec.

What is sent is what matters: the decoded upload's norm is <= C for every codec, with and without error feedback,
over rounds with a residual; the residual is measured from the privatised vector; local noise has std z*C.
The Flower glue (config entries, ``compress_update``, ``compression_mod``, the node's floor) is tested in
``tests/flower/test_privacy_client_mod.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pollen.compression import ErrorFeedback, compress_with_feedback, make_codec
from pollen.privacy.mechanisms import clip_l2, gaussian_noise, l2_norm, noise_generator, privatize

CODECS = ("sign", "topk", "fp16", "none")
C = 0.75
BOUND = C * (1 + 1e-6)


def deltas(rounds: int, dim: int, seed: int) -> list[np.ndarray]:
    """Updates far above C, near it and far below it, so that some rounds are clipped and some carry a residual."""
    rng = np.random.default_rng(seed)
    scales = [3.0, 0.02, 1.0, 0.001, 10.0, 0.05][:rounds]
    return [(rng.standard_normal(dim) * s / np.sqrt(dim) * 4).astype(np.float32) for s in scales]


# ------------------------------------------------------------------------------------------------ mechanisms
def test_clip_l2_scales_jointly_to_at_most_the_clip_and_returns_the_original_norm():
    rng = np.random.default_rng(0)
    v = rng.standard_normal(10_001).astype(np.float32) * 3
    clipped, norm = clip_l2(v, 2.0)
    assert norm == pytest.approx(float(np.linalg.norm(v.astype(np.float64))), rel=1e-12)
    assert clipped is not v and clipped.dtype == np.float32
    assert 2.0 * (1 - 1e-6) < l2_norm(clipped) <= 2.0  # clipped to C, never above it
    np.testing.assert_allclose(clipped, v * (2.0 / norm), rtol=1e-6)
    small, small_norm = clip_l2(v, 1e6)
    assert small is v and small_norm == norm  # under the clip: the vector itself, no copy
    as_f32, _ = clip_l2(v.astype(np.float64), 1e6)
    assert as_f32.dtype == np.float32
    # many clips of vectors of every size: the exact float64 norm of the float32 result is <= C
    for d in (1, 7, 1000, 65_537):
        for c in (1e-3, 0.3, 1.0, 7.0):
            x = (rng.standard_normal(d) * 5).astype(np.float32)
            assert l2_norm(clip_l2(x, c)[0]) <= c


@pytest.mark.parametrize("clip", [0, 0.0, -1.0, float("nan"), float("inf"), True, "1.0", None])
def test_clip_l2_refuses_a_clip_that_is_not_a_finite_positive_number(clip):
    with pytest.raises(ValueError, match="the DP clip norm must be a finite number > 0"):
        clip_l2(np.ones(3, dtype=np.float32), clip)


def test_clip_l2_names_a_non_finite_update():
    v = np.ones(10, dtype=np.float32)
    v[[2, 5]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match="cannot clip the update: it has 2 NaN/Inf entries of 10"):
        clip_l2(v, 1.0)


def test_noise_generator_is_reproducible_with_a_seed_and_fresh_without():
    a = noise_generator(7, 1, 2, 3).standard_normal(8)
    np.testing.assert_array_equal(a, noise_generator(7, 1, 2, 3).standard_normal(8))
    for other in (noise_generator(8, 1, 2, 3), noise_generator(7, 1, 3, 3), noise_generator(7, 2, 2, 3)):
        assert not np.array_equal(a, other.standard_normal(8))
    assert isinstance(noise_generator(None).bit_generator, np.random.Philox)
    assert not np.array_equal(noise_generator(None).standard_normal(8), noise_generator(None).standard_normal(8))
    with pytest.raises(ValueError, match="integers >= 0"):
        noise_generator(-1)
    with pytest.raises(ValueError, match="integers >= 0"):
        noise_generator(1, 2.5)  # type: ignore[arg-type]


def test_gaussian_noise_and_privatize_modes():
    rng = noise_generator(0)
    n = gaussian_noise(5, 0.0, rng)
    assert n.dtype == np.float32 and not n.any()
    p = np.full(4, 10.0, dtype=np.float32)  # norm 20
    central = privatize(p, "central", 2.0)
    assert l2_norm(central) <= 2.0 and np.allclose(central, 1.0)
    local = privatize(p, "local", 2.0, 1.5, noise_generator(3))
    expected = central + gaussian_noise(4, 3.0, noise_generator(3))
    np.testing.assert_array_equal(local, expected)
    np.testing.assert_array_equal(p, 10.0)  # the input is left alone
    with pytest.raises(ValueError, match="unknown DP mode 'global'"):
        privatize(p, "global", 1.0)
    with pytest.raises(ValueError, match="noise multiplier must be a finite number > 0"):
        privatize(p, "local", 1.0, 0.0, noise_generator(0))
    with pytest.raises(ValueError, match="needs a noise generator"):
        privatize(p, "local", 1.0, 1.0, None)


# --------------------------------------------------------------------------------- error feedback + privatize
def _compress_with_feedback_before_issue_39(codec, delta, feedback):  # noqa: ANN001, ANN202
    """compress_with_feedback as it was before the privatize step (the reference for bit-identity)."""
    d = np.asarray(delta)
    if not feedback.enabled:
        return codec.encode(d), feedback
    e = feedback.residual
    p = d.astype(np.float32) if e is None else np.add(d, np.asarray(e), dtype=np.float32, casting="unsafe")
    payload = codec.encode(p)
    p -= codec.decode(payload, p.size)
    return payload, ErrorFeedback(residual=p, enabled=True)


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("enabled", [True, False])
def test_without_privatize_compress_with_feedback_is_bit_identical_to_before(codec_name, enabled):
    codec = make_codec(codec_name, topk_ratio=0.1)
    new, old = ErrorFeedback(enabled=enabled), ErrorFeedback(enabled=enabled)
    for delta in deltas(6, 301, seed=1):
        payload, new = compress_with_feedback(codec, delta, new)
        reference, old = _compress_with_feedback_before_issue_39(codec, delta, old)
        assert payload.codec == reference.codec and payload.arrays.keys() == reference.arrays.keys()
        for name, value in payload.arrays.items():
            np.testing.assert_array_equal(value, reference.arrays[name])
            assert value.dtype == reference.arrays[name].dtype
        if enabled:
            np.testing.assert_array_equal(new.residual, old.residual)
        else:
            assert new.residual is None and old.residual is None


def test_privatize_sees_delta_plus_residual_and_leaves_the_callers_arrays_alone():
    codec = make_codec("sign")
    delta = np.linspace(-3, 3, 50, dtype=np.float32)
    residual = np.linspace(1, -1, 50, dtype=np.float32)
    seen = []

    def step(p):  # noqa: ANN001, ANN202
        seen.append(p.copy())
        return privatize(p, "central", 0.5)

    payload, fb = compress_with_feedback(codec, delta, ErrorFeedback(residual=residual.copy()), privatize=step)
    np.testing.assert_array_equal(seen[0], np.add(delta, residual, dtype=np.float32))
    np.testing.assert_array_equal(delta, np.linspace(-3, 3, 50, dtype=np.float32))
    np.testing.assert_array_equal(residual, np.linspace(1, -1, 50, dtype=np.float32))
    np.testing.assert_array_equal(fb.residual, privatize(seen[0], "central", 0.5) - codec.decode(payload, 50))
    # a privatize step that hands back the caller's own array: the residual is computed in a copy
    payload, fb = compress_with_feedback(codec, delta, ErrorFeedback(), privatize=lambda p: delta)
    np.testing.assert_array_equal(delta, np.linspace(-3, 3, 50, dtype=np.float32))
    with pytest.raises(ValueError, match="privatize returned an array of shape"):
        compress_with_feedback(codec, delta, ErrorFeedback(), privatize=lambda p: p[:3])


# ------------------------------------------------------------------------------- what is sent, at the codec level
@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("enabled", [True, False])
def test_privatised_before_the_codec_what_is_sent_stays_within_the_clip_over_rounds(codec_name, enabled):
    """Scaled sign, top-k and float16 do not increase the norm (float16 up to its rounding: clipped to
    C * (1 - 2**-10), as compress_update does); the residual is privatize(p) - decode(msg)."""
    codec = make_codec(codec_name, topk_ratio=0.1)
    clip = C * (1 - 2**-10) if codec_name == "fp16" else C
    feedback = ErrorFeedback(enabled=enabled)
    norms = []
    for delta in deltas(6, 1009, seed=3):
        p = delta if feedback.residual is None else np.add(delta, feedback.residual, dtype=np.float32)
        payload, feedback = compress_with_feedback(
            codec, delta, feedback, privatize=lambda v: privatize(v, "central", clip)
        )
        sent = codec.decode(payload, delta.size)
        norms.append(l2_norm(sent))
        assert norms[-1] <= BOUND
        if enabled:
            np.testing.assert_array_equal(feedback.residual, privatize(p, "central", clip) - sent)
        else:
            assert feedback.residual is None
    assert max(norms) > 0.5 * C


def test_local_noise_std_is_z_times_c_over_a_million_coordinates():
    d, z = 1_000_000, 1.3
    delta = (np.random.default_rng(6).standard_normal(d) * 0.01).astype(np.float32)  # norm 10 > C
    codec = make_codec("none")
    payload, _ = compress_with_feedback(
        codec, delta, ErrorFeedback(enabled=False), privatize=lambda v: privatize(v, "local", C, z, noise_generator(5))
    )
    noise = codec.decode(payload, d).astype(np.float64) - clip_l2(delta, C)[0]
    assert abs(noise.std() / (z * C) - 1) < 0.005
    assert abs(noise.mean()) < 5 * z * C / np.sqrt(d)
