"""The cryptography secure aggregation needs, from the ``cryptography`` package and Flower's Shamir sharing.

Nothing here is a primitive of pollen's own:

- key agreement: X25519 key pairs; a shared secret is HKDF-SHA256 of the X25519 output, bound to what it is
  for (``purpose``), 32 bytes;
- authenticated encryption of the secret shares one client sends another through the server: AES-256-GCM
  with a random 96-bit nonce, the sender, the receiver and the round as associated data (the server can
  neither read a share nor move it to another pair or round unnoticed);
- masks: AES-256-CTR keystream under HKDF-SHA256 of the seed, read as little-endian lanes of the codec's
  width, so a mask is uniform modulo ``2**W`` (Flower's own mask generator folds every seed to 32 bits and
  expands it with NumPy's Mersenne Twister: not a cryptographic stream, per the spec);
- t-out-of-n secret sharing: pycryptodome's Shamir over GF(2^128) (what Flower's SecAgg+ uses), per 16-byte
  block of the padded secret; a share is its 4-byte index and one 16-byte share per block, as Flower frames it;
- commitments: SHA-256, so the server can check a reconstructed seed against what its owner committed to.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from Crypto.Util.Padding import pad, unpad
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
SEED_BYTES = 32
NONCE_BYTES = 12


class SecAggError(ValueError):
    """A secure-aggregation message that breaks the protocol (malformed, forged, inconsistent)."""


def new_key_pair() -> tuple[bytes, bytes]:
    """``(private, public)`` X25519 keys, 32 raw bytes each."""
    private = X25519PrivateKey.generate()
    raw = serialization.Encoding.Raw
    public = private.public_key().public_bytes(raw, serialization.PublicFormat.Raw)
    return private.private_bytes(raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()), public


def public_of(private: bytes) -> bytes:
    """The public key of a raw X25519 private key."""
    key = X25519PrivateKey.from_private_bytes(private)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _hkdf(material: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose).derive(material)


def agree(private: bytes, peer_public: bytes, purpose: bytes) -> bytes:
    """The 32-byte secret two parties share (X25519, then HKDF-SHA256 bound to ``purpose``)."""
    if len(peer_public) != KEY_BYTES:
        raise SecAggError(f"a public key has {len(peer_public)} bytes; allowed: {KEY_BYTES}")
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:  # the all-zero output of a small-order point
        raise SecAggError(f"key agreement failed: {err}") from None
    return _hkdf(shared, purpose)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """AES-256-GCM: ``nonce || ciphertext || tag``."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of :func:`seal`'s output; :class:`SecAggError` if it was altered or is not for ``associated``."""
    if len(sealed) < NONCE_BYTES + 16:
        raise SecAggError(f"a sealed share has {len(sealed)} bytes; too short to be one")
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise SecAggError("a sealed share failed authentication (altered, or not for this pair and round)") from None


def mask(seed: bytes, size: int, dtype: np.dtype) -> np.ndarray:
    """``size`` lanes of ``dtype`` (unsigned, little-endian), uniform, from an AES-256-CTR stream keyed by ``seed``."""
    dtype = np.dtype(dtype)
    key = _hkdf(seed, b"pollen-secagg-mask")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(b"\0" * 16)).encryptor()
    stream = encryptor.update(b"\0" * (size * dtype.itemsize)) + encryptor.finalize()
    return np.frombuffer(stream, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)


def new_seed() -> bytes:
    """A fresh 32-byte secret seed (a client's self mask)."""
    return os.urandom(SEED_BYTES)


def commit(secret: bytes) -> bytes:
    """SHA-256 of ``secret``: what a client publishes so a reconstructed secret can be checked."""
    return hashlib.sha256(secret).digest()


def share(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` Shamir shares of ``secret``, any ``threshold`` of which give it back."""
    if not (2 <= threshold <= count <= 255):
        raise ValueError(f"threshold={threshold} of {count} shares; allowed: 2 <= threshold <= shares <= 255")
    padded = pad(secret, 16)
    shares = [bytearray(index.to_bytes(4, "little")) for index in range(1, count + 1)]
    for start in range(0, len(padded), 16):
        for index, block in Shamir.split(threshold, count, padded[start : start + 16], ssss=False):
            shares[index - 1] += block
    return [bytes(one) for one in shares]


def combine(shares: list[bytes]) -> bytes:
    """The secret behind ``shares`` (at least the threshold of them); :class:`SecAggError` if they do not fit."""
    sizes = {len(one) for one in shares}
    if not shares or len(sizes) != 1 or (sizes.pop() - 4) % 16 or len(shares[0]) < 20:
        raise SecAggError("shares of different or impossible lengths")
    indices = [int.from_bytes(one[:4], "little") for one in shares]
    if len(set(indices)) != len(indices) or not all(1 <= i <= 255 for i in indices):
        raise SecAggError("share indices repeat or are out of range")
    padded = b"".join(
        Shamir.combine([(i, one[start : start + 16]) for i, one in zip(indices, shares)], ssss=False)
        for start in range(4, len(shares[0]), 16)
    )
    try:
        return unpad(padded, 16)
    except ValueError as err:
        raise SecAggError(f"shares do not combine: {err}") from None


__all__ = [
    "KEY_BYTES",
    "SEED_BYTES",
    "SecAggError",
    "agree",
    "combine",
    "commit",
    "mask",
    "new_key_pair",
    "new_seed",
    "public_of",
    "seal",
    "share",
    "unseal",
]
