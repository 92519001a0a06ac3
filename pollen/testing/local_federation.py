"""Start a real Flower federation on this machine: a SuperLink, SuperNodes, ``flwr`` commands.

Used by ``tests/e2e/test_deploy_e2e.py`` and ``benchmarks/deploy/bench_deploy_vs_sim.py``, and handy to try
``deploy/`` on one machine before putting the pieces on several. Everything listens on
127.0.0.1 only, on ports picked free at run time, and every process started here is owned by a
:class:`Processes` object that stops it (its whole process tree) on ``stop_all()`` or on leaving
the ``with`` block, also when an exception is raised.

The command lines built here are the ones ``deploy/README.md`` documents for real machines; only
the addresses differ. They follow the installed Flower line: up to 1.39 the Fleet API (what SuperNodes
dial) is gRPC-rere on its own port; from 1.40 a SuperNode speaks only HTTP, to the SuperLink's one HTTP
server (``--host/--port``, beside the Control and Runtime APIs), and the SuperLink keeps a gRPC Fleet only
behind Flower's switch ``FLWR_INTERNAL_GRPC_FLEET_API=1`` (for SuperNodes of 1.39: a mixed federation).

Linux only (the process-tree walk reads ``/proc``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The checkout this module runs from (the deployment kit and the app live there).
REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
SCRIPTS_DIR = DEPLOY_DIR / "scripts"
#: Directory holding ``flower-superlink``, ``flower-supernode`` and ``flwr`` of this interpreter.
BIN_DIR = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"
#: Fleet API transports: ``grpc`` (gRPC-rere on ``--fleet-api-address``) or ``http`` (Flower >= 1.40).
FLEETS = ("grpc", "http")
#: Flower's switch (1.40 and later) that makes a SuperLink serve the deprecated gRPC Fleet API as well.
GRPC_FLEET_SWITCH = "FLWR_INTERNAL_GRPC_FLEET_API"


def flower_line(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version``, by default of the Flower installed here (``"1.42.0"`` -> ``(1, 42)``)."""
    if version is None:
        from importlib.metadata import version as installed

        version = installed("flwr")
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def http_fleet(line: tuple[int, int] | None = None) -> bool:
    """Whether SuperNodes of Flower ``line`` (default: the installed one) dial the Fleet API over HTTP."""
    return (line or flower_line()) >= (1, 40)


def default_fleet() -> str:
    """The Fleet transport this environment's own SuperNodes speak: ``http`` from 1.40, ``grpc`` before."""
    return "http" if http_fleet() else "grpc"


# --------------------------------------------------------------------------- ports


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_is_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll ``predicate`` until it returns something truthy; ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# --------------------------------------------------------------------------- processes


