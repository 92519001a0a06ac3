"""Real ``flwr run .`` simulations (Ray) on tiny configs: the app finishes and writes its results.

One private local SuperLink serves all runs of this module, its simulations on one warm Ray head (as
``pollen-sweep --warm`` runs them): a Ray start per run cost about 20 s on a 2-core machine, and under load
Ray's own 30 s start-up wait is what failed ("The current node timed out during startup"). Both are stopped
at the end.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from pollen.testing.flwr_cli import LocalFlower

pytestmark = pytest.mark.slow

TINY = {
    "num-server-rounds": 2,
    "local-steps": 5,
    "batch-size": 32,
    "model": "cnn",
    "partitioner": "iid",
    "fraction-train": 0.5,
    "fraction-evaluate": 0.25,
    "min-evaluate-nodes": 1,
    "eval-batch-size": 1000,
    "test-examples": 1000,  # of 10,000: the CNN's evaluation would cost more than its 5 steps
    "plots": False,  # the FedAMS run below draws them and checks them
}


# Session scope: one SuperLink per xdist worker for this module's runs; a module-scoped fixture is rebuilt each
# time the worker comes back to this module after another module's test.
@pytest.fixture(scope="session")
def flower(tmp_path_factory: pytest.TempPathFactory):
    with LocalFlower.warm(tmp_path_factory.mktemp("flwr-home")) as local:
        yield local


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


def _run(  # noqa: PLR0913 - the run's settings, passed through
    flower: LocalFlower,
    results_dir: Path,
    name: str,
    num_supernodes: int = 4,
    variant: str = "product",
    client_cpus: float | None = None,
    **config,
) -> dict:
    proc = flower.run(
        {**TINY, **config, "results-dir": str(results_dir), "run-name": name},
        num_supernodes=num_supernodes,
        variant=variant,
        client_cpus=client_cpus,
    )
    out_dir = Path(config["resume"]) if config.get("resume") else results_dir / name
    assert proc.returncode == 0 and (out_dir / "final_model.npz").is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out_dir / "metrics.json").read_text())


@pytest.fixture(scope="session")
def fedams_metrics(flower: LocalFlower, results_dir: Path) -> dict:
    """One FedAMS run for the module: its files are checked once, its uplink is the dense reference."""
    return _run(flower, results_dir, "fedams", strategy="fedams", tracker="tensorboard", plots=True)


@pytest.mark.app_compat  # CI runs it on the newest supported Flower too
@pytest.mark.xdist_group("flwr-run-fedams")  # both users of the one FedAMS run on one worker
def test_fedams_run_writes_every_results_file(results_dir: Path, fedams_metrics: dict) -> None:
    """The ServerApp in Flower's simulation also writes TensorBoard event files as it goes (``tracker``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = fedams_metrics
    out_dir = results_dir / "fedams"
    for name in (
        "config.json",
        "metrics.csv",
        "metrics.json",
        "final_model.npz",
        "accuracy_vs_round.png",
        "accuracy_vs_uplink.png",
    ):
        assert (out_dir / name).stat().st_size > 0, name
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    assert [int(r["round"]) for r in rows] == [0, 1, 2]
    last = metrics["rows"][-1]
    assert last["replies"] == 2 and last["failures"] == 0
    assert last["uplink_bytes"] > 2 * 4 * 29_034  # two full CNN models came back
    assert float(rows[-1]["accuracy"]) > float(rows[0]["accuracy"])
    assert json.loads((out_dir / "config.json").read_text())["strategy"] == "fedams"
    events = EventAccumulator(str(results_dir / "tensorboard" / "fedams"))
    events.Reload()
    for column in ("accuracy", "uplink_bytes", "round_seconds"):
        logged = [(e.step, e.value) for e in events.Scalars(column)]
        rows = [r for r in metrics["rows"] if isinstance(r[column], (int, float))]
        assert logged == [(r["round"], float(np.float32(r[column]))) for r in rows] and len(rows) >= 2, column


