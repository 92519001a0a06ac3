"""The GPU path: pollen's ``flwr run`` simulation on one CUDA GPU, against a plain PyTorch loop on the same GPU.

Stages (``--stage``; each later one is skipped, with a line saying so, once ``--budget-s`` has run out):

- ``tests``: the CUDA tests (training on CUDA against CPU, LocalLAMB on CUDA against CPU) through pytest.
- ``presets``: each ``-full`` preset's first ``--rounds`` rounds through ``flwr run`` (Flower's local
  simulation on Ray, the preset's SuperNodes, ``device=cuda``, ``client-resources-num-gpus=--gpu-share``),
  then a plain PyTorch loop training the same clients on the same GPU: the same partitions, model, batch
  size, local epochs or steps, learning rate, clients per round and the server's test-set evaluation, with
  the data on the GPU, ``torch.optim.SGD`` and FedAvg, clients one after another in one process. The
  plain loop has none of the method's own work (compression, LAMB's trust ratios, gossip, tables): the
  ratio is what pollen's simulation costs over the training itself.
- ``fractions``: ``fedcams-full`` with ``client-resources-num-gpus`` in ``--fractions`` (1: one client on
  the GPU at a time; 0.25: four Ray workers share it).

The machine has no internet, so the data are synthetic files of the real shapes and formats
(:mod:`pollen.testing.synthetic_data`; CIFAR-10 binary batches, Fashion-MNIST IDX files), read through
``data-dir`` like the real ones. Reported per run: seconds per round (median of rounds 2+, and round 1,
from the run's own rows), the GPU's mean utilisation over NVML samples every 0.2 s from the end of round 1
to the end of the run (pollen) or over rounds 2+ (plain loop), and the peak memory in use on the GPU
(NVML, the whole device: every Ray worker's CUDA context counts). A markdown table goes to stdout, every
figure to ``--out`` (JSON) as it comes.

    python benchmarks/gpu/bench_gpu_path.py --stage tests presets fractions --rounds 3 --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PRESETS = ("fedcams-full", "fedadavr-full", "fedlamb-full", "hafed-full", "fedbaca-full")
CUDA_TESTS = ("tests/e2e/test_cuda_training.py", "tests/flower/test_lamb_optimizer.py", "tests/unit/test_task_train.py")


class GpuSampler:
    """NVML samples (utilisation %, memory in use) every ``period`` s in a thread, with their times."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as err:  # noqa: BLE001 - no NVML: the run goes on without utilisation figures
            print(f"note: no NVML ({err}); utilisation and memory are not sampled", flush=True)
            self._nvml = None

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def stopped(self) -> bool:
        """Whether the sampling has ended (the ``with`` block was left)."""
        return self._stop.is_set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            self.samples.append((time.monotonic(), float(util), used / 2**30))
            self._stop.wait(self.period)

    def summary(self, since: float | None = None) -> dict[str, float | None]:
        window = [s for s in self.samples if since is None or s[0] >= since]
        return {
            "gpu_util_mean_pct": round(statistics.fmean(s[1] for s in window), 1) if window else None,
            "gpu_mem_peak_gib": round(max(s[2] for s in self.samples), 2) if self.samples else None,
        }


def make_data(folder: Path) -> Path:
    from pollen.testing.synthetic_data import write_synthetic

    started = time.perf_counter()
    for dataset in ("cifar10", "fashion-mnist"):
        write_synthetic(folder, dataset, seed=0)
    print(f"synthetic CIFAR-10 and Fashion-MNIST written in {time.perf_counter() - started:.1f} s", flush=True)
    return folder


def effective_config(preset: str, overrides: dict[str, Any]) -> Any:
    from pollen.app.config import AppConfig, defaults_from_pyproject

    run_config = {**defaults_from_pyproject(str(REPO / "pyproject.toml")), "preset": preset, **overrides}
    return AppConfig.from_run_config(run_config, given=set(overrides) | {"preset"})


