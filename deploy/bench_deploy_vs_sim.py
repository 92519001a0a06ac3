"""Seconds per round and bytes on the wire: the same 2-client run in deployment and in simulation.

    python deploy/bench_deploy_vs_sim.py                 # everything, about 10-15 min on 2 CPU cores
    python deploy/bench_deploy_vs_sim.py --rounds 3 --only deploy sim --json out.json

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

Reported per variant: median seconds per round from round 2 on (the app's ``round_seconds``: configure, local
training, replies, aggregation and server-side evaluation), the run's wall time, and for the
deployment variants where the per-message time goes, from time-stamped SuperNode logs:
SuperNode receives a message -> ``flwr-clientapp`` has started and imported flwr -> the ClientApp has
trained -> the SuperNode sends the reply. Bytes: the app's uplink counts (``uplink_update_bytes``,
``uplink_fp32_bytes``, measured from the records) and the SuperLink's own Fleet API traffic counter
(``flwr list --format json``: ``network-traffic``) for one round, as the difference between a
2-round and a 1-round run, with scaled-sign and with FP32 (``compressor='none'``) uplink. A cold-start probe times, in a fresh interpreter,
what each ``flwr-clientapp`` process pays before training: imports and data/model set-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_federation as lf  # noqa: E402

CONNECTION = "bench"
NUM_CLIENTS = 2
VARIANTS = ("deploy", "deploy-fastpoll", "deploy-process", "sim")


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


def flwr_run(procs: lf.Processes, env: dict[str, str], config: dict[str, Any], federation_config: str | None = None, timeout: float = 1200) -> dict[str, Any]:
    argv = [lf.exe("flwr"), "run", ".", CONNECTION, "--stream", "--run-config", lf.run_config_arg(config)]
    if federation_config:
        argv += ["--federation-config", federation_config]
    start = time.time()
    code, out = procs.run(f"flwr-run-{config['run-name']}", argv, timeout=timeout, env=env, cwd=lf.REPO_ROOT, timestamps=True)
    wall = time.time() - start
    match = re.search(r"Successfully started run (\d+)", out)
    if code != 0 or not match:
        raise RuntimeError(f"flwr run failed (exit {code}):\n{lf.tail(out)}")
    status = lf.run_status(procs, CONNECTION, env, run_id=match.group(1))
    metrics = lf.load_metrics(Path(config["results-dir"]), config["run-name"])
    rows = [row for row in metrics["rows"] if row["round"] >= 1]
    if status["status"] != "finished:completed" or len(rows) != config["num-server-rounds"]:
        raise RuntimeError(f"run {match.group(1)} did not complete: {status['status']} {status.get('status-details')}\n{lf.tail(out)}")
    first = rows[0]
    return {
        "run_id": match.group(1),
        "started_at": start,
        "wall_seconds": wall,
        "round_seconds": [row["round_seconds"] for row in rows],
        "median_round_seconds": statistics.median(row["round_seconds"] for row in rows),
        "steady_round_seconds": statistics.median(row["round_seconds"] for row in rows[1:]) if len(rows) > 1 else rows[0]["round_seconds"],
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
    ("trained", re.compile(r"\[pollen\] \S+ trained")),
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


def message_phases(logs: list[Path], since: float) -> list[dict[str, float]]:
    """Per train message on one SuperNode: seconds between receive, clientapp start, trained, reply sent."""
    messages, current = [], None
    for stamp, text in _timed_lines(*logs):
        if stamp < since:
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


# --------------------------------------------------------------------------- variants


def run_deployment(root: Path, variant: str, rounds: int, local_steps: int, with_bytes: bool) -> dict[str, Any]:
    home = root / variant
    extra_env = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"} if variant == "deploy-fastpoll" else {}
    isolation = "process" if variant == "deploy-process" else "subprocess"
    with lf.Processes(home / "logs") as procs, lf.dump_logs_on_error(procs, lines=40):
        http_port, fleet_port, *runtime_ports = lf.free_ports(2 + NUM_CLIENTS)
        superlink = procs.start(
            "superlink",
            lf.superlink_argv(http_port=http_port, fleet_port=fleet_port),
            env=lf.flower_env(home / "home-superlink", **extra_env),
            timestamps=True,
        )
        lf.wait_until(lambda: superlink.poll() is None and lf.port_is_open(http_port) and lf.port_is_open(fleet_port), 90, "the SuperLink")
        user_env = lf.flower_env(home / "home-user")
        lf.write_connection(home / "home-user", CONNECTION, f"127.0.0.1:{http_port}", insecure=True)
        node_logs: list[list[Path]] = []
        for i in range(NUM_CLIENTS):
            env = lf.flower_env(home / f"home-supernode-{i}", **extra_env)
            node = procs.start(
                f"supernode-{i}",
                lf.supernode_argv(
                    superlink=f"127.0.0.1:{fleet_port}",
                    runtime_port=runtime_ports[i],
                    node_config=f"partition-id={i} num-partitions={NUM_CLIENTS} device='cpu'",
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
                    [lf.exe("flower-superexec"), "--insecure", "--runtime-api-address", f"127.0.0.1:{runtime_ports[i]}"],
                    env=env,
                    timestamps=True,
                )
                logs.append(executor.log_path)
            node_logs.append(logs)
        lf.wait_until(lambda: lf.online_nodes(procs, CONNECTION, user_env) >= NUM_CLIENTS, 120, "SuperNodes online", interval=1.0)

        results = home / "results"
        sign = flwr_run(procs, user_env, app_config(rounds, local_steps, f"{variant}-sign", results))
        phases = [p for logs in node_logs for p in message_phases(logs, since=sign["started_at"])]
        out: dict[str, Any] = {"variant": variant, "isolation": isolation, "env": extra_env, "sign": sign}
        out["message_phases_median"] = _median_phases(phases)
        out["messages_timed"] = len(phases)
        if with_bytes:
            out["bytes_per_round"] = wire_bytes_per_round(procs, user_env, local_steps, results, variant)
        return out


def wire_bytes_per_round(procs: lf.Processes, env: dict[str, str], local_steps: int, results: Path, variant: str) -> dict[str, Any]:
    """SuperLink Fleet traffic of one round, scaled sign vs FP32 uplink: a 2-round run minus a 1-round run.

    The difference cancels what every run has once (the identify query, the first pull of the
    FAB's run info), leaving exactly one round's Fleet API traffic as the SuperLink counts it.
    """
    out = {}
    for compressor in ("sign", "none"):
        runs = {r: flwr_run(procs, env, app_config(r, local_steps, f"{variant}-bytes-{compressor}-{r}", results, compressor=compressor)) for r in (1, 2)}
        one, two = runs[1], runs[2]
        out[compressor] = {
            "fleet_inbound_bytes": two["superlink_traffic"]["inbound-bytes"] - one["superlink_traffic"]["inbound-bytes"],
            "fleet_outbound_bytes": two["superlink_traffic"]["outbound-bytes"] - one["superlink_traffic"]["outbound-bytes"],
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
        superlink = procs.start("superlink-sim", lf.superlink_argv(http_port=http_port, fleet_port=0, simulation=True), env=env)
        lf.wait_until(lambda: superlink.poll() is None and lf.port_is_open(http_port), 90, "the simulation SuperLink")
        lf.write_connection(home / "home", CONNECTION, f"127.0.0.1:{http_port}", insecure=True)
        run = flwr_run(
            procs,
            env,
            app_config(rounds, local_steps, "sim-sign", home / "results"),
            federation_config=f"num-supernodes={NUM_CLIENTS} client-resources-num-cpus=1",
        )
        return {"variant": "sim", "sign": run}


_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import flwr.supernode.runtime.run_clientapp  # what flwr-clientapp imports before it pulls the message
t1 = time.perf_counter()
import torch, pollen.client_app
from pollen.task.train import train
t2 = time.perf_counter()
from flwr.app import Context, RecordDict
from pollen.config import defaults_from_pyproject
run_config = {**defaults_from_pyproject(sys.argv[1]), **json.loads(sys.argv[2])}
context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2, "device": "cpu"},
                  state=RecordDict(), run_config=run_config)
task = pollen.client_app.LocalTask(context)
loader, _ = task.loaders(32)
t3 = time.perf_counter()
train(task.model, loader, lr=0.01, local_steps=int(run_config["local-steps"]), local_epochs=None, momentum=0.0,
      weight_decay=0.0, device=task.device, seed=1)
t4 = time.perf_counter()
print(json.dumps({"import_flwr_clientapp": t1 - t0, "import_torch_pollen": t2 - t1, "data_and_model": t3 - t2, "train": t4 - t3}))
"""


def cold_start_probe(local_steps: int, repeats: int) -> dict[str, Any]:
    """What a fresh ``flwr-clientapp`` pays before and during training, in a new interpreter each time."""
    overrides = {"model": "cnn", "local-steps": local_steps}
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(lf.REPO_ROOT / "pyproject.toml"), json.dumps(overrides)],
            capture_output=True, text=True, check=True, cwd=lf.REPO_ROOT, timeout=300,
        )
        sample = json.loads(done.stdout.strip().splitlines()[-1])
        sample["process_total"] = time.perf_counter() - start
        samples.append(sample)
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]} | {"repeats": repeats}


