"""A client's work per message outside forward/backward, at ResNet-18 size, vs the floor Flower imposes.

The floor: one ``ArrayRecord(model.state_dict())`` (the reply) plus one ``to_torch_state_dict()``
(reading the global model), which any Flower PyTorch ClientApp pays. pollen's ClientApp is timed on
real train messages (ResNet-18, Fashion-MNIST data, a warm process as in simulation) with the local
SGD replaced by a no-op, so what remains is everything else: config, model, the global model in,
the reply out; dense (full model) and with a scaled-sign upload compressed straight from the flat
update (error feedback kept in client state). Medians of repeats.

Run: ``python benchmarks/bench_client.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, RecordDict  # noqa: E402

from pollen.app.config import AppConfig, defaults_from_pyproject  # noqa: E402
from pollen.app.experiment import build_model  # noqa: E402
from pollen.testing.fakes import train_message  # noqa: E402
from pollen.wire import protocol  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    import pollen.client_app as client_app
    from pollen.clientside.steps import sgd as sgd_step
    from pollen.task.train import TrainResult

    run_config = {
        **defaults_from_pyproject(str(PYPROJECT)),
        "model": "resnet18",
        "local-steps": 1,
        "partitioner": "iid",
    }
    cfg = AppConfig.from_run_config(run_config)
    model = build_model(cfg)
    global_record = ArrayRecord(model.state_dict())

    def floor() -> None:
        ArrayRecord(model.state_dict())
        global_record.to_torch_state_dict()

    sgd_step.run_sgd = lambda work, n, seed=None: TrainResult(0.0, 1, 100, 32)  # no forward/backward
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 10},
        state=RecordDict(),
        run_config=run_config,
    )
    named = {k: v.numpy() for k, v in model.state_dict().items()}
    buffer_keys = "\n".join(k for k in named if k.endswith(("running_mean", "running_var", "num_batches_tracked")))

    def message(codec: str | None):  # noqa: ANN202
        config = {protocol.CFG_SERVER_ROUND: 1, protocol.CFG_BUFFER_KEYS: buffer_keys}
        if codec:
            config.update({protocol.CFG_CODEC: codec, protocol.CFG_ERROR_FEEDBACK: True})
        msg = train_message(named, config)  # built once: the server's work is not timed
        return lambda: client_app.app(msg, context)

    base = median_seconds(floor, args.repeats)
    print(
        f"floor (ArrayRecord(state_dict) + to_torch_state_dict), d = {sum(v.numel() for v in model.parameters()):,}: "
        f"{1e3 * base:.0f} ms"
    )
    for name, codec in (("pollen ClientApp, dense reply", None), ("pollen ClientApp, sign reply", "sign")):
        seconds = median_seconds(message(codec), args.repeats)
        print(f"{name:<32} {1e3 * seconds:>6.0f} ms  = {seconds / base:.2f} x floor")


if __name__ == "__main__":
    main()