@pytest.mark.xdist_group("flwr-run-fedams")
def test_fedcams_sign_uploads_about_one_32nd_of_fedams(
    flower: LocalFlower, results_dir: Path, fedams_metrics: dict
) -> None:
    dense = fedams_metrics["rows"][-1]
    sign = _run(flower, results_dir, "sign", strategy="fedcams", compressor="sign")["rows"][-1]
    ratio = dense["uplink_update_bytes"] / sign["uplink_update_bytes"]
    print(
        f"update bytes per round: fedams {dense['uplink_update_bytes']}, fedcams-sign {sign['uplink_update_bytes']}, "
        f"ratio {ratio:.1f}"
    )
    assert 28 < ratio < 33
    assert sign["compression_ratio"] > 28


def test_compositions_no_paper_ran_run_end_to_end(flower: LocalFlower, results_dir: Path, tmp_path: Path) -> None:
    """AdaBelief with scaled-sign uploads (strategy=fedopt) and FedAdaVR with error-fed top-k uploads: no class
    of their own, chosen from the run-config, compressed on the wire and learning. The first through ``flwr
    run``, the second through the in-process runner (the same ServerApp and ClientApp, without the start-up)."""
    from pollen.testing.inprocess import run_inprocess

    belief = _run(
        flower,
        results_dir,
        "adabelief-sign",
        strategy="fedopt",
        **{"server-optimizer": "adabelief", "compressor": "sign"},
    )
    vr_config = {"compressor": "topk", "topk-ratio": 0.015625, "error-feedback": True, "server-lr": 0.01}
    vr_rows = run_inprocess(
        {**TINY, **vr_config, "strategy": "fedadavr", "results-dir": str(tmp_path), "run-name": "fedadavr-topk"}, 4
    )
    vr = {"rows": vr_rows}
    for metrics, least in ((belief, 28), (vr, 10)):  # 1 bit a value; top-k 1/64 sends values and indices
        last = metrics["rows"][-1]
        assert last["replies"] == 2 and last["failures"] == 0
        assert last["compression_ratio"] > least
        assert np.isfinite(last["loss"]) and last["accuracy"] > metrics["rows"][0]["accuracy"]
    config = json.loads((results_dir / "adabelief-sign" / "config.json").read_text())
    assert (config["strategy"], config["server-optimizer"], config["compressor"]) == ("fedopt", "adabelief", "sign")


def test_fedadavr_int4_with_partial_participation(flower: LocalFlower, results_dir: Path) -> None:
    metrics = _run(
        flower,
        results_dir,
        "vr",
        strategy="fedadavr",
        **{"table-precision": "int4", "server-lr": 0.01, "fraction-train": 0.34},
    )
    rows = metrics["rows"]
    assert rows[-1]["sampled"] == 2 and rows[-1]["replies"] == 2
    assert rows[-1]["server_state_bytes"] > 0
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]


def test_relay_demo_runs_its_mid_round_exchange(flower: LocalFlower, results_dir: Path) -> None:
    """The round-protocol example through a real simulation (the test harness's apps):
    a relay phase, an extra uplink record."""
    metrics = _run(
        flower,
        results_dir,
        "relay",
        variant="testing",
        strategy="relay-demo",
        **{"local-steps": 4, "fraction-train": 0.75},
    )
    last = metrics["rows"][-1]
    assert last["replies"] == 3 and last["failures"] == 0
    assert last["exchange_messages"] == 3 and last["messages_sent"] == 6
    assert last["downlink_by_record"]["relay-mix/pollen.x.relay"] >= 3 * 4 * 29_034
    assert last["uplink_by_record"]["relay-mix/pollen.x.layer-sq-norms"] > 0
    assert metrics["rows"][-1]["accuracy"] > metrics["rows"][0]["accuracy"]


def _same_models(first: Path, second: Path) -> None:
    want, got = np.load(first / "final_model.npz"), np.load(second / "final_model.npz")
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert want[name].tobytes() == got[name].tobytes(), name


def test_parallel_workers_end_bit_identical_to_one_client_at_a_time(
    flower: LocalFlower, results_dir: Path, tmp_path: Path
) -> None:
    """Two clients train at once (one CPU each) and finish in whatever order: the run is bit-identical to
    pollen's in-process runner training one client at a time with one thread (so any two such runs are too)."""
    from pollen.testing.inprocess import run_inprocess

    config = {"strategy": "fedcams", "compressor": "sign", "num-server-rounds": 2, "fraction-train": 1.0}
    _run(flower, results_dir, "parallel-a", client_cpus=1, **config)
    run_inprocess({**TINY, **config, "results-dir": str(tmp_path), "run-name": "sequential"}, 4, threads=1)
    _same_models(results_dir / "parallel-a", tmp_path / "sequential")


