"""The round's fast paths give the same bits as before they were made fast (issue 23).

Three rounds of FedAdaVR with an Int4 and an Int8 table (example-weighted, so the table's running sum
takes weights other than 1), FedCAMS on scaled-sign and top-k replies and FedAMS on dense replies,
through the Message API. After every round the model parameters, the buffers, the optimiser state
and the table (rows, scales, weights, running sum) are hashed; the digests were recorded from the code
before the block-wise read path, the fused int4 decode / accumulate and the 256-entry nibble tables.
Every value that reaches the model is an element-wise float32 (or float64) operation, so the bits do
not depend on the CPU's SIMD width.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from pollen.clientside import compression_mod
from pollen.strategies import FedAdaVR, FedAMS, FedCAMS
from pollen.testing.fakes import FakeGrid, full_model_reply, global_arrays_of, model_record

pytestmark = pytest.mark.flower_compat

NODES = [1, 2, 3, 4, 5]
# odd lengths, a tensor longer than two 65,536-element blocks, a 1-element tensor, buffers
SHAPES = {
    "conv.weight": (3, 5),
    "fc.weight": (131075,),
    "fc.bias": (1,),
    "head.weight": (70001,),
    "bn.running_mean": (4,),
    "bn.num_batches_tracked": (),
}


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in SHAPES.items():
        if name.endswith("num_batches_tracked"):
            arrays[name] = np.array(3, dtype=np.int64)
        else:
            arrays[name] = rng.standard_normal(shape).astype(np.float32)
    return arrays


def client(codec: str | None, server_round: list[int]):  # noqa: ANN201
    def reply(msg):  # noqa: ANN001, ANN202
        node = msg.metadata.dst_node_id
        rng = np.random.default_rng(1000 * node + server_round[0])
        local = {}
        for name, value in global_arrays_of(msg).items():
            if value.dtype.kind == "f" and not name.startswith("bn."):
                move = rng.standard_normal(value.shape).astype(np.float32) * np.float32(1e-2 * node)
                if name == "head.weight":  # one float64 tensor: the reader casts it to float32 first
                    local[name] = value.astype(np.float64) + move.astype(np.float64) / 3
                else:
                    local[name] = value + move
            else:
                local[name] = value
        weight = 7 + 3 * node
        if codec is None:
            return full_model_reply(msg, local, num_examples=weight)
        context = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        return compression_mod(msg, context, lambda m, c: full_model_reply(m, local, num_examples=weight))

    return reply


def fingerprint(strategy) -> str:  # noqa: ANN001
    digest = hashlib.sha256()

    def put(array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        digest.update(str(array.dtype).encode() + str(array.shape).encode())
        digest.update(array.tobytes())

    put(strategy.params)
    for name in sorted(strategy.buffers):
        put(np.asarray(strategy.buffers[name]))
    state = strategy.opt_state
    digest.update(str(state.step).encode())
    for name in sorted(state.slots):
        put(state.slots[name])
    table = getattr(strategy, "table", None)
    if table is not None:
        table_state = table.state_dict()
        for name in ("keys", "weights", "absmax", "running_sum", "data"):
            put(table_state[name])
    return digest.hexdigest()[:16]


def run(make, codec: str | None, rounds: int = 3) -> list[str]:  # noqa: ANN001
    server_round = [0]
    grid = FakeGrid(NODES, client(codec, server_round), keep_history=False)
    strategy = make(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=len(NODES))
    record = model_record(model())
    prints = []
    for r in range(1, rounds + 1):
        server_round[0] = r
        messages = list(strategy.configure_train(r, record, ConfigRecord(), grid))
        new, _ = strategy.aggregate_train(r, list(grid.send_and_receive(messages)))
        assert new is not None
        record = new
        prints.append(fingerprint(strategy))
    return prints


#: FedAdaVR's Adam as the paper (and these recorded bits) have it; the constructor's defaults are the drop-in's.
PAPER_ADAM = {"beta_2": 0.999, "eps": 1e-8, "bias_correction": True}
#: FedCAMS's server moments as FedAMS has them (and these recorded bits); its constructor's are the drop-in's.
FEDAMS_MOMENTS = {"beta_1": 0.9, "bias_correction": False}

CASES = {
    "fedadavr-int4": (lambda **kw: FedAdaVR(table_precision="int4", eta=0.01, **PAPER_ADAM, **kw), None),
    "fedadavr-int8": (lambda **kw: FedAdaVR(table_precision="int8", eta=0.01, **PAPER_ADAM, **kw), None),
    "fedadavr-fp16": (lambda **kw: FedAdaVR(table_precision="fp16", eta=0.01, **PAPER_ADAM, **kw), None),
    "fedadavr-fp32": (lambda **kw: FedAdaVR(table_precision="fp32", eta=0.01, **PAPER_ADAM, **kw), None),
    "fedams-dense": (lambda **kw: FedAMS(eta=0.1, **kw), None),
    "fedams-dense-weighted": (lambda **kw: FedAMS(eta=0.1, aggregation="weighted", **kw), None),
    "fedcams-sign": (
        lambda **kw: FedCAMS(compressor="sign", eta=0.1, granularity="model", **FEDAMS_MOMENTS, **kw),
        "sign",
    ),
    "fedcams-topk": (lambda **kw: FedCAMS(compressor="topk", eta=0.1, **FEDAMS_MOMENTS, **kw), "topk"),
}

EXPECTED: dict[str, list[str]] = {  # recorded from the code before issue 23's changes
    "fedadavr-fp16": ["ea467c32be38b819", "31e7ebffd2e0419b", "0f0c1eef035d3c4a"],
    "fedadavr-fp32": ["d5c601bfd6422910", "acae0f18e79318ac", "26b2bbd4907549b8"],
    "fedadavr-int4": ["0503ba718231217f", "1b515685d177b11c", "9d59c2b4bd597fea"],
    "fedadavr-int8": ["f6f2a8acfd320653", "024f776d91875489", "16f3bb672e186f1d"],
    "fedams-dense": ["bd334c7ce57a70b0", "70a2ff91fe9c38c3", "512a09bfbe86d333"],
    "fedams-dense-weighted": ["acce9af52491832e", "ea782979322abeef", "e370bf08af3a4de7"],
    "fedcams-sign": ["7910775d473e8ce0", "606390e1344eef01", "60d419916687eccc"],
    "fedcams-topk": ["2002ca1aaae9385d", "aa5428db4a7ab6ea", "2f8596a88080f9ac"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_three_rounds_give_the_recorded_bits(case: str):
    make, codec = CASES[case]
    assert run(make, codec) == EXPECTED[case]


if __name__ == "__main__":  # prints the digests (run on the reference code to record them)
    for case in sorted(CASES):
        print(f"    {case!r}: {run(*CASES[case])},")
