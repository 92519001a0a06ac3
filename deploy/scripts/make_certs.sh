#!/usr/bin/env bash
# Make a private CA and a TLS certificate for the SuperLink, signed by that CA.
#
#   deploy/scripts/make_certs.sh [-o OUT_DIR] [-d DAYS] [-b RSA_BITS] [SAN ...]
#
# SAN: each argument is an IP address (e.g. 10.0.0.5, ::1) or a DNS name
# (e.g. superlink.lab.example). Every address that SuperNodes, the `flwr` CLI
# and the SuperLink's own ServerApp runner (it dials the SuperLink's --host) use
# to reach the SuperLink must be listed. 127.0.0.1 and localhost are always
# included, so the defaults work for a single machine.
#
# Writes to OUT_DIR (default ./certificates):
#   ca.crt       CA certificate: give it to every SuperNode (--root-certificates)
#                and to the laptop that runs `flwr run` (root-certificates in config.toml)
#   ca.key       CA private key: keep it offline; only needed to sign new certificates
#   server.pem   SuperLink certificate (--ssl-certfile)
#   server.key   SuperLink private key (--ssl-keyfile), readable by the SuperLink only
#
# Existing files are never overwritten: remove OUT_DIR (or pass another -o) to start over.
set -euo pipefail

out_dir="certificates"
days=365
bits=4096
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while getopts "o:d:b:h" opt; do
  case "$opt" in
    o) out_dir="$OPTARG" ;;
    d) days="$OPTARG" ;;
    b) bits="$OPTARG" ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))

command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found (apt install openssl)" >&2; exit 1; }

# Subject alternative names: always the loopback names, then the arguments.
ip_sans=("127.0.0.1" "::1")
dns_sans=("localhost")
for san in "$@"; do
  if [[ "$san" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$san" == *:* ]]; then
    [[ " ${ip_sans[*]} " == *" $san "* ]] || ip_sans+=("$san")
  elif [[ "$san" =~ ^[A-Za-z0-9*]([A-Za-z0-9.*-]*[A-Za-z0-9])?$ ]]; then
    [[ " ${dns_sans[*]} " == *" $san "* ]] || dns_sans+=("$san")
  else
    echo "make_certs.sh: '$san' is neither an IP address nor a DNS name" >&2
    exit 2
  fi
done

mkdir -p "$out_dir"
for f in ca.crt ca.key server.pem server.key; do
  if [[ -e "$out_dir/$f" ]]; then
    echo "make_certs.sh: $out_dir/$f exists; not overwriting (remove $out_dir to start over)" >&2
    exit 1
  fi
done

umask 077
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

{
  echo "[req]"
  echo "prompt = no"
  echo "distinguished_name = dn"
  echo "req_extensions = req_ext"
  echo "[dn]"
  echo "O = pollen federation"
  echo "CN = ${dns_sans[-1]}"
  echo "[req_ext]"
  echo "basicConstraints = critical, CA:FALSE"
  echo "keyUsage = critical, digitalSignature, keyEncipherment"
  echo "extendedKeyUsage = serverAuth"
  echo "subjectAltName = @alt_names"
  echo "[alt_names]"
  i=1; for ip in "${ip_sans[@]}"; do echo "IP.$i = $ip"; i=$((i + 1)); done
  i=1; for dns in "${dns_sans[@]}"; do echo "DNS.$i = $dns"; i=$((i + 1)); done
} > "$tmp/server.conf"

# CA
openssl genrsa -out "$out_dir/ca.key" "$bits" 2>/dev/null
openssl req -x509 -new -key "$out_dir/ca.key" -sha256 -days "$days" \
  -subj "/O=pollen federation/CN=pollen federation CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$out_dir/ca.crt"

# SuperLink key and certificate
openssl genrsa -out "$out_dir/server.key" "$bits" 2>/dev/null
openssl req -new -key "$out_dir/server.key" -config "$tmp/server.conf" -out "$tmp/server.csr"
openssl x509 -req -in "$tmp/server.csr" -CA "$out_dir/ca.crt" -CAkey "$out_dir/ca.key" \
  -CAcreateserial -CAserial "$tmp/ca.srl" -days "$days" -sha256 \
  -extfile "$tmp/server.conf" -extensions req_ext -out "$out_dir/server.pem" 2>/dev/null

chmod 644 "$out_dir/ca.crt" "$out_dir/server.pem"
chmod 600 "$out_dir/ca.key" "$out_dir/server.key"
openssl verify -CAfile "$out_dir/ca.crt" "$out_dir/server.pem" >/dev/null

echo "CA certificate:        $out_dir/ca.crt"
echo "SuperLink certificate: $out_dir/server.pem"
echo "SuperLink private key: $out_dir/server.key"
echo "Valid for (SAN):       IP ${ip_sans[*]}; DNS ${dns_sans[*]}; $days days"