def test_async_fedcams_through_flwr_run_is_bit_identical_to_the_in_process_run(
    flower: LocalFlower, results_dir: Path, tmp_path: Path
) -> None:
    """``driver=async`` in a real simulation (issue 38): two clients train at once on Ray workers and finish in
    whatever real order, the virtual clock decides the order replies are handled in, and the run is
    bit-identical to the in-process runner's (a fake grid, clients one at a time) with the same settings."""
    from pollen.testing.inprocess import run_inprocess

    config = {
        "strategy": "fedcams",
        "compressor": "sign",
        "num-server-rounds": 4,
        "driver": "async",
        "concurrency": 3,
        "buffer-size": 2,
        "client-speed": "stragglers:0.3:3:5",
    }
    run = _run(flower, results_dir, "async-sim", client_cpus=1, **config)
    assert [row["round"] for row in run["rows"]] == [0, 1, 2, 3, 4]
    assert all(row["replies"] == 2 for row in run["rows"][1:])
    run_inprocess({**TINY, **config, "results-dir": str(tmp_path), "run-name": "async-inprocess"}, 4, threads=1)
    _same_models(results_dir / "async-sim", tmp_path / "async-inprocess")


def test_central_dp_through_flwr_run_is_bit_identical_to_the_in_process_run(
    flower: LocalFlower, results_dir: Path, tmp_path: Path
) -> None:
    """``dp=central`` in a real simulation (issue 39): FedCAMS (each client clips ``Delta + e`` before its sign), the
    server clips, noises (seeded for the comparison) and steps; epsilon is in every row, and the run is
    bit-identical to the in-process runner's with the same settings."""
    pytest.importorskip("dp_accounting")
    from pollen.testing.inprocess import run_inprocess

    config = {
        "strategy": "fedcams",
        "compressor": "sign",
        "model": "mlp",
        "num-server-rounds": 2,
        "dp": "central",
        "dp-clip": 0.5,
        "dp-noise-multiplier": 1.0,
        "dp-noise-seed": 3,
    }
    run = _run(flower, results_dir, "dp-sim", client_cpus=1, **config)
    epsilons = [row["method.dp_epsilon"] for row in run["rows"][1:]]
    assert len(epsilons) == 2 and 0 < epsilons[0] < epsilons[1]
    run_inprocess({**TINY, **config, "results-dir": str(tmp_path), "run-name": "dp-inprocess"}, 4, threads=1)
    _same_models(results_dir / "dp-sim", tmp_path / "dp-inprocess")


