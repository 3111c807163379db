#!/usr/bin/env bash
# Builds the real programs the end-to-end suites (integration/clients) run,
# from the Go module proxy, into .tools/bin (ignored by git):
#
#   tools/build.sh etcd    # etcd and etcdctl v3.7.3 (tools/etcd), and the
#                          # previous release's etcd as etcd-3.6
#                          # (tools/etcd36), for the upgrade tests
#   tools/build.sh kube    # kube-apiserver v1.37.1 (tools/kube)
#   tools/build.sh         # both
#
# First build on 2 cores, from empty Go caches: etcd and etcdctl about 45 s
# for each release;
# kube-apiserver about 4.5 min (12 min on a heavily loaded machine). Later
# runs find the binaries up to date and take a second.
#
# A binary is rebuilt only when its stamp (.tools/bin/NAME.stamp) differs: a
# hash of its module's go.mod and go.sum, the build flags and the Go version.
# TOOLS_BIN overrides the output directory; FORCE=1 rebuilds anyway.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${TOOLS_BIN:-$root/.tools/bin}
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)

# Statically linked like the upstream release binaries, and no C compiler
# needed. No VCS stamping: the binaries come from the module cache, and the
# checkout's git state (or its absence, or git's safe.directory check in CI)
# must not matter.
export CGO_ENABLED=0
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-buildvcs=false"

stamp_of() { # module dir, flags...
  local dir=$1; shift
  { cat "$dir/go.mod" "$dir/go.sum"; echo "$*"; go env GOVERSION GOOS GOARCH; } | sha256sum | cut -d' ' -f1
}

# build NAME MODULE_DIR PACKAGE [go build flags...]: go build PACKAGE (a
# package of a module that MODULE_DIR requires) into $bin/NAME.
build() {
  local name=$1 dir=$2 pkg=$3; shift 3
  local out=$bin/$name want have=
  want=$(stamp_of "$dir" "$pkg" "$@")
  [ -f "$out.stamp" ] && have=$(cat "$out.stamp")
  if [ -x "$out" ] && [ "$have" = "$want" ] && [ "${FORCE:-}" != 1 ]; then
    echo "tools: $name is up to date ($out)"
    return
  fi
  echo "tools: building $name from $pkg ..."
  local start=$SECONDS
  rm -f "$out.stamp"
  # -mod=readonly: go.mod and go.sum are committed and complete; the module
  # cache is filled from the proxy as needed.
  (cd "$dir" && go build -mod=readonly "$@" -o "$out.tmp" "$pkg")
  mv -f "$out.tmp" "$out"
  echo "$want" > "$out.stamp"
  echo "tools: built $name in $((SECONDS - start))s"
}

build_etcd() {
  local dir=$root/tools/etcd
  build etcd "$dir" go.etcd.io/etcd/server/v3 -trimpath
  build etcdctl "$dir" go.etcd.io/etcd/etcdctl/v3 -trimpath
  "$bin/etcd" --version | sed -n 1p
  "$bin/etcdctl" version | sed -n 1p
  dir=$root/tools/etcd36
  build etcd-3.6 "$dir" go.etcd.io/etcd/server/v3 -trimpath
  "$bin/etcd-3.6" --version | sed -n 1p
}

build_kube() {
  local dir=$root/tools/kube version major minor
  version=$(cd "$dir" && go list -mod=readonly -m -f '{{.Version}}' k8s.io/kubernetes)
  major=${version#v}; major=${major%%.*}
  minor=${version#v*.}; minor=${minor%%.*}
  # The version kube-apiserver reports (/version) and derives its default
  # emulation version from, as the release build stamps it (hack/lib/version.sh).
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  # Same for the client-go copy of the version package.
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$version -X k8s.io/client-go/pkg/version.gitMajor=$major -X k8s.io/client-go/pkg/version.gitMinor=$minor"
  build kube-apiserver "$dir" . -trimpath -ldflags "$ldflags"
  "$bin/kube-apiserver" --version
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(etcd kube)
for t in "${targets[@]}"; do
  case $t in
    etcd) build_etcd ;;
    kube) build_kube ;;
    *) echo "usage: $0 [etcd] [kube]" >&2; exit 2 ;;
  esac
done
