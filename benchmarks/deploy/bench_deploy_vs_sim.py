"""Seconds per round and bytes on the wire: the same 2-client run in deployment and in simulation.

    python benchmarks/deploy/bench_deploy_vs_sim.py                 # everything, about 10-15 min on 2 CPU cores
    python benchmarks/deploy/bench_deploy_vs_sim.py --rounds 3 --only deploy sim --json out.json

Every variant runs the same app config (FedCAMS, scaled-sign uplink, CNN on Fashion-MNIST,
2 clients, ``local-steps`` SGD steps each, all clients every round, no federated evaluation) on
this machine, on 127.0.0.1, without TLS:

``deploy``
    ``flower-superlink`` + 2 ``flower-supernode`` (Fleet API gRPC-rere, ``--isolation subprocess``):
    each SuperNode starts a fresh ``flwr-clientapp`` process per message.
``deploy-fastpoll``
    The same with ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1`` (SuperExec default: 1 s).
``deploy-process``
    ``--isolation process`` with a long-running ``flower-superexec`` per SuperNode: in Flower 1.39
    this still starts one ``flwr-clientapp`` per message (it needs a per-task token); measured to show it.
``sim``
    A simulation SuperLink (``flower-superlink --simulation``) and ``flwr run --federation-config
    "num-supernodes=2 client-resources-num-cpus=1"``: Ray workers stay up and keep their imports and
    cached data across rounds.
``anchor``
    What Flower itself costs: on one ``deploy``-style federation (same SuperNodes, node-config
    ``partition-id`` / ``num-partitions``, rounds and local steps), the minimal Flower App in
    ``benchmarks/anchor_app`` (Flower's own FedAvg; a ClientApp that reads the same IDX files, takes
    an IID share, builds the same CNN and trains the same K steps of batch 32, no pollen) and pollen
    with ``strategy='fedavg'`` and with ``strategy='fedcams'`` (scaled sign), run in turn
    (``--repeats`` times, order rotated). pollen gets ``partitioner='iid'`` and ``eval-every`` =
    rounds (no server-side evaluation inside the measured rounds, as the anchor has none); its
    partition cache is filled before the first run (the steady state of a node). Seconds per round
    are measured the same way for all three: the interval between a SuperNode's consecutive train
    messages (``Receiving: train message`` in its log), from round 2 on. Flower 1.39's polling
    (SuperExec 1 s, SuperNode and ServerApp 3 s) makes single intervals jump by seconds, so use
    ``--rounds 8`` or more. Other jobs on a shared machine only add time: the CPU they use is sampled
    from ``/proc`` (:class:`ForeignLoad`) and the ratios are also given over the quiet intervals and
    for each app's best run.

Reported per variant: median seconds per round from round 2 on (the app's ``round_seconds``: configure, local
training, replies, aggregation and server-side evaluation), the run's wall time, and for the
deployment variants where the per-message time goes, from time-stamped SuperNode logs:
SuperNode receives a message -> ``flwr-clientapp`` has started and imported flwr -> the ClientApp has
trained -> the SuperNode sends the reply. Bytes: the app's uplink counts (``uplink_update_bytes``,
``uplink_fp32_bytes``, measured from the records) and the SuperLink's own Fleet API traffic counter
(``flwr list --format json``: ``network-traffic``) for one round, as the difference between a
2-round and a 1-round run, with scaled-sign and with FP32 (``compressor='none'``) uplink. A cold-start probe times,
in a fresh interpreter, what each ``flwr-clientapp`` process pays before training: imports and data/model set-up,
for pollen and for the anchor.

Environment of the federation: each SuperNode (and so each ``flwr-clientapp`` it starts) runs torch with
``--node-threads`` threads (``OMP_NUM_THREADS``, default 1: two SuperNodes share this machine's cores, as
each would own its machine's; with torch's default of one thread per core, two training processes on
2 busy cores spend most of a step waiting on each other), and ``PYTHONDONTWRITEBYTECODE`` is removed so
the app's modules are compiled once per installed FAB, as on a normal machine.

    python benchmarks/deploy/bench_deploy_vs_sim.py --rounds 8 --only anchor cold-start --repeats 3   # about 17 min
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pollen.testing import local_federation as lf  # noqa: E402

CONNECTION = "bench"
NUM_CLIENTS = 2
VARIANTS = ("deploy", "deploy-fastpoll", "deploy-process", "sim", "anchor")
ANCHOR_APP = lf.REPO_ROOT / "benchmarks" / "anchor_app"
#: The apps the ``anchor`` variant runs in turn on one federation.
ANCHOR_APPS = ("anchor", "pollen-fedavg", "pollen-fedcams")
#: ``anchor`` meets its target when pollen's seconds per round are at most this multiple of the anchor's.
ANCHOR_TARGET = 1.2
#: Intervals during which other jobs kept at most this many CPU cores busy count as quiet.
QUIET_CORES = 0.25


def base_env() -> dict[str, str]:
    """The environment every process of a federation starts from: this one, writing bytecode."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def flower_env(flwr_home: Path, node_threads: int = 0, **extra: str) -> dict[str, str]:
    """``lf.flower_env`` on :func:`base_env`, with ``OMP_NUM_THREADS=node_threads`` when > 0 (SuperNodes)."""
    env = {key: value for key, value in lf.flower_env(flwr_home, **extra).items() if key != "PYTHONDONTWRITEBYTECODE"}
    if node_threads > 0:
        env["OMP_NUM_THREADS"] = str(node_threads)
    return env


