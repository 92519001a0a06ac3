#!/usr/bin/env bash
# Make one authentication key pair per SuperNode, in the format Flower 1.39 expects:
# an ECDSA key on a NIST curve (P-384 here), private key in OpenSSH format.
#
#   deploy/scripts/make_supernode_keys.sh [-o OUT_DIR] N          # supernode-1 .. supernode-N
#   deploy/scripts/make_supernode_keys.sh [-o OUT_DIR] NAME ...   # e.g. jetson-01 rpi-02
#
# Writes to OUT_DIR (default ./keys), for each SuperNode NAME:
#   NAME       private key: copy it to that edge machine only, pass it to
#              `flower-supernode --auth-supernode-private-key NAME`
#   NAME.pub   public key: register it on the SuperLink, from any machine whose
#              Flower config has a connection to it:
#                  flwr supernode register OUT_DIR/NAME.pub <connection>
#              (deploy/scripts/register_supernodes.sh does this for a whole folder)
#
# Existing keys are kept (a key that is already registered stays valid).
set -euo pipefail

out_dir="keys"
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while getopts "o:h" opt; do
  case "$opt" in
    o) out_dir="$OPTARG" ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -ge 1 ]] || usage 2

names=()
if [[ $# -eq 1 && "$1" =~ ^[0-9]+$ ]]; then
  [[ "$1" -ge 1 ]] || { echo "make_supernode_keys.sh: N must be >= 1" >&2; exit 2; }
  for ((i = 1; i <= $1; i++)); do names+=("supernode-$i"); done
else
  for name in "$@"; do
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "make_supernode_keys.sh: bad name '$name' (use letters, digits, . _ -)" >&2; exit 2; }
    names+=("$name")
  done
fi

mkdir -p "$out_dir"
umask 077

make_key() {  # $1 = path of the private key; writes $1 and $1.pub
  if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "" -f "$1"
  else
    # No OpenSSH client: the `cryptography` package (a Flower dependency) writes the same format.
    "${PYTHON:-python3}" - "$1" <<'PY'
import sys
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path = Path(sys.argv[1])
key = ec.generate_private_key(ec.SECP384R1())
path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
Path(f"{path}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
PY
  fi
}

for name in "${names[@]}"; do
  key="$out_dir/$name"
  if [[ -e "$key" ]]; then
    echo "kept     $key (exists)"
    continue
  fi
  make_key "$key"
  chmod 600 "$key"
  chmod 644 "$key.pub"
  echo "created  $key  $key.pub"
done
