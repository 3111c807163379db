#!/usr/bin/env bash
# Runs a selection of etcd's own end-to-end tests in cluster_proxy mode with
# etcd-snapcache as the grpc-proxy (see doc.go). From the repository root:
# `make integration-e2e`, or this script once `make build tools-etcd` ran.
#
# The wrapper bin directory holds `etcd` (grpc-proxy start -> etcd-snapcache
# serve, anything else -> the real etcd) and etcdctl. Each test package is
# compiled once (go test -c, from this module) and each selected test runs
# in a process of its own, in its package's directory as go test would: a
# failed test leaves goroutines behind and etcd's leak check would skip every
# later test of the same process.
#
# Output: one line per test (and per failed or skipped subtest); for each
# failed test, its error lines and each proxy's last lines that are not info
# or debug logs (the framework prints every line a spawned process writes
# when EXPECT_DEBUG is set, prefixed with its pid; the wrapper records the
# proxies' pids and command lines in $E2E_LOG_DIR/grpc-proxy.calls); at the
# end, each package's counts of passed, failed and skipped tests (a test
# that reported --- SKIP, or whose every subtest did, is skipped, not passed).
# Full logs: $E2E_LOG_DIR/<package>/<test>.log.
#
# Environment:
#   E2E_TESTS_ETCD    tests of go.etcd.io/etcd/tests/v3/e2e (default below)
#   E2E_TESTS_COMMON  tests of go.etcd.io/etcd/tests/v3/common (default below)
#   E2E_TESTS_LOCAL   tests of this package (default below)
#                     Each is a list of test names; empty: none of the
#                     package's; all: every test the package's test binary
#                     lists (-test.list), each in a process of its own too;
#                     a name with a leading - is left out ("all -TestX").
#   E2E_PROXY         snapcache (default); etcd: the real `etcd grpc-proxy`,
#                     to tell the framework's or the test's own failures from
#                     etcd-snapcache's; none: no proxy, the tests against
#                     etcd alone (this package built with -tags e2e_direct),
#                     to measure what etcd itself does on this machine
#   E2E_TIMING_ATTEMPTS  attempts each timing test gets (default 3; below)
#   E2E_PROXY_ARGS    extra etcd-snapcache serve flags, after the framework's
#                     (e.g. --log-level=debug)
#   E2E_LOG_DIR       where logs go (default: a new temporary directory)
#   E2E_TIMEOUT       -test.timeout of each test (default 5m)
#   SNAPCACHE_BIN     the proxy binary (default bin/etcd-snapcache)
#   TOOLS_BIN         where etcd and etcdctl are (default .tools/bin)
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
snapcache=${SNAPCACHE_BIN:-$root/bin/etcd-snapcache}
tools=${TOOLS_BIN:-$root/.tools/bin}
timeout=${E2E_TIMEOUT:-5m}
proxy=${E2E_PROXY:-snapcache}

# go.etcd.io/etcd/tests/v3/e2e. testCtl runs one member unless withQuorum.
#  - the five TLS configurations, one test each: LeaseKeepAlive{,NoTLS,
#    ClientTLS,ClientAutoTLS,PeerTLS} and MemberUpdate{,NoTLS,ClientTLS,
#    ClientAutoTLS,PeerTLS} (the bare name is PeerAutoTLS, testCtl's
#    default); Watch{NoTLS,ClientTLS,PeerTLS}; GetFormat and GetRev
#    (PeerAutoTLS); PutClientTLSFlagByEnv (ClientTLS);
#  - GetRevokedCRL: ClientTLS with the member's --client-crl-file, which the
#    proxy is given too; etcdctl's revoked certificate must be refused;
#  - three members, three proxies: MoveLeaderScenarios (NoTLS, and ClientTLS
#    with PeerTLS), TxnRangeConsistency (NoTLS), AuthEndpointHealth
#    (PeerAutoTLS).
default_etcd="TestCtlV3LeaseKeepAlive TestCtlV3LeaseKeepAliveNoTLS TestCtlV3LeaseKeepAliveClientTLS
  TestCtlV3LeaseKeepAliveClientAutoTLS TestCtlV3LeaseKeepAlivePeerTLS
  TestCtlV3MemberUpdate TestCtlV3MemberUpdateNoTLS TestCtlV3MemberUpdateClientTLS
  TestCtlV3MemberUpdateClientAutoTLS TestCtlV3MemberUpdatePeerTLS
  TestCtlV3WatchNoTLS TestCtlV3WatchClientTLS TestCtlV3WatchPeerTLS
  TestCtlV3GetFormat TestCtlV3GetRev TestCtlV3PutClientTLSFlagByEnv TestCtlV3GetRevokedCRL
  TestCtlV3MoveLeaderScenarios TestTxnRangeConsistency TestCtlV3AuthEndpointHealth"
