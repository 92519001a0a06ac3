"""What carrying a client's state costs per message when the client moves between Ray nodes (ResNet-18).

In a Flower simulation the engine keeps each node's ``Context`` and passes it, with the message, to
whichever Ray worker runs the node's next message; the worker hands back the updated context. pollen keeps
client state (error-feedback residuals, LAMB moments, lazy references and mirrors) in ``context.state``,
so it travels with the client through Ray's object store: no shared filesystem needed. This measures that,
as the engine does it: a two-node Ray cluster on 127.0.0.1 (:class:`pollen.app.ray_cluster.LocalRayCluster`),
one worker actor pinned to each node, pollen's real ClientApp on a FedCAMS train message (scaled-sign
upload with error feedback: a 44.7 MB float32 residual in state) at ResNet-18 size, local SGD replaced
by a no-op so the transport is what is left. Timed from the driver, per message (medians):

- ``no state``: the same upload without error feedback, so the client keeps nothing (the floor);
- ``state dropped``: error feedback, but every message gets a fresh, empty context (the state is written
  and comes back to the driver, but is not sent out again);
- ``state carried, same node``: the returned context goes with the next message to the same worker;
- ``state carried, other node``: each message goes to the other node's worker, the state with it.

Run: ``python benchmarks/bench_state_across_nodes.py [--repeats 8] [--model resnet18]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from pollen.app.ray_cluster import LocalRayCluster

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class ClientWorker:
    """A Ray actor running pollen's ClientApp, as a simulation worker does (no-op local SGD)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        import pollen.client_app as client_app
        from pollen.clientside.steps import sgd as sgd_step
        from pollen.task.train import TrainResult

        sgd_step.run_sgd = lambda work, n, seed=None: TrainResult(0.0, 1, 100, 32)
        self.app = client_app.app

    def run(self, message, context):  # noqa: ANN001, ANN201
        started = time.perf_counter()
        reply = self.app(message, context)
        return reply, context, time.perf_counter() - started


def build_inputs(model_name: str):  # noqa: ANN201
    from flwr.app import Context, RecordDict

    from pollen.app.config import AppConfig, defaults_from_pyproject
    from pollen.app.experiment import build_model
    from pollen.testing.fakes import train_message
    from pollen.wire import protocol

    run_config = {
        **defaults_from_pyproject(str(PYPROJECT)),
        "model": model_name,
        "local-steps": 1,
        "partitioner": "iid",
    }
    model = build_model(AppConfig.from_run_config(run_config))
    named = {k: v.numpy() for k, v in model.state_dict().items()}
    buffers = "\n".join(k for k in named if k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    dim = sum(p.numel() for p in model.parameters())

    def message(server_round: int, feedback: bool = True):  # noqa: ANN202
        config = {
            protocol.CFG_SERVER_ROUND: server_round,
            protocol.CFG_BUFFER_KEYS: buffers,
            protocol.CFG_CODEC: "sign",
            protocol.CFG_ERROR_FEEDBACK: feedback,
        }
        return train_message(named, config)

    def context():  # noqa: ANN202
        return Context(
            run_id=1,
            node_id=7,
            node_config={"partition-id": 0, "num-partitions": 10},
            state=RecordDict(),
            run_config=run_config,
        )

    return message, context, dim


def state_bytes(context) -> int:  # noqa: ANN001
    return sum(record.count_bytes() for record in context.state.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    with LocalRayCluster(nodes=2, cpus_per_node=1) as cluster:
        os.environ.update(cluster.env)
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray.init(address=cluster.address, logging_level="ERROR")
        nodes = cluster.alive_nodes()
        remote = ray.remote(num_cpus=1)(ClientWorker)
        workers = [
            remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in nodes
        ]
        message, fresh_context, dim = build_inputs(args.model)
        print(f"model {args.model}: d = {dim:,} trainable values; two Ray nodes on 127.0.0.1, one worker each")

        scenarios = {  # name: (which worker runs round r, whether the returned context goes on, error feedback)
            "no state": (lambda r: workers[0], True, False),
            "state dropped": (lambda r: workers[0], False, True),
            "state carried, same node": (lambda r: workers[0], True, True),
            "state carried, other node": (lambda r: workers[r % 2], True, True),
        }
        contexts = {name: fresh_context() for name in scenarios}
        samples = {name: ([], [], 0) for name in scenarios}
        for server_round in range(1, args.repeats + 2):  # interleaved, so drift in the machine's load hits all
            msgs = {feedback: message(server_round, feedback) for feedback in (True, False)}
            for name, (pick_worker, carry, feedback) in scenarios.items():
                started = time.perf_counter()
                remote_call = pick_worker(server_round).run.remote(msgs[feedback], contexts[name])
                reply, returned, seconds = ray.get(remote_call)
                elapsed = time.perf_counter() - started
                assert not reply.has_error(), reply.error
                driver, inside, carried = samples[name]
                if server_round > 1:  # round 1 warms every worker up
                    driver.append(elapsed)
                    inside.append(seconds)
                samples[name] = (driver, inside, max(carried, state_bytes(returned)))
                contexts[name] = returned if carry else fresh_context()
        rows = {
            name: (statistics.median(driver), statistics.median(inside), carried)
            for name, (driver, inside, carried) in samples.items()
        }
        base = rows["no state"][0]
        print("| per message | round trip (driver) | inside the worker | state in the context | vs no state |")
        print("|---|---|---|---|---|")
        for name, (driver, inside, carried) in rows.items():
            print(
                f"| {name} | {1e3 * driver:.0f} ms | {1e3 * inside:.0f} ms | {carried / 1e6:.1f} MB | "
                f"{driver / base:.2f}x (+{1e3 * (driver - base):.0f} ms) |"
            )
        ray.shutdown()


if __name__ == "__main__":
    main()