def pollen_defaults() -> dict[str, Any]:
    """pollen's ``[tool.flwr.app.config]`` defaults (read as text: this script does not import pollen)."""
    import tomllib

    with open(lf.REPO_ROOT / "pyproject.toml", "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])


def app_config(rounds: int, local_steps: int, run_name: str, results: Path, **extra: Any) -> dict[str, Any]:
    return {
        "strategy": "fedcams",
        "compressor": "sign",
        "num-server-rounds": rounds,
        "local-steps": local_steps,
        "model": "cnn",
        "fraction-train": 1.0,
        "min-train-nodes": NUM_CLIENTS,
        "fraction-evaluate": 0.0,
        "min-evaluate-nodes": 0,
        "results-dir": str(results),
        "run-name": run_name,
        **extra,
    }


# --------------------------------------------------------------------------- one flwr run


def flwr_run_app(
    procs: lf.Processes,
    env: dict[str, str],
    app: Path | str,
    config: dict[str, Any],
    name: str,
    federation_config: str | None = None,
    timeout: float = 1200,
) -> dict[str, Any]:
    """``flwr run <app> bench --stream``; the run id, when it started and ended, and its final status."""
    argv = [lf.exe("flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", lf.run_config_arg(config)]
    if federation_config:
        argv += ["--federation-config", federation_config]
    start = time.time()
    code, out = procs.run(f"flwr-run-{name}", argv, timeout=timeout, env=env, cwd=lf.REPO_ROOT, timestamps=True)
    end = time.time()
    match = re.search(r"Successfully started run (\d+)", out)
    if code != 0 or not match:
        raise RuntimeError(f"flwr run failed (exit {code}):\n{lf.tail(out)}")
    status = lf.run_status(procs, CONNECTION, env, run_id=match.group(1))
    if status["status"] != "finished:completed":
        raise RuntimeError(
            f"run {match.group(1)} did not complete: {status['status']} {status.get('status-details')}\n{lf.tail(out)}"
        )
    return {
        "run_id": match.group(1),
        "started_at": start,
        "ended_at": end,
        "wall_seconds": end - start,
        "status": status,
        "output": out,
    }


def flwr_run(
    procs: lf.Processes,
    env: dict[str, str],
    config: dict[str, Any],
    federation_config: str | None = None,
    timeout: float = 1200,
) -> dict[str, Any]:
    run = flwr_run_app(
        procs, env, ".", config, config["run-name"], federation_config=federation_config, timeout=timeout
    )
    status, out = run["status"], run["output"]
    metrics = lf.load_metrics(Path(config["results-dir"]), config["run-name"])
    rows = [row for row in metrics["rows"] if row["round"] >= 1]
    if len(rows) != config["num-server-rounds"]:
        raise RuntimeError(
            f"run {run['run_id']} recorded {len(rows)} of {config['num-server-rounds']} rounds\n{lf.tail(out)}"
        )
    first = rows[0]
    return {
        "run_id": run["run_id"],
        "started_at": run["started_at"],
        "ended_at": run["ended_at"],
        "wall_seconds": run["wall_seconds"],
        "round_seconds": [row["round_seconds"] for row in rows],
        "median_round_seconds": statistics.median(row["round_seconds"] for row in rows),
        "steady_round_seconds": statistics.median(row["round_seconds"] for row in rows[1:])
        if len(rows) > 1
        else rows[0]["round_seconds"],
        "replies_per_round": first["replies"],
        "uplink_update_bytes_per_reply": first["uplink_update_bytes"] / first["replies"],
        "uplink_fp32_bytes_per_reply": first["uplink_fp32_bytes"] / first["replies"],
        "uplink_bytes_per_round": first["uplink_bytes"],
        "downlink_bytes_per_round": first["downlink_bytes"],
        "superlink_traffic": status.get("network-traffic", {}),
        "compute_time": status.get("compute-time", {}),
    }


# --------------------------------------------------------------------------- per-message phases


_EVENTS = (
    ("recv", re.compile(r"Receiving: train message")),
    ("started", re.compile(r"Start `flwr-clientapp` process")),
    ("trained", re.compile(r"\[(?:pollen|anchor)\] .*\btrained\b")),
    ("sent", re.compile(r"Sending: train message")),
)


def _timed_lines(*logs: Path) -> list[tuple[float, str]]:
    lines = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            head, _, rest = line.partition(" ")
            try:
                lines.append((float(head), rest))
            except ValueError:
                continue
    return sorted(lines, key=lambda item: item[0])


def message_phases(logs: list[Path], since: float, until: float = float("inf")) -> list[dict[str, float]]:
    """Per train message on one SuperNode: seconds between receive, clientapp start, trained, reply sent."""
    messages, current = [], None
    for stamp, text in _timed_lines(*logs):
        if stamp < since or stamp > until:
            continue
        for name, pattern in _EVENTS:
            if pattern.search(text):
                if name == "recv":
                    current = {"recv": stamp}
                elif current is not None and name not in current:
                    current[name] = stamp
                    if name == "sent":
                        if len(current) == 4:
                            messages.append(current)
                        current = None
    return [
        {
            "receive_to_clientapp_started": m["started"] - m["recv"],
            "clientapp_started_to_trained": m["trained"] - m["started"],
            "trained_to_reply_sent": m["sent"] - m["trained"],
            "receive_to_reply_sent": m["sent"] - m["recv"],
        }
        for m in messages
    ]


def _median_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    if not phases:
        return {}
    return {key: statistics.median(p[key] for p in phases) for key in phases[0]}


def train_receipts(logs: list[Path], since: float, until: float = float("inf")) -> list[float]:
    """When one SuperNode received each train message (its log's time stamps), in order."""
    pattern = _EVENTS[0][1]
    return [stamp for stamp, text in _timed_lines(*logs) if since <= stamp <= until and pattern.search(text)]


def round_intervals(node_logs: list[list[Path]], since: float, until: float) -> list[list[tuple[float, float]]]:
    """Per SuperNode: ``(start, end)`` of each interval between its consecutive train messages (round r -> r + 1).

    The same measure for any app: one round's local training, replies, aggregation and configuration of the
    next round, Flower's polling included, as a node sees it.
    """
    return [list(itertools.pairwise(train_receipts(logs, since, until))) for logs in node_logs]


# --------------------------------------------------------------------------- other load on the machine


class ForeignLoad:
    """CPU cores that processes outside this benchmark keep busy while a run lasts (sampled from ``/proc``).

    A process belongs to the benchmark when its environment names the benchmark's working directory
    (every SuperLink, SuperNode, ``flwr-clientapp`` / ``flwr-serverapp`` and ``flwr`` call started here
    has ``FLWR_HOME`` under it). On a shared machine other jobs only ever add time, so runs with little
    foreign load are the ones to compare.
    """

    def __init__(self, marker: str, interval: float = 0.5) -> None:
        self.marker = marker.encode()
        self.interval = interval
        self.tick = os.sysconf("SC_CLK_TCK")
        self.cpu: dict[tuple[int, str], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self.ours: dict[tuple[int, str], bool] = {}
        self.foreign_seconds = 0.0
        self.timeline: list[tuple[float, float]] = []  # (time, foreign CPU seconds so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self, first: bool) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                key = (int(entry.name), stat[19])
                if key not in self.ours:
                    self.ours[key] = (
                        self.marker in Path(f"/proc/{entry.name}/environ").read_bytes() or key[0] == os.getpid()
                    )
            except (OSError, IndexError, ValueError):
                continue
            seconds = (int(stat[11]) + int(stat[12])) / self.tick
            if not self.ours[key]:
                # a process first seen after the first sample started during the run: all its CPU counts
                self.foreign_seconds += seconds - self.cpu.get(key, seconds if first else 0.0)
            self.cpu[key] = seconds
        self.timeline.append((time.time(), self.foreign_seconds))

    def cores_between(self, start: float, end: float) -> float:
        """Foreign CPU cores busy on average between ``start`` and ``end`` (from the samples around them)."""
        before = max((item for item in self.timeline if item[0] <= start), default=self.timeline[0])
        after = min((item for item in self.timeline if item[0] >= end), default=self.timeline[-1])
        return (after[1] - before[1]) / max(after[0] - before[0], 1e-9)

    def _loop(self) -> None:
        first = True
        while not self._stop.is_set():
            self._sample(first)
            first = False
            self._stop.wait(self.interval)

    def __enter__(self) -> ForeignLoad:  # noqa: PYI034
        self.started = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(False)
        self.cores = self.foreign_seconds / max(time.time() - self.started, 1e-9)


# --------------------------------------------------------------------------- variants


@contextlib.contextmanager
def federation(
    home: Path,
    isolation: str = "subprocess",
    extra_env: dict[str, str] | None = None,
    node_threads: int = 1,
    node_config_extra: str = "",
):
    """A SuperLink and ``NUM_CLIENTS`` SuperNodes on loopback: yields ``(procs, user_env, node_logs)``.

    ``node_config_extra`` is appended to every SuperNode's node-config (e.g. ``cluster-id='a'``).
    """
    extra_env = extra_env or {}
    with lf.Processes(home / "logs", env=base_env()) as procs, lf.dump_logs_on_error(procs, lines=40):
        http_port, fleet_port, *runtime_ports = lf.free_ports(2 + NUM_CLIENTS)
        superlink = procs.start(
            "superlink",
            lf.superlink_argv(http_port=http_port, fleet_port=fleet_port),
            env=flower_env(home / "home-superlink", **extra_env),
            timestamps=True,
        )
        lf.wait_until(
            lambda: (
                superlink.poll() is None
                and all(lf.port_is_open(port) for port in lf.superlink_ports(http_port, fleet_port))
            ),
            90,
            "the SuperLink",
        )
        user_env = flower_env(home / "home-user")
        lf.write_connection(home / "home-user", CONNECTION, f"127.0.0.1:{http_port}", insecure=True)
        node_logs: list[list[Path]] = []
        for i in range(NUM_CLIENTS):
            env = flower_env(home / f"home-supernode-{i}", node_threads, **extra_env)
            node = procs.start(
                f"supernode-{i}",
                lf.supernode_argv(
                    superlink=lf.fleet_address(http_port, fleet_port),
                    runtime_port=runtime_ports[i],
                    node_config=(
                        f"partition-id={i} num-partitions={NUM_CLIENTS} device='cpu' {node_config_extra}"
                    ).strip(),
                    insecure=True,
                    isolation=isolation,
                ),
                env=env,
                timestamps=True,
            )
            logs = [node.log_path]
            if isolation == "process":
                executor = procs.start(
                    f"superexec-{i}",
                    [
                        lf.exe("flower-superexec"),
                        "--insecure",
                        "--runtime-api-address",
                        f"127.0.0.1:{runtime_ports[i]}",
                    ],
                    env=env,
                    timestamps=True,
                )
                logs.append(executor.log_path)
            node_logs.append(logs)
        lf.wait_until(
            lambda: lf.online_nodes(procs, CONNECTION, user_env) >= NUM_CLIENTS, 120, "SuperNodes online", interval=1.0
        )
        yield procs, user_env, node_logs


def run_deployment(
    root: Path, variant: str, rounds: int, local_steps: int, with_bytes: bool, node_threads: int = 1
) -> dict[str, Any]:
    home = root / variant
    extra_env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"} if variant == "deploy-fastpoll" else {}
    isolation = "process" if variant == "deploy-process" else "subprocess"
    with federation(home, isolation, extra_env, node_threads) as (procs, user_env, node_logs):
        results = home / "results"
        sign = flwr_run(procs, user_env, app_config(rounds, local_steps, f"{variant}-sign", results))
        phases = [p for logs in node_logs for p in message_phases(logs, since=sign["started_at"])]
        out: dict[str, Any] = {"variant": variant, "isolation": isolation, "env": extra_env, "sign": sign}
        out["message_phases_median"] = _median_phases(phases)
        out["messages_timed"] = len(phases)
        if with_bytes:
            out["bytes_per_round"] = wire_bytes_per_round(procs, user_env, local_steps, results, variant)
        return out


def wire_bytes_per_round(
    procs: lf.Processes, env: dict[str, str], local_steps: int, results: Path, variant: str
) -> dict[str, Any]:
    """SuperLink Fleet traffic of one round, scaled sign vs FP32 uplink: a 2-round run minus a 1-round run.

    The difference cancels what every run has once (the identify query, the first pull of the
    FAB's run info), leaving exactly one round's Fleet API traffic as the SuperLink counts it.
    """
    out = {}
    for compressor in ("sign", "none"):
        runs = {
            r: flwr_run(
                procs,
                env,
                app_config(r, local_steps, f"{variant}-bytes-{compressor}-{r}", results, compressor=compressor),
            )
            for r in (1, 2)
        }
        one, two = runs[1], runs[2]
        out[compressor] = {
            "fleet_inbound_bytes": two["superlink_traffic"]["inbound-bytes"]
            - one["superlink_traffic"]["inbound-bytes"],
            "fleet_outbound_bytes": two["superlink_traffic"]["outbound-bytes"]
            - one["superlink_traffic"]["outbound-bytes"],
            "app_uplink_bytes": one["uplink_bytes_per_round"],
            "app_uplink_update_bytes_per_reply": one["uplink_update_bytes_per_reply"],
            "app_uplink_fp32_bytes_per_reply": one["uplink_fp32_bytes_per_reply"],
            "app_downlink_bytes": one["downlink_bytes_per_round"],
        }
    return out


def run_simulation(root: Path, rounds: int, local_steps: int) -> dict[str, Any]:
    home = root / "sim"
    with lf.Processes(home / "logs") as procs, lf.dump_logs_on_error(procs, lines=40):
        (http_port,) = lf.free_ports(1)
        env = lf.flower_env(home / "home", RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0")
        superlink = procs.start(
            "superlink-sim", lf.superlink_argv(http_port=http_port, fleet_port=0, simulation=True), env=env
        )
        lf.wait_until(lambda: superlink.poll() is None and lf.port_is_open(http_port), 90, "the simulation SuperLink")
        lf.write_connection(home / "home", CONNECTION, f"127.0.0.1:{http_port}", insecure=True)
        run = flwr_run(
            procs,
            env,
            app_config(rounds, local_steps, "sim-sign", home / "results"),
            federation_config=f"num-supernodes={NUM_CLIENTS} client-resources-num-cpus=1",
        )
        return {"variant": "sim", "sign": run}


def anchor_config(rounds: int, local_steps: int) -> dict[str, Any]:
    """The anchor's run-config: pollen's batch size, local learning rate and seed."""
    defaults = pollen_defaults()
    return {
        "num-server-rounds": rounds,
        "fraction-train": 1.0,
        "local-steps": local_steps,
        "batch-size": defaults["batch-size"],
        "lr": defaults["local-lr"],
        "seed": defaults["seed"],
    }


def comparison_config(app: str, rounds: int, local_steps: int, results: Path, run_name: str) -> dict[str, Any]:
    """pollen's run-config in the ``anchor`` variant: the same round as the anchor's (see the docstring)."""
    strategy = {"pollen-fedavg": "fedavg", "pollen-fedcams": "fedcams"}[app]
    return app_config(
        rounds, local_steps, run_name, results, strategy=strategy, partitioner="iid", **{"eval-every": rounds}
    )


_WARM_CACHE = r"""
import json, sys
from pollen.app.config import AppConfig, defaults_from_pyproject
from pollen.app.experiment import data_config
from pollen.task import data
cfg = AppConfig.from_run_config({**defaults_from_pyproject(sys.argv[1]), **json.loads(sys.argv[2])})
dcfg = data_config(cfg, num_partitions=int(sys.argv[3]))
out = []
for pid in range(dcfg.num_partitions):
    path, _ = data._cache_entry(dcfg, pid)
    was = path is not None and path.exists()
    data.load_partition(dcfg, pid, cfg["batch-size"])
    out.append({"file": str(path), "was_warm": was, "is_warm": path is not None and path.exists()})
print(json.dumps(out))
"""


def warm_partition_cache(overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """Fill pollen's on-disk partition cache for the SuperNodes' partitions (what a node's first message does)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _WARM_CACHE,
            str(lf.REPO_ROOT / "pyproject.toml"),
            json.dumps(overrides),
            str(NUM_CLIENTS),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=lf.REPO_ROOT,
        timeout=600,
        env=base_env(),
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_anchor_comparison(root: Path, rounds: int, local_steps: int, repeats: int, node_threads: int) -> dict[str, Any]:
    """The anchor and pollen (FedAvg, FedCAMS) in turn on one federation; seconds per round and phases."""
    home = root / "anchor"
    results = home / "results"
    cache = warm_partition_cache({"partitioner": "iid"})
    runs: dict[str, list[dict[str, Any]]] = {app: [] for app in ANCHOR_APPS}
    with federation(home, node_threads=node_threads) as (procs, user_env, node_logs):
        for rep in range(repeats):
            order = ANCHOR_APPS[rep % len(ANCHOR_APPS) :] + ANCHOR_APPS[: rep % len(ANCHOR_APPS)]
            for app in order:
                print(f"[bench] anchor comparison, repeat {rep + 1}/{repeats}: {app} ...", flush=True)
                name = f"{app}-{rep}"
                with ForeignLoad(str(root)) as foreign:
                    if app == "anchor":
                        run = flwr_run_app(procs, user_env, ANCHOR_APP, anchor_config(rounds, local_steps), name)
                        run = {k: v for k, v in run.items() if k not in ("status", "output")}
                    else:
                        run = flwr_run(procs, user_env, comparison_config(app, rounds, local_steps, results, name))
                run["foreign_load_cores"] = foreign.cores
                run["repeat"] = rep
                intervals = round_intervals(node_logs, run["started_at"], run["ended_at"])
                phases = [p for logs in node_logs for p in message_phases(logs, run["started_at"], run["ended_at"])]
                run["node_round_intervals"] = [[b - a for a, b in node] for node in intervals]
                run["steady_intervals"] = [b - a for node in intervals for a, b in node[1:]]
                run["steady_interval_foreign_cores"] = [
                    foreign.cores_between(a, b) for node in intervals for a, b in node[1:]
                ]
                run["message_phases"] = phases
                runs[app].append(run)
    out: dict[str, Any] = {
        "variant": "anchor",
        "node_threads": node_threads,
        "partition_cache": cache,
        "repeats": repeats,
        "apps": {},
    }
    for app, app_runs in runs.items():
        steady = [x for run in app_runs for x in run["steady_intervals"]]
        phases = [p for run in app_runs for p in run["message_phases"]]
        each = [statistics.median(r["steady_intervals"]) if r["steady_intervals"] else float("nan") for r in app_runs]
        quiet = [
            x
            for r in app_runs
            for x, cores in zip(r["steady_intervals"], r["steady_interval_foreign_cores"])
            if cores <= QUIET_CORES
        ]
        summary = {
            "runs": app_runs,
            "seconds_per_round": statistics.median(steady) if steady else float("nan"),
            "seconds_per_round_each_run": each,
            "seconds_per_round_best_run": min(each),
            "seconds_per_round_quiet": statistics.median(quiet) if quiet else None,
            "quiet_intervals": len(quiet),
            "foreign_load_cores": [r["foreign_load_cores"] for r in app_runs],
            "intervals_timed": len(steady),
            "message_phases_median": _median_phases(phases),
            "messages_timed": len(phases),
            "wall_seconds": [r["wall_seconds"] for r in app_runs],
        }
        if app != "anchor":
            summary["app_round_seconds"] = [r["round_seconds"] for r in app_runs]
        out["apps"][app] = summary
    out["ratios"] = {}
    for estimate in ("seconds_per_round", "seconds_per_round_best_run", "seconds_per_round_quiet"):
        anchor = out["apps"]["anchor"][estimate]
        values = {app: out["apps"][app][estimate] for app in ANCHOR_APPS if app != "anchor"}
        if anchor is not None and all(v is not None for v in values.values()):
            out["ratios"][estimate] = {app: v / anchor for app, v in values.items()}
    return out


_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import flwr.supernode.runtime.run_clientapp  # what flwr-clientapp imports before it pulls the message
t1 = time.perf_counter()
if sys.argv[1] == "pollen":
    import torch, pollen.client_app
    from pollen.task.train import train
    t2 = time.perf_counter()
    from flwr.app import Context, RecordDict
    from pollen.app.config import defaults_from_pyproject
    run_config = {**defaults_from_pyproject(sys.argv[2]), **json.loads(sys.argv[3])}
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2, "device": "cpu"},
                      state=RecordDict(), run_config=run_config)
    task = pollen.client_app.LocalTask(context)
    loader, _ = task.loaders(32)
    t3 = time.perf_counter()
    train(task.model, loader, lr=0.01, local_steps=int(run_config["local-steps"]), local_epochs=None, momentum=0.0,
          weight_decay=0.0, device=task.device, seed=1)
else:
    import torch, anchorapp.client_app
    from anchorapp.task import Net, load_data, train
    t2 = time.perf_counter()
    config = json.loads(sys.argv[3])
    torch.manual_seed(config["seed"])
    model = Net()
    loader = load_data("/usr/share/datasets/fashion-mnist", 0, 2, config["seed"], config["batch-size"])
    t3 = time.perf_counter()
    train(model, loader, config["local-steps"], config["lr"])
t4 = time.perf_counter()
print(json.dumps({"import_flwr_clientapp": t1 - t0, "import_torch_app": t2 - t1, "data_and_model": t3 - t2,
                  "train": t4 - t3, "imports_pollen_strategies": "pollen.strategies" in sys.modules}))
"""


def cold_start_probe(local_steps: int, repeats: int, node_threads: int = 1) -> dict[str, Any]:
    """What a fresh ``flwr-clientapp`` pays before and during training, in a new interpreter each time.

    pollen (``partitioner='iid'``, its partition cache warm) and the anchor, alternately, in the SuperNodes'
    environment (``node_threads``, bytecode written).
    """
    env = base_env()
    if node_threads > 0:
        env["OMP_NUM_THREADS"] = str(node_threads)
    argv = {
        "pollen": (lf.REPO_ROOT, json.dumps({"model": "cnn", "local-steps": local_steps, "partitioner": "iid"})),
        "anchor": (ANCHOR_APP, json.dumps(anchor_config(1, local_steps))),
    }
    warm_partition_cache({"partitioner": "iid"})
    samples: dict[str, list[dict[str, Any]]] = {"pollen": [], "anchor": []}
    for _ in range(repeats):
        for app, (cwd, config) in argv.items():
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", _PROBE, app, str(lf.REPO_ROOT / "pyproject.toml"), config],
                capture_output=True,
                text=True,
                check=True,
                cwd=cwd,
                timeout=300,
                env=env,
            )
            sample = json.loads(done.stdout.strip().splitlines()[-1])
            sample["process_total"] = time.perf_counter() - start
            samples[app].append(sample)
    out: dict[str, Any] = {"repeats": repeats, "node_threads": node_threads}
    for app, rows in samples.items():
        out[app] = {
            key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "imports_pollen_strategies"
        }
        out[app]["imports_pollen_strategies"] = rows[0]["imports_pollen_strategies"]
    return out


# --------------------------------------------------------------------------- report


def _fmt_bytes(n: float) -> str:
    return f"{n / 1000:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def report(results: dict[str, Any], rounds: int, local_steps: int) -> str:
    machine = results["machine"]
    lines = [
        f"pollen deployment vs simulation: {NUM_CLIENTS} clients, FedCAMS sign, CNN, {local_steps} local steps, "
        f"{rounds} rounds",
        f"machine: {machine['cpus']} CPUs, load average {machine['loadavg_at_start']:.1f} at start, "
        f"{machine.get('loadavg_at_end', float('nan')):.1f} at end",
        "",
    ]
    if any(name in results for name in VARIANTS if name != "anchor"):
        lines.append(
            f"{'variant':<17} {'s/round, rounds 2+ (median)':>28}   {'each round (s)':<30} {'flwr run wall (s)':>17}"
        )
    for name in VARIANTS:
        if name not in results or name == "anchor":
            continue
        run = results[name]["sign"]
        rounds_txt = " ".join(f"{s:.1f}" for s in run["round_seconds"])
        lines.append(f"{name:<17} {run['steady_round_seconds']:>28.2f}   {rounds_txt:<30} {run['wall_seconds']:>17.1f}")
    lines.append("")
    for name in VARIANTS:
        phases = results.get(name, {}).get("message_phases_median")
        if phases and name != "anchor":
            lines.append(
                f"{name:<17} per train message (median of {results[name]['messages_timed']}): "
                f"receive->clientapp up {phases['receive_to_clientapp_started']:.2f}s, "
                f"up->trained {phases['clientapp_started_to_trained']:.2f}s, "
                f"trained->reply sent {phases['trained_to_reply_sent']:.2f}s, "
                f"total {phases['receive_to_reply_sent']:.2f}s; rest of the round "
                f"(aggregation, server-side evaluation, 3 s polling loops) "
                f"{results[name]['sign']['steady_round_seconds'] - phases['receive_to_reply_sent']:.2f}s"
            )
    if "anchor" in results:
        lines += [""] + anchor_report(results["anchor"], rounds, local_steps)
    if "cold_start" in results:
        c = results["cold_start"]
        lines.append("")
        lines.append(
            f"cold start of one ClientApp process (fresh interpreter, median of {c['repeats']}, "
            f"OMP_NUM_THREADS={c['node_threads'] or 'unset'}):"
        )
        for app in ("pollen", "anchor"):
            a = c[app]
            lines.append(
                f"  {app:<7} import flwr clientapp {a['import_flwr_clientapp']:.2f}s "
                f"+ import torch/{app} {a['import_torch_app']:.2f}s "
                f"+ data/model set-up {a['data_and_model']:.2f}s; training {a['train']:.2f}s; "
                f"process total {a['process_total']:.2f}s"
                + ("  (imports pollen.strategies)" if a["imports_pollen_strategies"] else "")
            )
    per_round = results.get("deploy", {}).get("bytes_per_round")
    if per_round:
        lines.append("")
        lines.append(
            f"one round, {NUM_CLIENTS} clients (SuperLink Fleet API counter: 2-round run minus 1-round run; "
            "app: counted from the records)"
        )
        lines.append(
            f"{'uplink codec':<14} {'Fleet in (uplink)':>18} {'Fleet out (downlink)':>21} "
            f"{'app uplink':>11} {'app update/reply':>17} {'app downlink':>13}"
        )
        for kind, label in (("sign", "scaled sign"), ("none", "fp32")):
            b = per_round[kind]
            lines.append(
                f"{label:<14} {_fmt_bytes(b['fleet_inbound_bytes']):>18} {_fmt_bytes(b['fleet_outbound_bytes']):>21} "
                f"{_fmt_bytes(b['app_uplink_bytes']):>11} {_fmt_bytes(b['app_uplink_update_bytes_per_reply']):>17} "
                f"{_fmt_bytes(b['app_downlink_bytes']):>13}"
            )
        ratio = per_round["none"]["fleet_inbound_bytes"] / per_round["sign"]["fleet_inbound_bytes"]
        update_ratio = (
            per_round["sign"]["app_uplink_fp32_bytes_per_reply"]
            / per_round["sign"]["app_uplink_update_bytes_per_reply"]
        )
        lines.append(
            f"uplink FP32/sign: x{ratio:.1f} on the wire (Fleet inbound), "
            f"x{update_ratio:.1f} for the model update alone"
        )
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1]))


def anchor_report(res: dict[str, Any], rounds: int, local_steps: int) -> list[str]:
    apps = res["apps"]
    warm = all(entry["was_warm"] for entry in res["partition_cache"])
    lines = [
        (
            f"anchor: Flower itself vs pollen, deployment, {NUM_CLIENTS} SuperNodes, CNN, "
            f"{local_steps} local steps of batch 32, "
            f"{rounds} rounds, {res['repeats']} run(s) each, "
            f"OMP_NUM_THREADS={res['node_threads'] or 'unset'} per SuperNode; "
            f"pollen partition cache {'already warm' if warm else 'filled before the first run'} (steady state)"
        ),
        (
            f"{'app':<15} {'s/round':>8} {'x anchor':>9} {'best run':>9} {'x anchor':>9} "
            f"{'quiet':>11} {'x anchor':>9}   "
            f"{'per run: s/round @ other jobs (cores)':<42} {'flwr run wall (s)':<19} pollen's own round_seconds"
        ),
    ]
    for app in ANCHOR_APPS:
        a, anchor = apps[app], apps["anchor"]
        per_run = " ".join(f"{x:.2f}@{c:.2f}" for x, c in zip(a["seconds_per_round_each_run"], a["foreign_load_cores"]))
        walls = " ".join(f"{x:.1f}" for x in a["wall_seconds"])
        own = " | ".join(" ".join(f"{x:.1f}" for x in run) for run in a.get("app_round_seconds", []))
        quiet = a["seconds_per_round_quiet"]
        quiet_txt = f"{quiet:>11.2f}" if quiet is not None else f"{'-':>11}"
        quiet_ratio = (
            f"{quiet / anchor['seconds_per_round_quiet']:>8.2f}x"
            if quiet is not None and anchor["seconds_per_round_quiet"]
            else f"{'-':>9}"
        )
        lines.append(
            f"{app:<15} {a['seconds_per_round']:>8.2f} {a['seconds_per_round'] / anchor['seconds_per_round']:>8.2f}x "
            f"{a['seconds_per_round_best_run']:>9.2f} "
            f"{a['seconds_per_round_best_run'] / anchor['seconds_per_round_best_run']:>8.2f}x "
            f"{quiet_txt} {quiet_ratio}   {per_run:<42} {walls:<19} {own}"
        )
    quiet_counts = ", ".join(f"{app} {apps[app]['quiet_intervals']}" for app in ANCHOR_APPS)
    lines.append(
        f"s/round: interval between a SuperNode's train messages, rounds 2+; median over all runs and nodes "
        f"({apps['anchor']['intervals_timed']} intervals per app), of the best run (its median), "
        "and over the quiet intervals "
        f"(other jobs on the machine kept <= {QUIET_CORES} cores busy during the interval; {quiet_counts})"
    )
    for app in ANCHOR_APPS:
        ph = apps[app]["message_phases_median"]
        if ph:
            lines.append(
                f"{app:<15} per train message (median of {apps[app]['messages_timed']}): "
                f"receive->clientapp up {ph['receive_to_clientapp_started']:.2f}s, "
                f"up->trained {ph['clientapp_started_to_trained']:.2f}s, "
                f"trained->reply sent {ph['trained_to_reply_sent']:.2f}s, "
                f"total {ph['receive_to_reply_sent']:.2f}s; "
                f"rest of the round {apps[app]['seconds_per_round'] - ph['receive_to_reply_sent']:.2f}s"
            )
    labels = {
        "seconds_per_round": "all intervals",
        "seconds_per_round_best_run": "best run",
        "seconds_per_round_quiet": "quiet intervals",
    }
    for estimate, ratios in res["ratios"].items():
        worst = max(ratios.values())
        verdict = (
            "met"
            if worst <= ANCHOR_TARGET
            else f"NOT met (worst {worst:.2f}x, {100 * (worst / ANCHOR_TARGET - 1):.0f}% over)"
        )
        lines.append(
            f"pollen / anchor, {labels[estimate]}: "
            + ", ".join(f"{app} {ratio:.2f}x" for app, ratio in ratios.items())
            + f"; target <= {ANCHOR_TARGET}x: {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--only", nargs="+", choices=VARIANTS + ("cold-start",), default=None)
    parser.add_argument(
        "--no-bytes",
        action="store_true",
        help="skip the 1- and 2-round sign/FP32 runs that measure one round's Fleet traffic",
    )
    parser.add_argument("--probe-repeats", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="anchor: runs of each app (order rotated)")
    parser.add_argument(
        "--node-threads", type=int, default=1, help="OMP_NUM_THREADS of each SuperNode's ClientApps; 0 leaves it unset"
    )
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, results)")
    args = parser.parse_args(argv)
    chosen = args.only or list(VARIANTS) + ["cold-start"]

    root = Path(tempfile.mkdtemp(prefix="pollen-bench-"))
    results: dict[str, Any] = {
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "python": sys.version.split()[0],
            "loadavg_at_start": os.getloadavg()[0],
        },
        "config": {
            "rounds": args.rounds,
            "local_steps": args.local_steps,
            "clients": NUM_CLIENTS,
            "node_threads": args.node_threads,
            "repeats": args.repeats,
        },
    }
    try:
        if "cold-start" in chosen:
            results["cold_start"] = cold_start_probe(args.local_steps, args.probe_repeats, args.node_threads)
        for variant in VARIANTS:
            if variant not in chosen:
                continue
            print(f"[bench] {variant} ...", flush=True)
            if variant == "sim":
                results[variant] = run_simulation(root, args.rounds, args.local_steps)
            elif variant == "anchor":
                results[variant] = run_anchor_comparison(
                    root, args.rounds, args.local_steps, args.repeats, args.node_threads
                )
            else:
                results[variant] = run_deployment(
                    root,
                    variant,
                    args.rounds,
                    args.local_steps,
                    with_bytes=variant == "deploy" and not args.no_bytes,
                    node_threads=args.node_threads,
                )
    finally:
        if args.keep:
            print(f"[bench] logs and results kept in {root}")
        else:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    results["machine"]["loadavg_at_end"] = os.getloadavg()[0]
    text = report(results, args.rounds, args.local_steps)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
