#!/usr/bin/env bash
# Builds the Kubernetes control plane that crates/shoal/tests/k8s.rs runs against:
# kube-apiserver and kwok (nodes and Pod phases without a kubelet) from the Go module
# proxy; etcd is Debian's etcd-server. Everything goes into a cache outside the repo
# ($SHOAL_K8S_CACHE, default ~/.cache/shoal-k8s), so that only a cold machine pays
# (about 4.5 minutes on 2 cores, measured; a warm one returns at once). Prints the bin directory.
#
# kube-apiserver cannot be `go install`ed: k8s.io/kubernetes's go.mod replaces every
# k8s.io/* staging module with ./staging/..., which go install refuses. So a wrapper
# module requires k8s.io/kubernetes and points each of those replaces at the published
# staging module of the same release (v0.X.Y for v1.X.Y).
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-v1.34.0}
KWOK_VERSION=${KWOK_VERSION:-v0.7.0}
CACHE=${SHOAL_K8S_CACHE:-$HOME/.cache/shoal-k8s}
BIN="$CACHE/bin-$KUBE_VERSION-kwok-$KWOK_VERSION"
export GOMODCACHE="$CACHE/gomod" GOCACHE="$CACHE/gobuild" GOFLAGS=-mod=mod GOTOOLCHAIN=local

log() { echo "k8s_tools: $*" >&2; }
command -v etcd >/dev/null || log "note: no etcd on PATH (Debian package etcd-server); the test needs it too"

if [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kwok" ]; then
  echo "$BIN"
  exit 0
fi
command -v go >/dev/null || { log "no go command"; exit 1; }
mkdir -p "$BIN"

if [ ! -x "$BIN/kwok" ]; then
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" >&2
fi

if [ ! -x "$BIN/kube-apiserver" ]; then
  log "building kube-apiserver $KUBE_VERSION (about 3 minutes on 2 cores)"
  work="$CACHE/wrapper-$KUBE_VERSION"
  rm -rf "$work"
  mkdir -p "$work"
  cd "$work"
  staging="v0.${KUBE_VERSION#v1.}"
  gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [ -f "$gomod" ] || { log "no go.mod for k8s.io/kubernetes@$KUBE_VERSION"; exit 1; }
  {
    echo "module shoal.invalid/k8s-tools"
    echo
    echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod" | head -1)"
    echo
    echo "require k8s.io/kubernetes $KUBE_VERSION"
    echo
    sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => ./staging/.*$|replace \1 => \1 '"$staging"'|p' "$gomod"
  } > go.mod
  cat > tools.go <<'EOF'
//go:build tools

package tools

import _ "k8s.io/kubernetes/cmd/kube-apiserver/app"
EOF
  go mod tidy >&2
  pkg=k8s.io/component-base/version
  go build -trimpath -o "$BIN/kube-apiserver" \
    -ldflags "-s -w -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=${KUBE_VERSION#v1.}" \
    k8s.io/kubernetes/cmd/kube-apiserver >&2
fi
echo "$BIN"
