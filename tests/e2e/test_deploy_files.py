"""Fast checks of ``deploy/``: the scripts' output, and that every launcher only uses flags the installed Flower has
(1.39 in the main suite; 1.42 too in CI's newest-Flower step, the ``app_compat`` tests).

The end-to-end run on real processes is ``tests/e2e/test_deploy_e2e.py`` (slow).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pollen.testing import local_federation as lf

DEPLOY = lf.DEPLOY_DIR
SYSTEMD = DEPLOY / "systemd"
COMPOSE = DEPLOY / "docker" / "compose.yaml"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


# --------------------------------------------------------------------------- scripts


@pytest.mark.parametrize("script", sorted((DEPLOY / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_are_valid_bash_and_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)


@needs_openssl
def test_make_certs_puts_loopback_and_given_names_in_the_certificate(tmp_path):
    certs = lf.make_certs(tmp_path / "c", "10.1.2.3", "superlink.lab.example", bits=2048)
    text = subprocess.run(
        ["openssl", "x509", "-in", str(certs["server.pem"]), "-noout", "-text"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    san = text.split("Subject Alternative Name:")[1].splitlines()[1]
    for name in ("IP Address:127.0.0.1", "IP Address:10.1.2.3", "DNS:localhost", "DNS:superlink.lab.example"):
        assert name in san
    assert "TLS Web Server Authentication" in text
    subprocess.run(
        ["openssl", "verify", "-CAfile", str(certs["ca.crt"]), str(certs["server.pem"])],
        check=True,
        capture_output=True,
    )
    assert oct(certs["server.key"].stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "c" / "ca.key").stat().st_mode & 0o777) == "0o600"


@needs_openssl
def test_make_certs_never_overwrites_and_rejects_bad_names(tmp_path):
    lf.make_certs(tmp_path / "c", bits=2048)
    before = (tmp_path / "c" / "server.pem").read_bytes()
    again = subprocess.run(
        ["bash", str(lf.SCRIPTS_DIR / "make_certs.sh"), "-o", str(tmp_path / "c"), "-b", "2048"],
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "not overwriting" in again.stderr
    assert (tmp_path / "c" / "server.pem").read_bytes() == before
    bad = subprocess.run(
        ["bash", str(lf.SCRIPTS_DIR / "make_certs.sh"), "-o", str(tmp_path / "d"), "bad name!"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "neither an IP address nor a DNS name" in bad.stderr


def _check_key_pair(private: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    key = load_ssh_private_key(private.read_bytes(), None)  # what flower-supernode does
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert try_load_public_key(Path(f"{private}.pub"))  # what `flwr supernode register` does
    assert oct(private.stat().st_mode & 0o777) == "0o600"


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen")
def test_make_supernode_keys_with_ssh_keygen(tmp_path):
    keys = lf.make_supernode_keys(tmp_path / "k", "3")
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == sorted(
        [f"supernode-{i}{s}" for i in (1, 2, 3) for s in ("", ".pub")]
    )
    for i in (1, 2, 3):
        _check_key_pair(tmp_path / "k" / f"supernode-{i}")
    first = (tmp_path / "k" / "supernode-1").read_bytes()
    lf.make_supernode_keys(tmp_path / "k", "3")  # keeps existing keys
    assert (tmp_path / "k" / "supernode-1").read_bytes() == first
    assert keys


def test_make_supernode_keys_without_ssh_keygen(tmp_path):
    """No OpenSSH client on the board: the script falls back to Python's cryptography, same format."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "mkdir", "chmod", "sed"):
        os.symlink(shutil.which(tool), tools / tool)
    env = {"PATH": str(tools), "PYTHON": sys.executable}
    lf.make_supernode_keys(tmp_path / "k", "jetson-01", "rpi-02", env=env)
    for name in ("jetson-01", "rpi-02"):
        _check_key_pair(tmp_path / "k" / name)


# --------------------------------------------------------------------------- flags exist in Flower 1.39


def _superlink_parser():
    from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink

    return _parse_args_run_superlink()


def _supernode_parser():
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

    return _parse_args_run_supernode()


def _unit(path: Path) -> dict[str, list[str]]:
    """Key -> values of a systemd unit file (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def _env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return out


def _expand(exec_start: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${X} stays one argument, $X splits on whitespace."""
    argv = []
    for word in exec_start.split():
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env[m.group(1)])
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv += env.get(m.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda g: env[g.group(1)], word))
    return argv


#: The SuperLink's env examples: file -> (the Fleet API it configures, Flower's gRPC-Fleet switch set).
SUPERLINK_ENVS = {
    "superlink.env.example": ("grpc", False),  # Flower 1.39
    "superlink-1.42.env.example": ("http", False),
    "superlink-1.42-grpc.env.example": ("grpc", True),  # 1.42 SuperLink, 1.39 SuperNodes
}


