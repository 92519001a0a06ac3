"""Encode/decode throughput of the codecs on a ResNet-18-sized vector, relative to a plain copy.

d = 11,173,962 float32 (ResNet-18 with BN affine weights, fedcams Table 2). For each codec the median time
of several repeats is reported in ms, GB/s of float32 input/output, and as a multiple of ``np.copyto`` of
the same vector (a memory-bandwidth yardstick: 1.0x would be as fast as copying the update once).

Run: ``python benchmarks/bench_codecs.py [--repeats N] [--dim D]`` (well under a minute).
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from pollen.compression import make_codec


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=11_173_962)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    d, repeats = args.dim, args.repeats

    x = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    dst = np.empty_like(x)
    copy_s = median_seconds(lambda: np.copyto(dst, x), repeats)
    gb = x.nbytes / 1e9

    print(f"bench_codecs: d = {d:,} float32 ({x.nbytes / 2**20:.1f} MiB), median of {repeats} repeats")
    print(
        f"numpy {np.__version__}, {platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    )
    print(f"{'np.copyto (baseline)':<28} {copy_s * 1e3:8.2f} ms  {gb / copy_s:6.2f} GB/s    1.00x copy")

    for name, kwargs in (("sign", {}), ("topk", {"topk_ratio": 1 / 64}), ("fp16", {})):
        codec = make_codec(name, **kwargs)
        label = name if name != "topk" else "topk 1/64"
        payload = codec.encode(x)
        assert payload.nbytes == codec.payload_bytes(d)
        enc_s = median_seconds(lambda codec=codec: codec.encode(x), repeats)
        dec_s = median_seconds(lambda codec=codec, payload=payload: codec.decode(payload, d), repeats)
        print(
            f"{label + ' encode':<28} {enc_s * 1e3:8.2f} ms  {gb / enc_s:6.2f} GB/s  {enc_s / copy_s:6.2f}x copy"
            f"   payload {payload.nbytes:,} B ({x.nbytes / payload.nbytes:.1f}x smaller)"
        )
        print(f"{label + ' decode':<28} {dec_s * 1e3:8.2f} ms  {gb / dec_s:6.2f} GB/s  {dec_s / copy_s:6.2f}x copy")


if __name__ == "__main__":
    main()
