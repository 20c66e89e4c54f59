#!/usr/bin/env bash
# Makes a throwaway CA, a server certificate for 127.0.0.1/localhost, a client
# certificate and random client/worker bearer tokens in DIR, for tests and
# deploy/local/run.sh. NOT for production. Idempotent: files that already
# exist are kept (delete DIR to start over).
#
#   tools/make_test_certs.sh DIR
#
# Writes: ca.pem ca.key server.pem server.key client.pem client.key
#         client.token worker.token
#
# SHARDD_CERT_SANS (environment): more subjectAltName entries for the server
# certificate, e.g. "DNS:shardd-coordinator,DNS:*.shardd-worker.ns.svc"
# (deploy/k8s/make-secrets.sh).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
dir="$1"
openssl="${OPENSSL:-openssl}"
mkdir -p "$dir"
cd "$dir"
umask 077

if [[ ! -s ca.pem || ! -s ca.key ]]; then
  "$openssl" req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 \
    -subj "/CN=shardd test CA" -keyout ca.key -out ca.pem 2>/dev/null
  # A new CA invalidates certificates signed by an old one.
  rm -f server.pem server.key client.pem client.key
fi

# sign NAME CN EXTENSIONS
sign() {
  local name="$1" cn="$2" ext="$3"
  if [[ -s "$name.pem" && -s "$name.key" ]]; then return; fi
  "$openssl" req -newkey rsa:2048 -nodes -sha256 -subj "/CN=$cn" \
    -keyout "$name.key" -out "$name.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$name.ext"
  "$openssl" x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key \
    -CAcreateserial -days 3650 -sha256 -extfile "$name.ext" \
    -out "$name.pem" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

sign server localhost \
  "subjectAltName=IP:127.0.0.1,DNS:localhost${SHARDD_CERT_SANS:+,$SHARDD_CERT_SANS}
extendedKeyUsage=serverAuth,clientAuth
basicConstraints=CA:FALSE"
sign client shardd-client \
  "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"

for token in client worker; do
  if [[ ! -s "$token.token" ]]; then
    "$openssl" rand -hex 32 >"$token.token"
  fi
done
# Certificates are public; keys and tokens stay private to the owner.
chmod 644 ca.pem server.pem client.pem