@pytest.mark.app_compat
@pytest.mark.parametrize(
    ("unit", "env_example", "parser"),
    [("flower-superlink.service", name, _superlink_parser) for name in SUPERLINK_ENVS]
    + [("flower-supernode@.service", "supernode.env.example", _supernode_parser)],
)
def test_systemd_units(unit, env_example, parser):
    keys = _unit(SYSTEMD / unit)
    assert keys["User"] == ["flower"] and keys["Group"] == ["flower"]
    assert keys["Restart"] == ["on-failure"]
    assert len(keys["EnvironmentFile"]) == 1
    if "@" in unit:
        assert "%i" in keys["EnvironmentFile"][0]
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in keys["Environment"]
    env = _env_file(SYSTEMD / env_example)
    argv = _expand(keys["ExecStart"][0], env)
    assert argv[0].startswith("/opt/flower/venv/bin/flower-")
    args = parser().parse_args(argv[1:])  # every flag exists in the installed Flower
    if "superlink" in unit:
        fleet, switch = SUPERLINK_ENVS[env_example]
        assert args.enable_supernode_auth and not args.insecure
        assert args.ssl_certfile and args.ssl_keyfile and args.ssl_ca_certfile
        assert args.host != "0.0.0.0"
        assert (env.get(lf.GRPC_FLEET_SWITCH) == "1") == switch
        if fleet == "grpc":
            assert args.fleet_api_type == "grpc-rere" and not args.fleet_api_address.startswith("0.0.0.0")
        else:  # SuperNodes dial the HTTP API: it binds the LAN address, the Fleet flags are absent
            assert args.fleet_api_address is None and args.host != "127.0.0.1"
    else:
        assert not args.insecure and args.root_certificates and args.auth_supernode_private_key
        assert args.host == "127.0.0.1"
        from flwr.common.config import parse_config_args

        node_config = parse_config_args([args.node_config])
        assert {"partition-id", "num-partitions", "data-dir", "device", "client-id"} <= set(node_config)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    for unit in ("flower-superlink.service", "flower-supernode@.service"):
        text = (SYSTEMD / unit).read_text().replace("/opt/flower/venv/bin/", f"{lf.BIN_DIR}/")
        (tmp_path / unit).write_text(text)
    shutil.copy(tmp_path / "flower-supernode@.service", tmp_path / "flower-supernode@1.service")
    done = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            str(tmp_path / "flower-superlink.service"),
            str(tmp_path / "flower-supernode@1.service"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [line for line in done.stderr.splitlines() if str(tmp_path) in line]
    assert done.returncode == 0 and not problems, done.stderr


# --------------------------------------------------------------------------- docker compose


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _defaults(value: str) -> str:
    """Compose interpolation with defaults only: ${X:-d} -> d."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_compose_uses_official_images_of_the_pinned_version():
    services = _compose()["services"]
    assert _defaults(services["superlink"]["image"]) == "flwr/superlink:1.39.0"
    for name in ("supernode-1", "supernode-2"):
        assert _defaults(services[name]["image"]) == "flwr/supernode:1.39.0"
    dockerfile = (DEPLOY / "docker" / "superexec.Dockerfile").read_text()
    assert "ARG FLWR_VERSION=1.39.0" in dockerfile and "FROM flwr/superexec:${FLWR_VERSION}" in dockerfile


def test_compose_publishes_on_loopback_unless_told_otherwise():
    for service in _compose()["services"].values():
        for port in service.get("ports", []):
            assert _defaults(port).startswith("127.0.0.1:"), port


def test_compose_commands_use_flags_flower_has():
    services = _compose()["services"]
    link = _superlink_parser().parse_args([_defaults(a) for a in services["superlink"]["command"]])
    assert link.enable_supernode_auth and link.fleet_api_type == "grpc-rere" and link.isolation == "process"
    from flwr.common.config import parse_config_args

    for name in ("supernode-1", "supernode-2"):
        node = _supernode_parser().parse_args([_defaults(a) for a in services[name]["command"]])
        assert node.root_certificates and node.auth_supernode_private_key and node.isolation == "process"
        assert parse_config_args([node.node_config])["device"] == "cpu"


@pytest.mark.app_compat
def test_compose_1_42_override_puts_the_fleet_on_the_superlinks_http_port():
    """``compose.1.42.yaml``: Flower 1.42's images, no gRPC Fleet flags, SuperNodes dialling the HTTP port."""
    override = yaml.safe_load((DEPLOY / "docker" / "compose.1.42.yaml").read_text())["services"]
    assert _defaults(override["superlink"]["image"]) == "flwr/superlink:1.42.0"
    link = _superlink_parser().parse_args([_defaults(a) for a in override["superlink"]["command"]])
    assert link.enable_supernode_auth and link.fleet_api_address is None and link.isolation == "process"
    for name in ("supernode-1", "supernode-2"):
        assert _defaults(override[name]["image"]) == "flwr/supernode:1.42.0"
        node = _supernode_parser().parse_args([_defaults(a) for a in override[name]["command"]])
        assert node.superlink == f"superlink:{link.port}" and node.auth_supernode_private_key
    for name in ("superexec-serverapp", "superexec-clientapp-1", "superexec-clientapp-2"):
        assert override[name]["build"]["args"]["FLWR_VERSION"] == "${FLWR_VERSION:-1.42.0}"
    assert set(override) <= set(_compose()["services"])  # an override: no service of its own


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="needs docker compose (or docker-compose)")
@pytest.mark.parametrize(
    "files",
    [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"], ["compose.yaml", "compose.1.42.yaml"]],
    ids=["cpu", "gpu", "flower-1.42"],
)
def test_compose_config_is_valid(files):
    argv = _compose_cli()
    for name in files:
        argv += ["-f", str(DEPLOY / "docker" / name)]
    done = subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=120, env=_no_compose_env())
    assert done.returncode == 0, done.stderr
    version = "1.42.0" if "compose.1.42.yaml" in files else "1.39.0"
    assert f"flwr/superlink:{version}" in done.stdout and f"flwr/supernode:{version}" in done.stdout