def _children(pid: int) -> list[int]:
    """Child pids of ``pid``; none once it has exited (even half-way through reading /proc)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    except OSError:  # the process exited while its task directory was listed
        return out
    for task in tasks:
        with contextlib.suppress(OSError):
            out += [int(p) for p in task.read_text().split()]
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (parents first)."""
    seen, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        if current in seen or not Path(f"/proc/{current}").exists():
            continue
        seen.append(current)
        todo += _children(current)
    return seen


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (to tell a process from a later one that reuses its id)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    state = None
    with contextlib.suppress(OSError, IndexError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state is not None and state != "Z" and _start_time(pid) == start


@dataclass
class Proc:
    """One started command: its ``Popen``, its log file and what it was started for."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path
    known: dict[int, str | None] = field(default_factory=dict)  # descendants seen, with start times
    copier: threading.Thread | None = None  # copies output with time stamps (timestamps=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def remember_tree(self) -> None:
        for pid in process_tree(self.pid):
            self.known.setdefault(pid, _start_time(pid))

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_output(self, needle: str, timeout: float) -> str:
        """Wait until ``needle`` appears in the log; ``TimeoutError`` (with the log) otherwise."""

        def seen() -> bool:
            self.remember_tree()
            return needle in self.output()

        try:
            wait_until(seen, timeout, f"{needle!r} in the output of {self.name}")
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n--- {self.name} output ---\n{tail(self.output())}") from None
        return self.output()


def _copy_with_timestamps(stream: Any, log_path: Path) -> None:
    with open(log_path, "ab", buffering=0) as log:
        for line in iter(stream.readline, b""):
            log.write(f"{time.time():.3f} ".encode() + line)


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Processes:
    """Owns the processes it starts; ``stop_all()`` ends each process tree, children first.

    Every process starts in its own session (process group). Stopping sends SIGTERM to the group
    and to every descendant seen (Flower detaches some helpers, e.g. the SuperLink's SuperExec,
    into their own sessions), waits, then SIGKILLs what is left.
    """

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env if env is not None else os.environ)
        self.procs: list[Proc] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timestamps: bool = False,
    ) -> Proc:
        """Start ``argv`` in its own session, output to ``<log_dir>/<name>.log``.

        ``timestamps=True`` prefixes each output line with the wall-clock time it was read
        (``time.time()``, 3 decimals), for latency breakdowns.
        """
        log_path = self.log_dir / f"{name}.log"
        count = 1
        while log_path.exists():  # one log per start, so a polled command's output is its own
            count += 1
            log_path = self.log_dir / f"{name}-{count}.log"
        full_env = dict(self.env)
        full_env.update(env or {})
        with open(log_path, "wb") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if timestamps else log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(name=name, argv=list(argv), popen=popen, log_path=log_path)
        if timestamps:
            proc.copier = threading.Thread(target=_copy_with_timestamps, args=(popen.stdout, log_path), daemon=True)
            proc.copier.start()
        proc.known[popen.pid] = _start_time(popen.pid)
        self.procs.append(proc)
        return proc

    def run(
        self,
        name: str,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timestamps: bool = False,
    ) -> tuple[int, str]:
        """Run a command to completion (killed after ``timeout`` s); ``(returncode, output)``."""
        proc = self.start(name, argv, env=env, cwd=cwd, timestamps=timestamps)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            for other in self.procs:  # note helpers that detach (Ray, SuperExec) while they live
                if other.poll() is None:
                    other.remember_tree()
            time.sleep(0.5)
        if proc.poll() is None:
            self.stop(proc)
            raise TimeoutError(f"{name} did not finish within {timeout:.0f}s\n--- output ---\n{tail(proc.output())}")
        if proc.copier is not None:
            proc.copier.join(timeout=10)
        return proc.popen.returncode, proc.output()

    def stop(self, proc: Proc, grace: float = 10.0) -> int | None:
        proc.remember_tree()
        targets = {pid: start for pid, start in proc.known.items() if _alive(pid, start)}
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        for pid, start in targets.items():
            if pid != proc.pid and _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p, s) for p, s in targets.items())):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid, start in targets.items():
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)
        return proc.popen.returncode

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)

    def leftovers(self) -> list[int]:
        """Processes started here (or seen as their descendants) that are still alive."""
        return [pid for proc in self.procs for pid, start in proc.known.items() if _alive(pid, start)]

    def logs(self, lines: int = 80) -> str:
        return "\n".join(f"===== {p.name} ({p.log_path}) =====\n{tail(p.output(), lines)}" for p in self.procs)


def wait_for_superlink(superlink: Proc, *ports: int, timeout: float = 90) -> None:
    """Wait until ``superlink`` listens on every one of ``ports``; ``RuntimeError`` with its log if it exits."""

    def listening() -> bool:
        if superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {superlink.poll()}:\n{tail(superlink.output())}")
        superlink.remember_tree()
        return all(port_is_open(port) for port in ports)

    wait_until(listening, timeout, f"the SuperLink to listen on ports {', '.join(map(str, ports))}")


# --------------------------------------------------------------------------- environment and files


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """Environment for Flower commands: this interpreter's bin first, FLWR_HOME, no uv sync, no phoning home."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def write_connection(
    flwr_home: Path,
    name: str,
    address: str,
    root_certificates: Path | None = None,
    insecure: bool = False,
    default: bool = True,
) -> Path:
    """Add a ``[superlink.<name>]`` connection to ``<flwr_home>/config.toml`` (the 1.39 way)."""
    flwr_home = Path(flwr_home)
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    text = path.read_text() if path.exists() else ""
    if "[superlink]" not in text:
        text = "[superlink]\n" + (f'default = "{name}"\n' if default else "") + "\n" + text
    entry = f'\n[superlink.{name}]\naddress = "{address}"\n'
    if root_certificates is not None:
        entry += f'root-certificates = "{Path(root_certificates).resolve()}"\n'
    if insecure:
        entry += "insecure = true\n"
    path.write_text(text + entry)
    return path


def make_certs(out_dir: Path, *sans: str, bits: int = 4096) -> dict[str, Path]:
    """Run ``deploy/scripts/make_certs.sh``; paths of ca.crt, server.pem, server.key."""
    subprocess.run(
        ["bash", str(SCRIPTS_DIR / "make_certs.sh"), "-o", str(out_dir), "-b", str(bits), *sans],
        check=True,
        capture_output=True,
    )
    return {name: Path(out_dir) / name for name in ("ca.crt", "server.pem", "server.key")}