# go.etcd.io/etcd/tests/v3/common (-tags e2e): the whole package (about 11
# minutes on 2 cores), each test over NoTLS (one member), PeerTLS+ClientTLS
# and PeerAutoTLS+ClientAutoTLS (three members), or the configurations it
# sets itself. Left out, as it fails through etcd's grpc-proxy the same way
# (E2E_PROXY=etcd): TestAuthority. Its clients dial the members' own ports,
# bypassing the proxy, and it then looks in a member's log for the proxy's
# port as the :authority of the first request; the first one there is the
# proxy's own connection, with the member's port, whatever the proxy.
default_common="all -TestAuthority"
# This package: etcd's e2e/watch_test.go, which cluster_proxy builds leave
# out, copied (not TestResumeCompactionOnTombstone: it needs an etcd built
# with gofail failpoints); then two tests of ours: --metrics-addr URLs on
# three proxies, and a serializable read right after a write at start.
default_local="TestWatchDelayForPeriodicProgressNotification TestWatchDelayForManualProgressNotification
  TestWatchDelayForEvent TestStartWatcherFromCompactedRevision TestDeleteEventDrop_Issue18089
  TestWatchWithLowPermissionUser TestGrpcProxyMetricsAddr TestSerializableReadAfterWriteAtStart"
# Timing tests: etcd's three watch-delay tests assert that a watch response
# comes within 150ms of the one before while ten clients read the whole 5 MB
# keyspace in a loop. etcd builds them only without cluster_proxy ("These
# tests are performance sensitive"), and on 2 cores they fail against etcd
# alone too: TestWatchDelayForManualProgressNotification failed 3 runs in 11
# with E2E_PROXY=none (152-174ms), and 2 in 13 through the proxy (156, 194ms),
# each time in the first subtest, while both processes warm up. Each gets up
# to E2E_TIMING_ATTEMPTS attempts and passes if one does; every attempt's
# largest delays are printed, so a proxy slower than etcd shows, and a
# proxy that always misses still fails.
timing_tests=" TestWatchDelayForPeriodicProgressNotification TestWatchDelayForManualProgressNotification TestWatchDelayForEvent "
attempts_timing=${E2E_TIMING_ATTEMPTS:-3}
if [ "$proxy" = none ]; then
  # Against etcd alone only the timing tests mean anything.
  default_etcd= default_common= default_local=$timing_tests
fi
tests_etcd=${E2E_TESTS_ETCD-$default_etcd}
tests_common=${E2E_TESTS_COMMON-$default_common}
tests_local=${E2E_TESTS_LOCAL-$default_local}

for f in "$snapcache" "$tools/etcd" "$tools/etcdctl"; do
  [ -x "$f" ] || { echo "e2e: $f is missing: run make build tools-etcd" >&2; exit 2; }
done

logdir=${E2E_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/snapcache-e2e.XXXXXX")}
mkdir -p "$logdir"
logdir=$(cd "$logdir" && pwd)
wrapdir=$(mktemp -d "${TMPDIR:-/tmp}/snapcache-e2e-bin.XXXXXX")
trap 'rm -rf "$wrapdir"' EXIT
calls=$logdir/grpc-proxy.calls
: > "$calls"

# The wrapper. exec keeps the pid, so the framework's signals reach the proxy
# and the lines it prints carry the pid recorded here.
# tag_proxy: the build tag that makes the framework start a proxy per member;
# tag_local: this package's (e2e_direct builds its watch tests without one).
tag_proxy=cluster_proxy tag_local=cluster_proxy
case $proxy in
  snapcache) proxycmd="exec '$snapcache' serve \"\${@:3}\" ${E2E_PROXY_ARGS:-}" ;;
  etcd) proxycmd="exec '$tools/etcd' \"\$@\"" ;;
  none) proxycmd="echo 'e2e: E2E_PROXY=none starts no proxy' >&2; exit 2"; tag_proxy= tag_local=e2e_direct ;;
  *) echo "e2e: E2E_PROXY must be snapcache, etcd or none" >&2; exit 2 ;;
esac
cat > "$wrapdir/etcd" <<WRAP
#!/usr/bin/env bash
if [ "\${1:-}" = grpc-proxy ] && [ "\${2:-}" = start ]; then
  printf '%s\t%s\n' "\$\$" "\${*:3}" >> '$calls'
  $proxycmd
fi
exec '$tools/etcd' "\$@"
WRAP
chmod +x "$wrapdir/etcd"
ln -s "$tools/etcdctl" "$wrapdir/etcdctl"
if [ -x "$tools/etcdutl" ]; then ln -s "$tools/etcdutl" "$wrapdir/etcdutl"; fi