def _no_compose_env() -> dict[str, str]:
    """This environment without compose's variables (a FLWR_VERSION set here would pick other images)."""
    return {k: v for k, v in os.environ.items() if k != "FLWR_VERSION"}


def test_compare_final_models(tmp_path):
    import numpy as np

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    w = np.linspace(-1, 1, 50, dtype=np.float32)
    np.savez(a / "final_model.npz", w=w, n=np.array([3]))
    np.savez(b / "final_model.npz", w=w + 1e-6, n=np.array([3]))
    np.savez(c / "final_model.npz", w=w + 1e-2, n=np.array([3]))
    script = [sys.executable, str(DEPLOY / "scripts" / "compare_final_models.py")]
    same = subprocess.run([*script, str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "match within tolerance" in same.stdout, same.stdout + same.stderr
    differ = subprocess.run([*script, str(a), str(c)], capture_output=True, text=True)
    assert differ.returncode == 1 and "DIFFERS" in differ.stdout


# --------------------------------------------------------------------------- the helpers' command lines per Flower line


@pytest.mark.app_compat
def test_local_federation_command_lines_follow_the_flower_line():
    """1.39: gRPC Fleet on its own port, SuperNodes told ``--grpc-rere``; 1.40+: HTTP Fleet on the HTTP port, or
    the gRPC Fleet behind Flower's switch for 1.39 SuperNodes; every flag exists in the installed Flower."""
    assert lf.flower_line("1.42.0") == (1, 42) and lf.flower_line("1.39.1rc0") == (1, 39)
    assert lf.http_fleet((1, 40)) and not lf.http_fleet((1, 39))
    assert lf.default_fleet() == ("http" if lf.flower_line() >= (1, 40) else "grpc")

    old = lf.superlink_argv(http_port=8000, fleet_port=9092, line=(1, 39))
    assert old[0].endswith("flower-superlink") and ["--fleet-api-address", "127.0.0.1:9092"] == old[-7:-5]
    switched = lf.superlink_argv(http_port=8000, fleet_port=9092, fleet="grpc", line=(1, 42))
    assert switched[:2] == ["env", f"{lf.GRPC_FLEET_SWITCH}=1"] and switched[3:] == old[1:]
    http = lf.superlink_argv(http_port=8000, fleet_port=9092, fleet="http", line=(1, 42), supernode_auth=True)
    assert "--fleet-api-address" not in http and "--enable-supernode-auth" in http
    for argv in (old, switched[2:], http):
        _superlink_parser().parse_args(argv[1:])
    with pytest.raises(ValueError, match=r"fleet='http' needs Flower 1.40 or later; this is 1.39"):
        lf.superlink_argv(http_port=8000, fleet_port=9092, fleet="http", line=(1, 39))
    with pytest.raises(ValueError, match=r"fleet='quic' is unknown; allowed: grpc, http"):
        lf.superlink_argv(http_port=8000, fleet_port=9092, fleet="quic")

    assert lf.fleet_address(8000, 9092, "http") == "127.0.0.1:8000" and lf.superlink_ports(8000, 9092, "http") == (
        8000,
    )
    assert lf.fleet_address(8000, 9092, "grpc") == "127.0.0.1:9092" and lf.superlink_ports(8000, 9092, "grpc") == (
        8000,
        9092,
    )
    node_139 = lf.supernode_argv(superlink="127.0.0.1:9092", runtime_port=9094, line=(1, 39), bin_dir=Path("/x/bin"))
    node_142 = lf.supernode_argv(superlink="127.0.0.1:8000", runtime_port=9094, line=(1, 42))
    assert node_139[:4] == ["/x/bin/flower-supernode", "--superlink", "127.0.0.1:9092", "--grpc-rere"]
    assert "--grpc-rere" not in node_142
    parsed = _supernode_parser().parse_args(node_142[1:])
    assert parsed.superlink == "127.0.0.1:8000" and parsed.port == 9094