# --------------------------------------------------------------------------- report


def _fmt_bytes(n: float) -> str:
    return f"{n / 1000:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def report(results: dict[str, Any], rounds: int, local_steps: int) -> str:
    machine = results["machine"]
    lines = [
        f"pollen deployment vs simulation: {NUM_CLIENTS} clients, FedCAMS sign, CNN, {local_steps} local steps, {rounds} rounds",
        f"machine: {machine['cpus']} CPUs, load average {machine['loadavg_at_start']:.1f} at start, {machine.get('loadavg_at_end', float('nan')):.1f} at end",
        "",
    ]
    lines.append(f"{'variant':<17} {'s/round, rounds 2+ (median)':>28}   {'each round (s)':<30} {'flwr run wall (s)':>17}")
    for name in VARIANTS:
        if name not in results:
            continue
        run = results[name]["sign"]
        rounds_txt = " ".join(f"{s:.1f}" for s in run["round_seconds"])
        lines.append(f"{name:<17} {run['steady_round_seconds']:>28.2f}   {rounds_txt:<30} {run['wall_seconds']:>17.1f}")
    lines.append("")
    for name in VARIANTS:
        phases = results.get(name, {}).get("message_phases_median")
        if phases:
            lines.append(
                f"{name:<17} per train message (median of {results[name]['messages_timed']}): "
                f"receive->clientapp up {phases['receive_to_clientapp_started']:.2f}s, "
                f"up->trained {phases['clientapp_started_to_trained']:.2f}s, "
                f"trained->reply sent {phases['trained_to_reply_sent']:.2f}s, "
                f"total {phases['receive_to_reply_sent']:.2f}s; rest of the round "
                f"(aggregation, server-side evaluation, 3 s polling loops) {results[name]['sign']['steady_round_seconds'] - phases['receive_to_reply_sent']:.2f}s"
            )
    if "cold_start" in results:
        c = results["cold_start"]
        lines.append(
            f"cold start of one ClientApp process (fresh interpreter, median of {c['repeats']}): "
            f"import flwr clientapp {c['import_flwr_clientapp']:.2f}s + import torch/pollen {c['import_torch_pollen']:.2f}s "
            f"+ data/model set-up {c['data_and_model']:.2f}s; training {c['train']:.2f}s; process total {c['process_total']:.2f}s"
        )
    per_round = results.get("deploy", {}).get("bytes_per_round")
    if per_round:
        lines.append("")
        lines.append(f"one round, {NUM_CLIENTS} clients (SuperLink Fleet API counter: 2-round run minus 1-round run; app: counted from the records)")
        lines.append(f"{'uplink codec':<14} {'Fleet in (uplink)':>18} {'Fleet out (downlink)':>21} {'app uplink':>11} {'app update/reply':>17} {'app downlink':>13}")
        for kind, label in (("sign", "scaled sign"), ("none", "fp32")):
            b = per_round[kind]
            lines.append(
                f"{label:<14} {_fmt_bytes(b['fleet_inbound_bytes']):>18} {_fmt_bytes(b['fleet_outbound_bytes']):>21} "
                f"{_fmt_bytes(b['app_uplink_bytes']):>11} {_fmt_bytes(b['app_uplink_update_bytes_per_reply']):>17} {_fmt_bytes(b['app_downlink_bytes']):>13}"
            )
        ratio = per_round["none"]["fleet_inbound_bytes"] / per_round["sign"]["fleet_inbound_bytes"]
        update_ratio = per_round["sign"]["app_uplink_fp32_bytes_per_reply"] / per_round["sign"]["app_uplink_update_bytes_per_reply"]
        lines.append(f"uplink FP32/sign: x{ratio:.1f} on the wire (Fleet inbound), x{update_ratio:.1f} for the model update alone")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--only", nargs="+", choices=VARIANTS + ("cold-start",), default=None)
    parser.add_argument("--no-bytes", action="store_true", help="skip the 1- and 2-round sign/FP32 runs that measure one round's Fleet traffic")
    parser.add_argument("--probe-repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, results)")
    args = parser.parse_args(argv)
    chosen = args.only or list(VARIANTS) + ["cold-start"]

    root = Path(tempfile.mkdtemp(prefix="pollen-bench-"))
    results: dict[str, Any] = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0], "loadavg_at_start": os.getloadavg()[0]},
        "config": {"rounds": args.rounds, "local_steps": args.local_steps, "clients": NUM_CLIENTS},
    }
    try:
        if "cold-start" in chosen:
            results["cold_start"] = cold_start_probe(args.local_steps, args.probe_repeats)
        for variant in VARIANTS:
            if variant not in chosen:
                continue
            print(f"[bench] {variant} ...", flush=True)
            if variant == "sim":
                results[variant] = run_simulation(root, args.rounds, args.local_steps)
            else:
                results[variant] = run_deployment(root, variant, args.rounds, args.local_steps, with_bytes=variant == "deploy" and not args.no_bytes)
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