def make_supernode_keys(out_dir: Path, *names: str, env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Run ``deploy/scripts/make_supernode_keys.sh``; ``{name: private key path}`` (public key: ``.pub``)."""
    subprocess.run(
        ["bash", str(SCRIPTS_DIR / "make_supernode_keys.sh"), "-o", str(out_dir), *names],
        check=True,
        capture_output=True,
        env=env,
    )
    return {name: Path(out_dir) / name for name in names}


def snapshot_app(dest: Path, app: Path = REPO_ROOT) -> Path:
    """Copy the files ``flwr run <app>`` would package (the FAB's content) to ``dest``; returns ``dest``.

    ``flwr run`` builds the FAB from the app directory at each call, so runs started one after the
    other pick up whatever changed in between. Runs started from the snapshot all get the same FAB
    (same hash), e.g. a run and its resumption. (``pollen.app.sweep.snapshot_app`` does the work.)
    """
    from pollen.app.sweep import snapshot_app as snapshot

    return snapshot(Path(app), Path(dest))


# --------------------------------------------------------------------------- command lines


def exe(name: str) -> str:
    path = BIN_DIR / name
    return str(path) if path.exists() else name


def superlink_argv(
    *,
    http_port: int,
    fleet_port: int,
    host: str = LOOPBACK,
    certs: Mapping[str, Path] | None = None,
    supernode_auth: bool = False,
    simulation: bool = False,
    database: Path | None = None,
    fleet: str | None = None,
    bin_dir: Path | None = None,
    line: tuple[int, int] | None = None,
) -> list[str]:
    """``flower-superlink``: Control + Runtime HTTP API on ``host:http_port``; the Fleet API per ``fleet``.

    ``fleet="grpc"`` (the default up to Flower 1.39): gRPC-rere on ``host:fleet_port``; on Flower 1.40 and
    later through Flower's switch (the command starts with ``env FLWR_INTERNAL_GRPC_FLEET_API=1``), for
    SuperNodes of 1.39. ``fleet="http"`` (the default from 1.40): on the HTTP server itself, ``fleet_port``
    unused. ``bin_dir`` and ``line``: a SuperLink of another environment, as for :func:`supernode_argv`.
    """
    line = line or flower_line()
    fleet = fleet or ("http" if http_fleet(line) else "grpc")
    if fleet not in FLEETS:
        raise ValueError(f"fleet={fleet!r} is unknown; allowed: {', '.join(FLEETS)}")
    if fleet == "http" and not http_fleet(line):
        raise ValueError(f"fleet='http' needs Flower 1.40 or later; this is {'.'.join(map(str, line))}")
    argv = [str(Path(bin_dir) / "flower-superlink") if bin_dir is not None else exe("flower-superlink")]
    if fleet == "grpc" and http_fleet(line) and not simulation:
        argv = ["env", f"{GRPC_FLEET_SWITCH}=1", *argv]
    if certs is None:
        argv.append("--insecure")
    else:
        argv += [
            "--ssl-ca-certfile",
            str(certs["ca.crt"]),
            "--ssl-certfile",
            str(certs["server.pem"]),
            "--ssl-keyfile",
            str(certs["server.key"]),
        ]
    if supernode_auth:
        argv.append("--enable-supernode-auth")
    if simulation:
        argv.append("--simulation")
    elif fleet == "grpc":
        argv += ["--fleet-api-type", "grpc-rere", "--fleet-api-address", f"{host}:{fleet_port}"]
    argv += ["--host", host, "--port", str(http_port), "--disable-runtime-dependency-installation"]
    if database is not None:
        argv += ["--database", str(database)]
    return argv


def fleet_address(http_port: int, fleet_port: int, fleet: str | None = None, host: str = LOOPBACK) -> str:
    """The address SuperNodes dial: the gRPC Fleet's port, or (``fleet="http"``) the SuperLink's HTTP port."""
    return f"{host}:{http_port if (fleet or default_fleet()) == 'http' else fleet_port}"


def superlink_ports(http_port: int, fleet_port: int, fleet: str | None = None) -> tuple[int, ...]:
    """The ports a SuperLink started by :func:`superlink_argv` listens on (for :func:`wait_for_superlink`)."""
    return (http_port,) if (fleet or default_fleet()) == "http" else (http_port, fleet_port)


def supernode_argv(
    *,
    superlink: str,
    runtime_port: int,
    node_config: str | None = None,
    root_certificates: Path | None = None,
    private_key: Path | None = None,
    insecure: bool = False,
    max_retries: int | None = None,
    max_wait_time: float | None = None,
    isolation: str = "subprocess",
    bin_dir: Path | None = None,
    line: tuple[int, int] | None = None,
) -> list[str]:
    """``flower-supernode`` dialling ``superlink`` (the Fleet API address); its own Runtime API on
    127.0.0.1:``runtime_port``.

    ``bin_dir`` and ``line``: a SuperNode of another environment (its ``bin`` folder and Flower line, e.g. a
    1.39 SuperNode of a mixed federation); by default this interpreter's. Up to 1.39 it is told
    ``--grpc-rere``; from 1.40 it speaks only HTTP and takes no transport flag.
    """
    program = str(Path(bin_dir) / "flower-supernode") if bin_dir is not None else exe("flower-supernode")
    argv = [program, "--superlink", superlink]
    if not http_fleet(line):
        argv.append("--grpc-rere")
    if insecure:
        argv.append("--insecure")
    if root_certificates is not None:
        argv += ["--root-certificates", str(root_certificates)]
    if private_key is not None:
        argv += ["--auth-supernode-private-key", str(private_key)]
    argv += ["--host", LOOPBACK, "--port", str(runtime_port), "--isolation", isolation]
    if node_config:
        argv += ["--node-config", node_config]
    if max_retries is not None:
        argv += ["--max-retries", str(max_retries)]
    if max_wait_time is not None:
        argv += ["--max-wait-time", str(max_wait_time)]
    return argv


def run_config_arg(config: Mapping[str, Any]) -> str:
    """``{"strategy": "fedcams", "num-server-rounds": 2}`` -> ``strategy='fedcams' num-server-rounds=2``."""

    def fmt(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return f"'{value}'"
        return repr(value)

    return " ".join(f"{key}={fmt(value)}" for key, value in config.items())


# --------------------------------------------------------------------------- flwr CLI helpers


def flwr_json(
    procs: Processes, name: str, args: Sequence[str], env: Mapping[str, str], timeout: float = 60
) -> dict[str, Any]:
    """Run ``flwr <args> --format json`` and parse the JSON object it prints."""
    code, out = procs.run(name, [exe("flwr"), *args, "--format", "json"], timeout=timeout, env=env)
    start = out.find("{")
    if code != 0 or start < 0:
        raise RuntimeError(f"flwr {' '.join(args)} failed (exit {code}):\n{tail(out)}")
    return json.loads(out[start : out.rfind("}") + 1])


def list_nodes(procs: Processes, connection: str, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """``flwr supernode list <connection> --format json``: registered SuperNodes and their status."""
    return flwr_json(procs, "flwr-supernode-list", ["supernode", "list", connection], env).get("nodes", [])


def online_nodes(procs: Processes, connection: str, env: Mapping[str, str]) -> int:
    return sum(node.get("status") == "online" for node in list_nodes(procs, connection, env))


def node_count(procs: Processes, connection: str, env: Mapping[str, str]) -> int:
    return len(list_nodes(procs, connection, env))


def run_status(procs: Processes, connection: str, env: Mapping[str, str], run_id: str | None = None) -> dict[str, Any]:
    """The newest run (or ``run_id``) as ``flwr ls --format json`` reports it."""
    args = ["ls", connection] + (["--run-id", run_id] if run_id else [])
    runs = flwr_json(procs, "flwr-ls", args, env).get("runs", [])
    if not runs:
        raise RuntimeError("flwr ls reported no runs")
    return runs[0] if run_id else max(runs, key=lambda r: r.get("pending-at") or "")


def run_traffic(procs: Processes, connection: str, env: Mapping[str, str], run_id: str) -> dict[str, int]:
    """The SuperLink's byte counts of one run (``flwr ls --run-id <id> --format json``).

    ``inbound``: bytes the SuperLink's Fleet API received from SuperNodes (pushed messages and
    objects, pull requests); ``outbound``: bytes it sent them (pulled messages and objects).
    Traffic between the SuperLink and the ServerApp is not counted.
    """
    traffic = run_status(procs, connection, env, run_id=run_id)["network-traffic"]
    return {"inbound": int(traffic["inbound-bytes"]), "outbound": int(traffic["outbound-bytes"])}


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def find_in_tree(proc: Proc, program: str) -> list[int]:
    """Live processes of ``proc``'s tree whose command line names ``program`` (e.g. ``flwr-serverapp``).

    Matches an argument ending in ``program`` (the executable, or the script a Python interpreter runs).
    The tree is remembered first, so whatever is found here is also stopped by :meth:`Processes.stop`.
    """
    proc.remember_tree()
    found = []
    for pid in process_tree(proc.pid):
        if any(Path(arg).name == program for arg in cmdline(pid)[:2]):
            found.append(pid)
    return found


def load_metrics(results_dir: Path, run_name: str) -> dict[str, Any]:
    return json.loads((Path(results_dir) / run_name / "metrics.json").read_text())


@contextlib.contextmanager
def dump_logs_on_error(procs: Processes, lines: int = 80) -> Iterator[None]:
    """Print every log tail if the block raises (pytest shows it with the failure)."""
    try:
        yield
    except BaseException:
        print(procs.logs(lines))
        raise