def test_resume_in_simulation_equals_the_uninterrupted_run(
    flower: LocalFlower, results_dir: Path, tmp_path: Path
) -> None:
    """FedCAMS with error feedback kept in client state files, half the clients a round: stop after round 1,
    resume, and end bit-identical to the uninterrupted run. That run is pollen's in-process runner (clients one
    at a time, one thread), which a simulation with one CPU per client equals bit for bit (the test above)."""
    from pollen.testing.inprocess import run_inprocess

    config = {
        "strategy": "fedcams",
        "compressor": "sign",
        "num-server-rounds": 2,
        "state-dir": str(tmp_path / "clients"),
    }
    full = run_inprocess({**TINY, **config, "results-dir": str(tmp_path), "run-name": "uninterrupted"}, 4, threads=1)
    proc = flower.run(
        {**TINY, **config, "results-dir": str(results_dir), "run-name": "interrupted", "stop-after-round": 1},
        client_cpus=1,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    crashed = results_dir / "interrupted"
    assert (crashed / "checkpoint.npz").is_file() and not (crashed / "final_model.npz").exists()
    resumed = _run(flower, results_dir, "ignored-name", client_cpus=1, **config, resume=str(crashed))
    assert [row["round"] for row in resumed["rows"]] == [0, 1, 2]
    assert [row["accuracy"] for row in resumed["rows"]] == [row["accuracy"] for row in full]
    _same_models(tmp_path / "uninterrupted", crashed)


def test_a_population_on_few_supernodes_equals_one_supernode_per_client(
    flower: LocalFlower, results_dir: Path, tmp_path: Path
) -> None:
    """Twelve clients of FedBNLACA (lazy references, mirrors, residuals on both sides), half sampled a round,
    played by six simulated SuperNodes (run-config ``population``; two train at once, in any order, on whichever
    node they are bound to): bit-identical to twelve in-process nodes, one client each, one at a time."""
    from pollen.testing.inprocess import run_inprocess

    config = {"strategy": "fedbnlaca", "num-server-rounds": 3, "fraction-train": 0.5, "fraction-evaluate": 0.0}
    run_inprocess(
        {**TINY, **config, "results-dir": str(tmp_path), "run-name": "per-node", "state-dir": str(tmp_path / "a")},
        12,
        threads=1,
    )
    metrics = _run(
        flower,
        results_dir,
        "population",
        num_supernodes=6,
        client_cpus=1,
        **config,
        population=12,
        **{"state-dir": str(tmp_path / "played")},
    )
    _same_models(tmp_path / "per-node", results_dir / "population")
    assert [row["round"] for row in metrics["rows"]] == [0, 1, 2, 3]
    files = sorted(path.name for path in (tmp_path / "played").rglob("*.npz"))
    assert len(files) > 6 and all(name.startswith("partition-") for name in files)  # more clients than nodes


def test_a_third_of_clients_failing_every_round_does_not_stop_the_run(flower: LocalFlower, results_dir: Path) -> None:
    """fault-fraction (the test harness's apps): seeded clients raise or send NaN models each round;
    every round completes."""
    metrics = _run(
        flower,
        results_dir,
        "faults",
        variant="testing",
        strategy="fedams",
        **{"num-server-rounds": 3, "fraction-train": 1.0, "fault-fraction": 0.3, "fault-kind": "mixed"},
    )
    rows = metrics["rows"][1:]
    assert [row["round"] for row in rows] == [1, 2, 3]
    assert sum(row["failures"] for row in rows) >= 1
    for row in rows:
        assert row["replies"] + row["failures"] == row["sampled"] == 4 and row["replies"] >= 1
    assert rows[-1]["accuracy"] > metrics["rows"][0]["accuracy"]


@pytest.mark.app_compat  # CI runs it on the newest supported Flower too
def test_secure_aggregation_recovers_a_client_that_drops_mid_protocol(flower: LocalFlower, results_dir: Path) -> None:
    """secagg=true through flwr run, 8 SuperNodes: partition 3 fails every round after sharing its keys (an error
    at the masked-input phase); its masks are removed through its neighbours and the round steps on 7 clients."""
    metrics = _run(
        flower,
        results_dir,
        "secagg",
        num_supernodes=8,
        variant="testing",
        strategy="fedams",
        norm="gn",
        secagg=True,
        **{
            "secagg-bits": 8,
            "fraction-train": 1.0,
            "fault-fraction": 1.0,
            "fault-kind": "error",
            "fault-phase": "secagg-masked-input",
            "fault-partitions": "3",
        },
    )
    rows = metrics["rows"][1:]
    assert [row["round"] for row in rows] == [1, 2]
    for row in rows:
        assert row["sampled"] == 8 and row["replies"] == 7 and row["failures"] == 1
        assert row["method.secagg_survivors"] == 7 and row["method.secagg_dropped"] == 1
        masked, dense = row["uplink_by_record"]["secagg-masked-input/pollen.secagg"], row["uplink_fp32_bytes"]
        assert dense / 2 <= masked < dense / 2 + 7 * 400  # 8 bits of 8 clients sum in 16-bit lanes
        assert "arrays" not in row["uplink_by_record"]  # no model left a node in the clear
    assert rows[-1]["accuracy"] > metrics["rows"][0]["accuracy"] + 0.2


FED_LAMB_FAMILY = {  # name: (record of its statistic or None, learning rates that train the CNN in 2 rounds)
    "fed-lamb": ("pollen.x.v", {"local-lr": 0.01}),
    "mime-lamb": ("pollen.x.grad", {"local-lr": 0.01}),
    "fed-ams": ("pollen.x.v", {"local-lr": 1e-4, "eps": 1e-4}),
    "mime": ("pollen.x.grad", {"local-lr": 1e-4, "eps": 1e-4}),
    "adp-fed": (None, {"local-lr": 0.05, "server-lr": 0.003}),
    "fed-sgd": (None, {"local-lr": 0.05}),
}


#: One of each wire shape of its own goes through ``flwr run`` (v up, a gradient up; the model alone is FedAMS's
#: shape, run above); the rest of the family
#: runs the same real ServerApp and ClientApp in-process (:func:`pollen.testing.inprocess.run_inprocess`), where a
#: process start-up does not dominate, with the same checks.
FED_LAMB_ON_FLOWER = ("fed-lamb", "mime-lamb")


def _fed_lamb_config(name: str) -> dict:
    # 16 SuperNodes, 2 sampled, batch 256: Mime's full local pass over 1/16 of Fashion-MNIST is 15 batches
    return {
        "strategy": name,
        "beta-2": 0.999,
        "eps": 1e-8,
        "fraction-train": 0.125,
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "eval-every": 2,
        "batch-size": 256,
        **FED_LAMB_FAMILY[name][1],
    }


def _check_fed_lamb_family(name: str, rows: list[dict]) -> None:
    """Fed-* upload v next to the model and get v_hat; Mime* upload a full-batch gradient; SGD ones only the model."""
    extra = FED_LAMB_FAMILY[name][0]
    first, last = rows[1], rows[-1]
    assert last["failures"] == 0 and last["replies"] == 2, last
    assert last["grad_evals"] >= 2 * 5
    if extra is None:
        assert not [r for r in {**last["uplink_by_record"], **last["downlink_by_record"]} if r.startswith("pollen.x.")]
    else:
        assert last["uplink_by_record"][extra] >= 2 * 4 * 29_034
        assert first["downlink_by_record"]["pollen.x.v_hat"] >= 4 * 29_034
    if extra == "pollen.x.grad":  # the full local pass shows in the gradient count
        assert last["grad_evals"] > 2 * 5
    assert last["accuracy"] > rows[0]["accuracy"]


@pytest.mark.parametrize("name", FED_LAMB_ON_FLOWER)
def test_fed_lamb_family_moves_its_moments_on_the_wire(flower: LocalFlower, results_dir: Path, name: str) -> None:
    metrics = _run(flower, results_dir, name, num_supernodes=16, **_fed_lamb_config(name))
    _check_fed_lamb_family(name, metrics["rows"])


@pytest.mark.parametrize("name", [n for n in FED_LAMB_FAMILY if n not in FED_LAMB_ON_FLOWER])
def test_rest_of_fed_lamb_family_in_process(tmp_path: Path, name: str) -> None:
    from pollen.testing.inprocess import run_inprocess

    config = {**TINY, **_fed_lamb_config(name), "results-dir": str(tmp_path), "run-name": name}
    _check_fed_lamb_family(name, run_inprocess(config, 16))


def test_hafed_gossips_in_two_clusters_of_four(flower: LocalFlower, results_dir: Path) -> None:
    """8 SuperNodes, cluster = partition // 4, a ring in each; 3 local steps, a gossip after each."""
    metrics = _run(
        flower,
        results_dir,
        "hafed",
        num_supernodes=8,
        strategy="hafed",
        **{
            "cluster-size": 4,
            "local-steps": 3,
            "uploaders-per-cluster": 2,
            "min-train-nodes": 8,
            "local-lr": 0.05,
            "server-lr": 0.01,
            "fraction-evaluate": 0.0,
            "min-evaluate-nodes": 0,
        },
    )
    for row in metrics["rows"][1:]:
        assert row["replies"] == 4 and row["failures"] == 0, row  # 2 uploaders in each cluster
        assert row["exchange_messages"] == 2 * 8  # gossip steps 1 and 2 relayed to all 8 clients
        assert row["grad_evals"] == 3 * 8  # every client trains
        assert (
            row["downlink_by_record"]["hafed-gossip/arrays"] > 0
            and row["method.relayed_bytes"] > 0
            and row["method.peer_bytes"] > 0
        )
    assert metrics["rows"][-1]["accuracy"] > metrics["rows"][0]["accuracy"]


LAZY_FAMILY = ("fednlaa", "fedaa", "fednlaca", "fedaca", "fedbnlaca", "fedbaca")


#: One unidirectional (accelerated) and one bidirectional (lazy) member through ``flwr run``; the rest in-process.
LAZY_ON_FLOWER = ("fedaa", "fedbnlaca")


def _lazy_config(name: str) -> dict:
    return {
        "strategy": name,
        "fraction-train": 1.0,
        "min-train-nodes": 4,
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "model": "mlp",
        "eval-every": 2,
        "local-lr": 0.05,
        "server-lr": 0.01,
        "compressor": "topk",
        "topk-ratio": 0.125,
        "compressor-down": "topk",
        "topk-ratio-down": 0.125,
        "tau-up": 0.5,
        "tau-down": 0.5,
    }


def _check_lazy_family(name: str, rows: list[dict]) -> None:
    """All 4 clients train each round; the bidirectional ones get the full model once, then top-k 1/8 increments."""
    first, last = rows[1], rows[-1]
    for row in (first, last):
        assert row["failures"] == 0 and row["replies"] == 4, row
        events = row["method.lazy_events"]
        assert sum(events.get(f"up-{kind}", 0) for kind in ("send", "skip", "aa")) == 4, events
    assert (
        "up-skip" not in first["method.lazy_events"] and "up-aa" not in first["method.lazy_events"]
    )  # no reference yet
    dense_model = first["downlink_by_record"]["arrays"]
    if name.startswith("fedb"):
        assert first["method.lazy_events"]["down-full"] == 4 and "pollen.down" not in first["downlink_by_record"]
        assert "arrays" not in last["downlink_by_record"]
        assert (
            0 < last["downlink_by_record"].get("pollen.down", 0) < 0.3 * dense_model
        )  # top-k 1/8: k values + k indices
    else:
        assert last["downlink_by_record"]["arrays"] == dense_model and last["method.lazy_events"]["down-dense"] == 4
    assert last["accuracy"] > rows[0]["accuracy"]


@pytest.mark.parametrize("name", LAZY_ON_FLOWER)
def test_lazy_family_runs_with_its_flags_and_increments_on_the_wire(
    flower: LocalFlower, results_dir: Path, name: str
) -> None:
    _check_lazy_family(name, _run(flower, results_dir, name, **_lazy_config(name))["rows"])


@pytest.mark.parametrize("name", [n for n in LAZY_FAMILY if n not in LAZY_ON_FLOWER])
def test_rest_of_lazy_family_in_process(tmp_path: Path, name: str) -> None:
    from pollen.testing.inprocess import run_inprocess

    config = {**TINY, **_lazy_config(name), "results-dir": str(tmp_path), "run-name": name}
    _check_lazy_family(name, run_inprocess(config, 4))


def test_a_refused_run_is_one_line_and_lands_under_the_pollen_home(flower: LocalFlower) -> None:
    """Through ``flwr run``: a relative ``results-dir`` resolves against ``$POLLEN_HOME`` in the ServerApp's
    process (not the SuperLink's working directory), the refusal is one line without Flower's traceback or
    exit-code banner, ``flwr run`` exits 0 (Flower 1.39 does whatever the run did) and ``run.json`` says why."""
    from pollen.app.results import read_run_state

    folder = Path(flower.env["POLLEN_HOME"]) / "refusals" / "too-few"
    config = {**TINY, "results-dir": "refusals", "run-name": "too-few", "min-train-nodes": 3, "node-wait-seconds": 1}
    proc = flower.run(config, num_supernodes=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    reason = "run-config 'min-train-nodes' = 3 but only 2 SuperNodes (partitions) are connected; allowed: at most 2"
    assert f"[pollen] run too-few: fedams on fashion-mnist; results in {folder}" in out, out[-3000:]
    assert f"[pollen] stopped before round 1: {reason} (run.json in {folder})" in out, out[-3000:]
    assert "Traceback" not in out and "Exit Code" not in out, out[-3000:]
    state = read_run_state(folder)
    assert (state["status"], state["reason"], state["last_round"]) == ("stopped", reason, 0)
