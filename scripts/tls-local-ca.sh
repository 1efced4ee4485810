#!/usr/bin/env bash
# Makes a local certificate authority and one certificate per node, for TLS on
# every listener and between the nodes of a cluster on this machine, and a second
# authority for client certificates.
#
#   scripts/tls-local-ca.sh [OUT_DIR] [NODE...]
#
# OUT_DIR defaults to ./certs; the nodes to node1 node2 node3 (cluster-config/local3).
# Writes OUT_DIR/ca.pem (the cluster CA: give it to clients as `--cacert` and to
# nodes as `tls.cluster_ca`), OUT_DIR/ca-key.pem (keep it; it signs new nodes),
# and for each node OUT_DIR/NODE.pem (leaf then CA) and OUT_DIR/NODE-key.pem.
# Node certificates name 127.0.0.1, ::1, localhost and the node id itself (a DNS
# name: between nodes, a certificate must name the node it belongs to), and serve
# both as server and as client certificates (nodes present them to each other).
# Client certificates come from a CA of their own, never the cluster CA:
# OUT_DIR/client-ca.pem (for `tls.client_ca`), OUT_DIR/client-ca-key.pem, and one
# client certificate OUT_DIR/client.pem with OUT_DIR/client-key.pem
# (`redis-cli --tls --cert`, `curl --cert`). Existing CAs are reused, so running it
# again for a new node keeps the others valid.
#
# Environment: TALLY_CA_DAYS (default 3650), TALLY_CERT_DAYS (default 825),
# TALLY_CA_NAME (the CA's common name, default "tally local CA").
set -euo pipefail
out="${1:-certs}"
shift || true
nodes=("$@")
[ "${#nodes[@]}" -gt 0 ] || nodes=(node1 node2 node3)
ca_days="${TALLY_CA_DAYS:-3650}"
cert_days="${TALLY_CERT_DAYS:-825}"
ca_name="${TALLY_CA_NAME:-tally local CA}"
command -v openssl >/dev/null || { echo "tls-local-ca.sh: openssl is needed (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$out"
umask 077

if [ ! -f "$out/ca.pem" ] || [ ! -f "$out/ca-key.pem" ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$out/ca-key.pem" -out "$out/ca.pem" -days "$ca_days" -subj "/CN=$ca_name" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "made CA $out/ca.pem"
fi

if [ ! -f "$out/client-ca.pem" ] || [ ! -f "$out/client-ca-key.pem" ]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$out/client-ca-key.pem" -out "$out/client-ca.pem" -days "$ca_days" -subj "/CN=$ca_name (clients)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "made client CA $out/client-ca.pem"
fi

ext="$(mktemp)"
trap 'rm -f "$ext" "$out"/*.csr' EXIT
if [ ! -f "$out/client.pem" ]; then
  cat >"$ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth
EXT
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$out/client-key.pem" -out "$out/client.csr" -subj "/CN=tally client" 2>/dev/null
  openssl x509 -req -in "$out/client.csr" -CA "$out/client-ca.pem" -CAkey "$out/client-ca-key.pem" \
    -CAcreateserial -out "$out/client-leaf.pem" -days "$cert_days" -extfile "$ext" 2>/dev/null
  cat "$out/client-leaf.pem" "$out/client-ca.pem" >"$out/client.pem"
  rm -f "$out/client-leaf.pem"
  chmod 644 "$out/client.pem" "$out/client-ca.pem"
  echo "made client certificate $out/client.pem and $out/client-key.pem"
fi
for node in "${nodes[@]}"; do
  cat >"$ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:$node
EXT
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$out/$node-key.pem" -out "$out/$node.csr" -subj "/CN=$node" 2>/dev/null
  openssl x509 -req -in "$out/$node.csr" -CA "$out/ca.pem" -CAkey "$out/ca-key.pem" \
    -CAcreateserial -out "$out/$node-leaf.pem" -days "$cert_days" -extfile "$ext" 2>/dev/null
  cat "$out/$node-leaf.pem" "$out/ca.pem" >"$out/$node.pem"
  rm -f "$out/$node-leaf.pem"
  echo "made $out/$node.pem and $out/$node-key.pem"
done
chmod 644 "$out/ca.pem"; for node in "${nodes[@]}"; do chmod 644 "$out/$node.pem"; done
