#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink (Flower 1.39: `flwr supernode register`).
#
#   deploy/scripts/register_supernodes.sh CONNECTION KEY.pub [KEY.pub ...]
#   deploy/scripts/register_supernodes.sh CONNECTION keys/          # every *.pub in the folder
#
# CONNECTION is a [superlink.CONNECTION] entry of $FLWR_HOME/config.toml (default
# ~/.flwr/config.toml) with the SuperLink's address and root-certificates. The
# SuperLink must run with --enable-supernode-auth; a SuperNode whose key is not
# registered is refused. `flwr supernode list CONNECTION` shows the result and
# `flwr supernode unregister NODE_ID CONNECTION` removes a node.
set -euo pipefail

[[ $# -ge 2 ]] || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
connection="$1"
shift

keys=()
for arg in "$@"; do
  if [[ -d "$arg" ]]; then
    for pub in "$arg"/*.pub; do [[ -e "$pub" ]] && keys+=("$pub"); done
  else
    keys+=("$arg")
  fi
done
[[ ${#keys[@]} -ge 1 ]] || { echo "register_supernodes.sh: no *.pub keys found in $*" >&2; exit 2; }

failed=0
for pub in "${keys[@]}"; do
  echo "registering $pub"
  if ! flwr supernode register "$pub" "$connection"; then
    echo "register_supernodes.sh: $pub was not registered (already registered, or the SuperLink is unreachable)" >&2
    failed=1
  fi
done
exit "$failed"