etcde2e=$(cd "$here" && go list -tags cluster_proxy -f '{{.Dir}}' go.etcd.io/etcd/tests/v3/e2e) || exit 2
fixtures=$(dirname "$etcde2e")/fixtures

# report LOG TEST RC: the test's result lines; for a failure, its error lines
# and the proxies' last lines.
report() {
  local log=$1 t=$2 rc=$3
  if [ "$rc" -eq 0 ]; then
    grep -E "^--- (PASS|SKIP): $t " "$log" || echo "--- PASS: $t (exit 0, no result line)"
    grep -E "^--- SKIP: $t " -A3 "$log" | grep -vE '^--- |^PASS$' | head -3 | sed 's/^/      /'
    grep -E "^ +--- SKIP: $t/" "$log" | awk '
      NR <= 4
      END { if (NR > 4) print "        ... and " NR - 4 " more skipped subtests" }'
    return
  fi
  grep -E "^--- FAIL: $t |^ +--- FAIL: " "$log" || echo "--- FAIL: $t (exit $rc, no result line: $(grep -E '^panic:|test timed out' "$log" | head -1))"
  awk -v calls="$calls" -v pfx="      " '
    BEGIN { while ((getline l < calls) > 0) { split(l, a, "\t"); proxy[a[1]] = 1 } }
    match($0, /\([0-9]+\): /) {
      pid = substr($0, RSTART + 1, RLENGTH - 4)
      if (pid in proxy) {
        if (!(pid in seen)) { seen[pid] = 1; order[++npid] = pid }
        all[pid]++
        if ($0 !~ /"level":"(info|debug)"/) { n[pid]++; pl[pid, n[pid] % 12] = substr($0, RSTART + RLENGTH) }
      } else if ($0 ~ /^[^ ]*\/etcdctl \(/) {
        # the last lines etcdctl printed (a command that printed nothing
        # does not show: the framework then waits for its expected output)
        c = $0; sub(/^[^ ]*\/etcdctl \([^ ]*\/etcdctl_/, "", c); gsub(/_/, " ", c)
        sub(/\) \(/, " [pid ", c); sub(/\): /, "]: ", c)
        nc++; cl[nc % 4] = c
      }
      next
    }
    /Generating read load|Got watch response|Changing working directory/ { next }
    inerr && !/^ +\t/ { inerr = 0 }
    /Error Trace:/ { inerr = 1 }
    inerr || /^panic:|_test\.go:[0-9]+:|leaked/ { if (ne < 40) el[++ne] = $0 }
    END {
      print pfx "errors:"
      for (i = 1; i <= ne; i++) print pfx "  " substr(el[i], 1, 400)
      if (nc) print pfx "etcdctl: the last " (nc > 4 ? 4 : nc) " of " nc " output lines (command [pid]: output):"
      for (i = (nc > 4 ? nc - 3 : 1); i <= nc; i++) print pfx "  " substr(cl[i % 4], 1, 300)
      for (j = 1; j <= npid; j++) {
        p = order[j]; s = n[p] > 12 ? n[p] - 11 : 1
        print pfx "proxy pid " p ": " all[p] " lines, " (n[p] + 0) " not info or debug" (n[p] ? ", the last " (n[p] - s + 1) ":" : "")
        for (i = s; i <= n[p]; i++) print pfx "  " substr(pl[p, i % 12], 1, 600)
      }
    }' "$log"
}

# skipped LOG TEST: whether TEST, which passed, reported --- SKIP, or every
# subtest that has none of its own did (Go prints a test whose subtests all
# skipped as passed).
skipped() {
  awk -v t="$2" '
    /^ *--- (PASS|SKIP|FAIL): / {
      if ($3 == t && $2 == "SKIP:") top = 1
      if (index($3, t "/") == 1) res[$3] = $2
    }
    END {
      if (top) exit 0
      for (s in res) {
        leaf = 1
        for (o in res) if (index(o, s "/") == 1) leaf = 0
        if (leaf) { leaves++; if (res[s] == "SKIP:") skips++ }
      }
      exit !(leaves > 0 && skips == leaves)
    }' "$1"
}

# maxdelays LOG WHAT: each subtest's largest watch delay over the 100ms
# period, as the watch-delay tests log it ("Max delay: ...").
maxdelays() {
  awk -v what="$2" '
    /^=== RUN / { sub(/^[^\/]*\/?/, "", $3); st = $3 }
    /Max delay: / { d = $NF; sub(/\.[0-9]+ms$/, "ms", d); line = line sep (st == "" ? "" : st " ") d; sep = ", " }
    END { if (line != "") print "      " what ": max delay " line }' "$1"
}

status=0 npass=0 nfail=0 nskip=0 counts=
# runpkg NAME TAGS PKG "TESTS" [DIR]: each test in DIR (default: PKG's);
# TESTS all: every test the compiled binary lists.
runpkg() {
  local name=$1 tags=$2 pkg=$3 tests=$4 dir=${5:-}
  [ -n "${tests// /}" ] || return 0
  local bin=$wrapdir/$name.test start=$SECONDS pass=0 fail=0 skip=0
  mkdir -p "$logdir/$name"
  echo "e2e: $pkg (-tags $tags)"
  if ! (cd "$here" && go test -c -tags "$tags" -o "$bin" "$pkg") > "$logdir/$name/build.log" 2>&1; then
    cat "$logdir/$name/build.log"; status=1; counts+="  $pkg: build failed"$'\n'; return
  fi
  [ -n "$dir" ] || dir=$(cd "$here" && go list -tags "$tags" -f '{{.Dir}}' "$pkg") ||
    { status=1; counts+="  $pkg: go list failed"$'\n'; return; }
  local t want=() out=()
  for t in $tests; do
    case $t in -*) out+=("${t#-}") ;; *) want+=("$t") ;; esac
  done
  if [ "${want[*]}" = all ]; then
    # -test.list prints the tests, benchmarks, fuzz tests and examples that
    # match; TestMain, which runs the others, is not one (go test leaves it
    # out of the list; the filter keeps it out all the same).
    want=($(cd "$dir" && "$bin" -test.list '.*' -bin-dir="$wrapdir" | grep -E '^Test' | grep -vx TestMain)) ||
      { echo "e2e: $pkg: listing its tests failed"; status=1; counts+="  $pkg: listing failed"$'\n'; return; }
  fi
  tests=
  for t in "${want[@]}"; do
    [[ " ${out[*]} " == *" $t "* ]] || tests+="$t "
  done
  echo "e2e: $pkg: $(echo $tests | wc -w) tests${out[*]:+, leaving out ${out[*]}}"
  for t in $tests; do
    local log=$logdir/$name/$t.log rc=0 attempt=1 attempts=1
    [[ "$timing_tests" != *" $t "* ]] || attempts=$attempts_timing
    while :; do
      rc=0
      (cd "$dir" && EXPECT_DEBUG=1 "$bin" -test.v -test.count=1 -test.timeout "$timeout" \
          -test.run "^$t\$" -bin-dir="$wrapdir") > "$log" 2>&1 || rc=$?
      [ "$attempts" -eq 1 ] || maxdelays "$log" "attempt $attempt of $attempts"
      [ $rc -ne 0 ] && [ $attempt -lt "$attempts" ] || break
      grep -E "^ +--- FAIL: " "$log" | sed "s/^ */      attempt $attempt: /"
      mv "$log" "${log%.log}.attempt$attempt.log"
      attempt=$((attempt + 1))
    done
    report "$log" "$t" "$rc"
    if [ $rc -ne 0 ]; then fail=$((fail + 1)); status=1
    elif skipped "$log" "$t"; then
      skip=$((skip + 1))
      grep -qE "^--- SKIP: $t " "$log" || echo "      (counted as skipped: every subtest was)"
    else pass=$((pass + 1)); fi
  done
  npass=$((npass + pass)) nfail=$((nfail + fail)) nskip=$((nskip + skip))
  counts+="  $pkg: $pass passed, $fail failed, $skip skipped, in $((SECONDS - start))s"$'\n'
  echo "e2e: $pkg: $((SECONDS - start))s"
}

start=$SECONDS
echo "e2e: grpc-proxy role: $proxy; logs in $logdir"
runpkg etcd-e2e "$tag_proxy" go.etcd.io/etcd/tests/v3/e2e "$tests_etcd"
runpkg etcd-common "e2e${tag_proxy:+,$tag_proxy}" go.etcd.io/etcd/tests/v3/common "$tests_common"
runpkg local "$tag_local" . "$tests_local" "$etcde2e"

nproxies=$(wc -l < "$calls")
echo "e2e: $nproxies grpc-proxy processes; their command lines (data dirs and fixture paths abridged):"
cut -f2 "$calls" | sed -E "s#$fixtures/#FIXTURES/#g; s#--data-dir [^ ]+#--data-dir DIR#; s#localhost:[0-9]+#localhost:PORT#g" |
  sort | uniq -c | sort -rn | sed 's/^/  /'
if [ "$nproxies" -eq 0 ] && [ "$proxy" != none ]; then
  echo "e2e: no grpc-proxy was started: nothing tested the proxy" >&2
  status=1
fi
printf 'e2e: per package:\n%s' "$counts"
echo "e2e: $npass passed, $nfail failed, $nskip skipped, in $((SECONDS - start))s; logs in $logdir"
exit $status
