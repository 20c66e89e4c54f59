#!/usr/bin/env bash
# Makes the two Secrets the manifests mount, from a throwaway test CA
# (tools/make_test_certs.sh; NOT for production: there, put certificates from
# your own CA or cert-manager under the same keys):
#   shardd-tls     ca.pem server.pem server.key client.pem client.key
#   shardd-tokens  client.token worker.token
# The server certificate names the coordinator's Service and every worker's
# pod DNS name in NAMESPACE (the workers advertise
# shardd-worker-N.shardd-worker.NAMESPACE.svc), besides 127.0.0.1.
#
#   deploy/k8s/make-secrets.sh [--print] NAMESPACE DIR
#
# Keeps the files in DIR (client.pem, client.key, client.token and ca.pem are
# what a client outside the cluster needs). Applies the Secrets with kubectl,
# or with --print writes them to stdout as YAML instead (no cluster needed).
set -euo pipefail

print=0
if [[ "${1:-}" == "--print" ]]; then
  print=1
  shift
fi
if [[ $# -ne 2 ]]; then
  echo "usage: $0 [--print] NAMESPACE DIR" >&2
  exit 2
fi
namespace="$1"
dir="$2"
root="$(cd "$(dirname "$0")/../.." && pwd)"
kubectl="${KUBECTL:-kubectl}"

SHARDD_CERT_SANS="DNS:shardd-coordinator,DNS:shardd-coordinator.$namespace.svc,DNS:*.shardd-worker.$namespace.svc" \
  "$root/tools/make_test_certs.sh" "$dir" >&2

secrets() {
  "$kubectl" create secret generic shardd-tls --namespace="$namespace" \
    --from-file=ca.pem="$dir/ca.pem" \
    --from-file=server.pem="$dir/server.pem" \
    --from-file=server.key="$dir/server.key" \
    --from-file=client.pem="$dir/client.pem" \
    --from-file=client.key="$dir/client.key" \
    --dry-run=client -o yaml
  echo "---"
  "$kubectl" create secret generic shardd-tokens --namespace="$namespace" \
    --from-file=client.token="$dir/client.token" \
    --from-file=worker.token="$dir/worker.token" \
    --dry-run=client -o yaml
}

if ((print)); then
  secrets
else
  secrets | "$kubectl" apply -f -
fi