# ------------------------------------------------------------------------------------------ plain loop
def plain_loop(
    preset: str, data_dir: Path, rounds: int, extra: dict[str, Any], device_name: str, optimizer: str = "sgd"
) -> dict[str, Any]:
    """The same clients trained one after another on the GPU by a plain PyTorch loop, FedAvg, test-set eval.

    ``optimizer``: ``"sgd"`` (``torch.optim.SGD``) or ``"lamb"`` (pollen's ``LocalLAMB`` with the run's betas and
    eps, a fresh one per client as Fed-LAMB's local step has: the local training's own cost, without the moments'
    exchange)."""
    import numpy as np
    import torch
    from torch import nn

    from pollen.app.experiment import build_model, data_config
    from pollen.app.preset import load_preset
    from pollen.task.data import partition_indices
    from pollen.task.sources import SPECS, load_raw

    cfg = effective_config(preset, {"data-dir": str(data_dir), **extra})
    nodes = load_preset(preset).supernodes
    device = torch.device(device_name)
    spec = SPECS[cfg["dataset"]]
    raw = load_raw(cfg["dataset"], str(data_dir))

    def to_gpu(x: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(x).to(device).float().div_(255)
        t = t.unsqueeze(1) if t.ndim == 3 else t.permute(0, 3, 1, 2)
        mean = torch.tensor(spec.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(spec.std, device=device).view(1, -1, 1, 1)
        return ((t - mean) / std).contiguous()

    x_train, y_train = to_gpu(raw.x_train), torch.from_numpy(raw.y_train.astype(np.int64)).to(device)
    x_test, y_test = to_gpu(raw.x_test), torch.from_numpy(raw.y_test.astype(np.int64)).to(device)
    parts = [torch.from_numpy(train).to(device) for train, _ in partition_indices(data_config(cfg, nodes))]
    per_round = max(int(nodes * cfg["fraction-train"]), int(cfg["min-train-nodes"]))
    model = build_model(cfg, seed=cfg["seed"]).to(device)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    criterion = nn.CrossEntropyLoss()
    rng = np.random.default_rng(cfg["seed"])
    batch = int(cfg["batch-size"])
    seconds: list[float] = []
    with GpuSampler() as sampler:
        marks = []
        for rnd in range(1, rounds + 1):
            marks.append(time.monotonic())
            started = time.perf_counter()
            total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in global_state.items()}
            weight = 0
            for client in rng.choice(nodes, size=per_round, replace=False):
                idx = parts[int(client)]
                model.load_state_dict(global_state)
                model.train()
                if optimizer == "lamb":
                    from pollen.clientside.lamb import LocalLAMB

                    optimiser = LocalLAMB(
                        model.parameters(),
                        lr=cfg["local-lr"],
                        betas=(cfg["beta-1"], cfg["beta-2"]),
                        weight_decay=cfg["weight-decay"],
                        eps=cfg["eps"],
                    )
                else:
                    optimiser = torch.optim.SGD(
                        model.parameters(),
                        lr=cfg["local-lr"],
                        momentum=cfg["momentum"],
                        weight_decay=cfg["weight-decay"],
                    )
                steps_left = cfg["local-steps"] or None
                epochs = 0 if steps_left else cfg["local-epochs"]
                while (steps_left is not None and steps_left > 0) or epochs > 0:
                    order = idx[torch.randperm(len(idx), device=device)]
                    for start in range(0, len(order), batch):
                        take = order[start : start + batch]
                        optimiser.zero_grad(set_to_none=True)
                        criterion(model(x_train[take]), y_train[take]).backward()
                        optimiser.step()
                        if steps_left is not None:
                            steps_left -= 1
                            if steps_left == 0:
                                break
                    epochs -= 1
                for k, v in model.state_dict().items():
                    total[k] += v.float() * len(idx)
                weight += len(idx)
            global_state = {k: (total[k] / weight).to(v.dtype) for k, v in global_state.items()}
            if cfg["eval-every"] and rnd % int(cfg["eval-every"]) == 0:
                model.load_state_dict(global_state)
                model.eval()
                correct = 0
                with torch.no_grad():
                    for start in range(0, len(x_test), int(cfg["eval-batch-size"])):
                        logits = model(x_test[start : start + int(cfg["eval-batch-size"])])
                        correct += int((logits.argmax(1) == y_test[start : start + len(logits)]).sum())
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
    return {
        "clients_per_round": per_round,
        "round1_s": round(seconds[0], 2),
        "s_per_round": round(statistics.median(seconds[1:]), 2) if len(seconds) > 1 else None,
        **sampler.summary(since=marks[1] if len(marks) > 1 else None),
    }


# ------------------------------------------------------------------------------------------ pollen
def pollen_run(
    flower: Any,
    preset: str,
    data_dir: Path,
    results: Path,
    rounds: int,
    share: float,
    extra: dict[str, Any],
    device: str,
    ray_cpus: int | None = None,
    client_cpus: int | None = None,
) -> dict[str, Any]:
    """``flwr run`` of the preset's first ``rounds`` rounds; ``share``: client-resources-num-gpus (0 on a CPU);
    ``ray_cpus``: the CPUs Ray is told it has (default: the machine's cores); ``client_cpus``: a client's
    share of them (default: 1, or the GPU share's part of the cores)."""
    from pollen.app.preset import load_preset
    from pollen.app.results import load_rows

    nodes = load_preset(preset).supernodes
    run_name = f"{preset}-gpu{share:g}"
    config = {
        "preset": preset,
        "data-dir": str(data_dir),
        "num-server-rounds": rounds,
        "device": device,
        "results-dir": str(results),
        "run-name": run_name,
        **extra,
    }
    run_dir = results / run_name
    cpus = client_cpus or (max(1, int(min(4, (os.cpu_count() or 2) * share))) if share else 1)
    round1_done: list[float] = []
    with GpuSampler() as sampler:

        def watch() -> None:  # the wall-clock end of round 1, from the rows the run writes as it goes
            while not round1_done and not sampler.stopped:
                try:
                    if any(row.get("round") == 1 for row in load_rows(run_dir)):
                        round1_done.append(time.monotonic())
                except (OSError, ValueError, KeyError):
                    pass
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.perf_counter()
        proc = flower.run(
            config, num_supernodes=nodes, client_cpus=cpus, client_gpus=share or None, ray_cpus=ray_cpus, timeout=900
        )
        wall = time.perf_counter() - started
    written = load_rows(run_dir) if (run_dir / "metrics.json").exists() else []
    rows = [row for row in written if row.get("round", 0) >= 1]
    if proc.returncode != 0 or len(rows) < rounds or any(not row.get("replies") for row in rows):
        why = f"rounds written {len(rows)}, replies {[row.get('replies') for row in rows]}; "
        return {"failed": why + proc.stdout[-1000:] + proc.stderr[-1500:], "wall_s": round(wall, 1)}
    steady = [row["round_seconds"] for row in rows[1:]]
    return {
        "supernodes": nodes,
        "client_cpus": cpus,
        "ray_cpus": ray_cpus,
        "round1_s": round(rows[0]["round_seconds"], 2),
        "s_per_round": round(statistics.median(steady), 2) if steady else None,
        "accuracy_last": rows[-1].get("accuracy"),
        "replies": [row.get("replies") for row in rows],
        "failures": [row.get("failures") for row in rows],
        "wall_s": round(wall, 1),
        **sampler.summary(since=round1_done[0] if round1_done else None),
    }


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", nargs="+", choices=("tests", "presets", "fractions"), default=["tests", "presets"])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-share", type=float, default=0.25)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125])
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new run after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("gpu-path.json"))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on a machine without a GPU")
    parser.add_argument(
        "--plain-optimizer",
        choices=("sgd", "lamb"),
        default="sgd",
        help="the plain loop's local optimiser; lamb: pollen's LocalLAMB (the same local training as Fed-LAMB's)",
    )
    parser.add_argument(
        "--ray-cpus",
        type=int,
        default=None,
        help="CPUs Ray is told it has in pollen's runs (5 on 2 cores: five clients at once)",
    )
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=None,
        help="client-resources-num-cpus of pollen's runs (2 on 2 cores: one client at a time, two torch threads)",
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides for both sides (smoke runs)"
    )
    args = parser.parse_args()
    for flag, value in (("--client-cpus", args.client_cpus), ("--ray-cpus", args.ray_cpus)):
        if value is not None and value < 1:
            parser.error(f"{flag}={value} is out of range; allowed: an integer >= 1 (or leave it out)")
    began = time.perf_counter()
    extra = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    if args.device == "cpu":
        args.gpu_share, args.fractions = 0.0, []
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    def in_budget(what: str) -> bool:
        if time.perf_counter() - began < args.budget_s:
            return True
        print(f"skipped (budget): {what}", flush=True)
        report.setdefault("skipped", []).append(what)
        save()
        return False

    import torch

    report["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    report["torch"] = torch.__version__
    print(f"device: {report['device']}, torch {torch.__version__}", flush=True)
    if "tests" in args.stage:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs", *CUDA_TESTS],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        report["tests"] = {"returncode": proc.returncode, "tail": proc.stdout[-2500:] + proc.stderr[-1000:]}
        print(proc.stdout[-2500:], proc.stderr[-1000:], flush=True)
        save()
    if not {"presets", "fractions"} & set(args.stage):
        return
    from pollen.testing.flwr_cli import LocalFlower

    with tempfile.TemporaryDirectory(prefix="pollen-gpu-") as tmp:
        folder = Path(tmp)
        data_dir = make_data(folder / "data")
        flower = LocalFlower(folder / "flwr-home")
        try:

            def preset_pair(preset: str) -> None:
                if not in_budget(f"{preset} (pollen)"):
                    return
                ours = pollen_run(
                    flower,
                    preset,
                    data_dir,
                    folder / "results",
                    args.rounds,
                    args.gpu_share,
                    extra,
                    args.device,
                    args.ray_cpus,
                    args.client_cpus,
                )
                report.setdefault("presets", {})[preset] = {"pollen": ours}
                print(f"{preset} pollen gpu-share {args.gpu_share:g}: {ours}", flush=True)
                save()
                if in_budget(f"{preset} (plain loop)"):
                    plain = plain_loop(preset, data_dir, args.rounds, extra, args.device, args.plain_optimizer)
                    report["presets"][preset]["plain"] = plain
                    print(f"{preset} plain PyTorch loop: {plain}", flush=True)
                    save()

            presets = args.presets if "presets" in args.stage else []
            if presets:  # the first preset, then the fractions, then the rest: the budget keeps what matters most
                preset_pair(presets[0])
            if "fractions" in args.stage:
                for share in args.fractions:
                    if "fedcams-full" in report.get("presets", {}) and share == args.gpu_share:
                        report.setdefault("fractions", {})[f"{share:g}"] = report["presets"]["fedcams-full"]["pollen"]
                        continue
                    if not in_budget(f"fedcams-full at num-gpus {share:g}"):
                        break
                    result = pollen_run(
                        flower,
                        "fedcams-full",
                        data_dir,
                        folder / "results",
                        args.rounds,
                        share,
                        extra,
                        args.device,
                        args.ray_cpus,
                        args.client_cpus,
                    )
                    report.setdefault("fractions", {})[f"{share:g}"] = result
                    print(f"fedcams-full gpu-share {share:g}: {result}", flush=True)
                    save()
            for preset in presets[1:]:
                preset_pair(preset)
        finally:
            flower.stop()
    print_tables(report)
    report["total_s"] = round(time.perf_counter() - began, 1)
    save()


def print_tables(report: dict[str, Any]) -> None:
    print(
        "\n| preset | clients/round | pollen s/round | plain loop s/round | ratio | pollen round 1 s | "
        "GPU util pollen / plain | peak GPU memory pollen / plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for preset, both in report.get("presets", {}).items():
        ours, plain = both.get("pollen", {}), both.get("plain", {})
        if "failed" in ours:
            print(f"| {preset} | failed: {ours['failed'][-200:]!r} |")
            continue
        ratio = "-"
        if ours.get("s_per_round") and plain.get("s_per_round"):
            ratio = f"{ours['s_per_round'] / plain['s_per_round']:.2f}x"
        util = f"{ours.get('gpu_util_mean_pct')}% / {plain.get('gpu_util_mean_pct')}%"
        memory = f"{ours.get('gpu_mem_peak_gib')} / {plain.get('gpu_mem_peak_gib')} GiB"
        print(
            f"| {preset} | {plain.get('clients_per_round')} | {ours.get('s_per_round')} | {plain.get('s_per_round')} | "
            f"{ratio} | {ours.get('round1_s')} | {util} | {memory} |"
        )
    if report.get("fractions"):
        print("\n| client-resources-num-gpus | s/round | round 1 s | GPU util | peak GPU memory |")
        print("|---|---|---|---|---|")
        for share, result in report["fractions"].items():
            if "failed" in result:
                print(f"| {share} | failed: {result['failed'][-200:]!r} |")
                continue
            print(
                f"| {share} | {result.get('s_per_round')} | {result.get('round1_s')} | "
                f"{result.get('gpu_util_mean_pct')}% | {result.get('gpu_mem_peak_gib')} GiB |"
            )


if __name__ == "__main__":
    main()
