// Package e2e holds the process-level benchmarks (`make bench-e2e`): etcd
// runs as a separate process, the etcd binary that tools/build.sh builds
// into .tools/bin, so that what is measured of the proxy is the proxy's
// own, never etcd's.
//
// # Throughput: three processes
//
// The throughput benchmarks measure the proxy as users run it: etcd, the
// proxy (bin/etcd-snapcache, from `make build`, started as `etcd-snapcache
// serve --endpoints=<etcd> --listen-addr=... --metrics-addr=...`) and the
// load generator (the benchmark's process) are three processes, talking
// over 127.0.0.1. In one process, the proxy shares the Go runtime, the
// scheduler and the CPUs with its clients and with etcd, and its numbers
// are flattered (a linearizable Get measured 1.21x etcd's throughput in
// process, 0.76x as three processes).
//
// Each benchmark starts a fresh etcd (data in a temporary directory,
// --unsafe-no-fsync) and a proxy in front of it before writing its data,
// so that the proxy holds every revision read in memory, waits until the
// proxy's cache has applied the data (its /proxy/status's revision) and,
// for the Range workloads, checks that both sides return the same keys.
// Then one warm-up round per side (not reported), and -snapcache.e2e.rounds
// measured rounds per side, alternating: etcd,proxy, proxy,etcd, ... on the
// same etcd and data; the load goes to etcd directly in etcd's rounds and
// through the proxy in the proxy's. Every round is bounded: a closed-loop
// round lasts -snapcache.e2e.round or -snapcache.e2e.maxops ops, whichever
// ends first (each op within -snapcache.e2e.op-timeout); a watch round ends
// when every event has arrived, within -snapcache.e2e.watch-timeout.
//
// Per side, each benchmark reports (b.ReportMetric, and SUMMARY lines on
// stdout with every round's values):
//
//   - ops/s (events/s for the watch), over all its rounds, and the ratio
//     proxy/etcd, with each round pair's ratio;
//   - CPU per op of the serving path: etcd's alone for the direct path, the
//     proxy's plus etcd's through the proxy (utime+stime of each process,
//     from /proc/<pid>/stat, in 10ms ticks, before and after each round);
//     the proxy idles during etcd's rounds (it only follows etcd's watch)
//     and is not counted there. The load generator's own CPU per op is
//     shown in brackets;
//   - allocations per op of the serving processes: go_memstats_mallocs_total
//     of etcd (its /metrics, on its client URL) and of the proxy (its own
//     /proxy/metrics on --metrics-addr; its /metrics relays etcd's), before
//     and after each round;
//   - the KV requests etcd received per op (through the proxy: its read
//     fences and forwarded reads), and the share of the proxy's Ranges it
//     served from its cache (its /proxy/status's range_requests).
//
// A run's ns/op is hidden: a run is fixed rounds, not b.N ops; read ops/s.
// The rounds do not depend on -benchtime: with `-benchtime 1x` (or any
// shorter than a benchmark's run) each benchmark runs once.
//
// With -snapcache.e2e.pprof, etcd and the proxy serve /debug/pprof/ and
// the benchmark prints where (a PPROF line on stdout), so that either
// can be profiled while its rounds run, for example with `go tool pprof
// -seconds 20 <proxy>/debug/pprof/profile`.
//
// Benchmarks:
//
//   - BenchmarkLinearizableGet: a linearizable single-key Get (kube-
//     apiserver's GET and its etcd health check) from
//     -snapcache.e2e.get-clients (32) goroutines over -snapcache.e2e.conns
//     (4) clientv3 connections, as one client process with a few
//     connections sends them; 1000 keys of 1 KiB.
//   - BenchmarkWatchFanout: -snapcache.e2e.watchers (5,000) watchers of one
//     prefix with prev_kv, on -snapcache.e2e.watch-conns (50) connections,
//     one watch stream each (as clientv3 multiplexes a client's watchers);
//     then -snapcache.e2e.watch-puts (200) puts of existing keys (256 B),
//     one after another through the side measured. An op is an event
//     delivered: events/s from the first put's start to the last event's
//     receipt, and the delivery latency, from the event's put's start to
//     its receipt (p50-ms, p99-ms, max-ms: medians of the rounds'). Each
//     round opens new streams and watchers (create-s, not measured).
//   - BenchmarkPaginatedList: one op is a whole kube-apiserver-style LIST of
//     10k keys of 1 KiB at a fixed past revision R (2000 revisions after
//     it): pages of -snapcache.e2e.page (500), each continuing from the last
//     key + "\x00" at the same revision; -snapcache.e2e.range-clients (4)
//     goroutines over the connections.
//   - BenchmarkHistoricalRange/{128B,1KiB}: one op is a full Range of 10k
//     keys at R (a LIST at an exact resourceVersion, without a limit), values
//     of 128 B and of 1 KiB.
//   - BenchmarkKubeList/{full,paginated}: two unmodified kube-apiservers
//     (.tools/bin/kube-apiserver, from `make tools-kube`; skipped without
//     it) with --watch-cache=false, one on etcd, one on the proxy (both on
//     the same etcd); -snapcache.e2e.kube-objects (2,000) ConfigMaps of 1 KiB
//     in one namespace, LISTed by -snapcache.e2e.kube-clients (4) clients
//     over one HTTP/2 connection per kube-apiserver, as JSON. One op is a
//     whole LIST: one request without a limit ("full"), or pages of
//     -snapcache.e2e.kube-page (500) following continue tokens
//     ("paginated"). It also reports etcd-cpu-ms and kube-cpu-ms: etcd's and
//     that kube-apiserver's CPU time per LIST.
//   - BenchmarkControlPlane: a production control plane, in phases rather
//     than rounds. -snapcache.e2e.cp-apiservers (3) unmodified
//     kube-apiservers with their watch caches on (the default), in front of
//     etcd ("direct") and in front of the proxy ("proxy", one process in
//     front of the same etcd, running and loaded before its side begins),
//     one side's pass after the other on the same etcd and data (etcd
//     compacted at each pass's start); -snapcache.e2e.cp-rounds (1) passes
//     per side, alternating. The objects (-snapcache.e2e.cp-objects, 100k:
//     -snapcache.e2e.cp-nodes (500) Nodes and their Leases, the rest half
//     Pods, half ConfigMaps, in a namespace per 1,000; ConfigMaps of 1–4
//     KiB, Nodes of 2–4 KiB, Pods of 3–4 KiB as stored, kube-apiserver's
//     defaults and managedFields included) are created through the
//     kube-apiservers first; the SUMMARY's setup line says what etcd then
//     holds. The load is bench/kubeload (bin/kubeload, `make kubeload`; a
//     module of its own, so that client-go stays out of the main module), a
//     client-go process that answers the benchmark's commands on stdin with
//     JSON lines: informers (client-go shared informers: LIST then WATCH
//     with bookmarks, resuming, relisting when they must;
//     -snapcache.e2e.cp-watchlist for watch-list) on pods, nodes, configmaps
//     and leases from -snapcache.e2e.cp-informers (2) client connections per
//     kube-apiserver; a Lease renewal per node every 10 s, pod and node
//     status updates, ConfigMap updates, pod and ConfigMap creates and
//     deletes, GETs, consistent LISTs and LISTs at a resourceVersion, each
//     at a fixed rate (-snapcache.e2e.cp-rate scales them). Each client has
//     a home kube-apiserver and goes to another only while its home is not
//     ready, as through a load balancer that checks /readyz. Each
//     kube-apiserver runs in a UTS namespace of its own where unshare(1) can
//     make one (its identity Lease is named after its hostname). The phases:
//     start-storm (every kube-apiserver starting at once, then the clients,
//     until every informer has synced and caught up), steady
//     (-snapcache.e2e.cp-steady, 1m), restart-all (every kube-apiserver
//     stopped and started at once) and restart-one (the first one while the
//     others serve), and on the proxy side alone restart-proxy (the proxy
//     in front of the first kube-apiserver stopped and started again, cold,
//     under load: it loads the keyspace from etcd, and its kube-apiservers
//     reconnect and resume their watches; its SUMMARY is the proxy side's,
//     with etcd's CPU in all); a restart phase lasts until every kube-apiserver is
//     ready and every informer has seen a barrier written after it (a token
//     on an object of each resource), then -snapcache.e2e.cp-settle (20s). A
//     kube-apiserver stopped (SIGTERM) with watches open exits only when
//     killed, 15 s later, as kubelet kills it after its grace period.
//     -snapcache.e2e.cp-phases selects the phases and their order (the
//     default: the six above; start-storm always runs first, as it brings
//     the side up, and is reported only if listed), and adds maintenance
//     phases: what operators do to etcd, and what fails in it, under the
//     steady load, on both sides alike. They need several members:
//     -snapcache.e2e.cp-etcd-members (by default 3 when a maintenance
//     phase is selected, else 1, as before) starts etcd as that many
//     processes with a static --initial-cluster on loopback; the
//     kube-apiservers direct get every member in --etcd-servers, the
//     proxies every member in --endpoints. rolling-restart: each member in
//     turn stopped (SIGTERM) and started again on its data, the next once
//     every member answers Status with one leader. defrag: 200 keys of 64
//     KiB in a prefix no one reads written, deleted and compacted, which
//     leaves free pages, then `etcdctl defrag` against each member alone,
//     in turn. move-leader: `etcdctl move-leader` three times, 5 s apart,
//     each time to the next member. hung-leader: the leader stopped
//     (SIGSTOP) for 15 s, then continued (SIGCONT). hung-watch-member: the
//     same for the member with the most watch streams
//     (etcd_debugging_mvcc_watch_stream_total, each member's): through the
//     proxy, the member of the proxy's upstream watch (its kube-apiservers
//     reach no member; the fault line adds the member /proxy/status
//     names); direct, the member of most of the kube-apiservers' watches.
//     lost-member: a follower (not the one behind cut-connection's relay)
//     killed (SIGKILL) with its data, then replaced as operators do
//     (`etcdctl member remove`, its data wiped, `etcdctl member add`,
//     started with --initial-cluster-state=existing). cut-connection: the
//     clients of the side (the kube-apiservers direct, the proxy's
//     upstream connections through it) reach the first member (where the
//     proxy's upstream watch was in every smoke run; the fault line gives
//     each member's watch streams) through a TCP relay for the whole run
//     when this phase is selected
//     (testsupport.Relay; the benchmark's own clients reach every member
//     directly), and the relay holds up every byte both ways for 20 s
//     without closing anything (Stall), as a link that drops every packet
//     does, then lets them through. downgrade-upgrade: etcd's downgrade
//     procedure from 3.7 to 3.6 (`etcdctl downgrade validate 3.6` and
//     `enable 3.6`, every member's storage version at 3.6, then each member
//     restarted on etcd-3.6 from tools/build.sh in turn, as rolling-restart
//     does), then each member restarted on 3.7 in turn, until the cluster
//     version is 3.7 again. A maintenance phase lasts until the
//     fault is undone and the cluster healthy, then as a restart phase:
//     until every kube-apiserver is ready and every informer has caught
//     up, then -snapcache.e2e.cp-settle. Its SUMMARY has a "fault" line
//     beside the others: what was done and how long it took, the
//     kube-apiservers' 5xx and 429 answers by verb and code (504: their
//     timeouts), the informers' lists (relists) and watches (each a watch
//     stream that ended and was resumed), and on the proxy side how long a
//     proxy's /readyz (polled every 250 ms in maintenance phases only) was
//     not 200 and how many times a proxy reloaded the keyspace or resumed
//     its upstream watch (etcd_snapcache_reloads_total, _loads_total,
//     _upstream_watch_restarts_total). Per phase and side (SUMMARY
//     lines): etcd's CPU per second, resident memory
//     (VmRSS) and its peak in the phase (VmHWM after clear_refs, and a 250ms
//     sampler), etcd_debugging_mvcc_watcher_total, and etcd's requests per
//     second by gRPC method (grpc_server_handled_total), each summed over
//     the members and the processes a member had in the phase (with
//     several members, the CPU by member too); the proxy's own CPU
//     and memory; the kube-apiservers' CPU per second and their request
//     latency p50/p99 per verb (their apiserver_request_duration_seconds,
//     summed over every kube-apiserver and generation), its 5xx and 429
//     answers, and the lines of its logs that are errors, relists, "too
//     large resource version", "too old resource version", timeouts or slow
//     watchers closed; the informers' event delay (each write stamps its
//     object with its wall time, each informer's handler records its
//     lateness), lists, watches and errors; the load's CPU, ops, errors and
//     p99 latency per kind. The header line has etcd's CPU and peak memory
//     proxy/direct. On 2 cores the load generator (which decodes every
//     informer's LISTs) and the kube-apiservers saturate the CPUs in the
//     storm and restart phases: their durations and informer delays are then
//     mostly the machine's. About 15 minutes at the defaults on 2 cores; a
//     smoke run: -snapcache.e2e.cp-objects=5000
//     -snapcache.e2e.cp-apiservers=2 -snapcache.e2e.cp-steady=20s
//     -snapcache.e2e.cp-settle=5s. With -snapcache.e2e.cp-storm-load=false
//     the load's writes and reads (the Lease renewals too) pause in
//     start-storm and restart-all (the informers still start, sync and
//     catch up; the barriers still write): those phases then measure the
//     storm's own cost, the kube-apiservers' LISTs and watches; the load
//     resumes before steady and restart-one. -snapcache.e2e.cp-topology
//     sets the proxy side's proxies: shared (one proxy in front of etcd for
//     every kube-apiserver, the default), sidecar (one per kube-apiserver,
//     each in front of etcd) or tiered (one in front of etcd, and one per
//     kube-apiserver in front of it); the proxy's CPU and memory are then
//     summed over every proxy. With -snapcache.e2e.pprof, etcd and the
//     proxies run with --enable-pprof, and CPU profiles are taken: of etcd
//     for the first 30 s of each storm (start-storm, restart-all; waited
//     for after the phase's end, so the profile may run past it, with the
//     load still paused if -snapcache.e2e.cp-storm-load=false), and of
//     etcd and the first proxy for 20 s in the middle of each side's
//     steady phase, saved under $TMPDIR (cp-pprof-*; their paths
//     printed); PROFILE lines give, for etcd, the share of its samples by what each
//     stack does (range: Range and read-only Txns; watch: notifying,
//     syncing and sending to watchers; apply: Txns, Puts and Deletes,
//     raft, the apply, the backend's commits, the WAL; lease; compact;
//     grpc-send: gRPC's writes to its connections, every response's and
//     watch event's; grpc: the rest of gRPC's transport; gc; other), each
//     also as CPU s/s, and the top frames by cumulative share (`go tool
//     pprof -top -cum`, but for gRPC's and the apply's wrappers), and for
//     the proxy its top frames; BenchmarkProfileSummary
//     (-snapcache.e2e.cp-profiles, -snapcache.e2e.cp-profile-secs) reads
//     saved ones again.
//   - BenchmarkQuietCluster: what the proxy costs a quiet cluster, where
//     most clusters spend most of their time. etcd holds
//     -snapcache.e2e.quiet-keys (100k) keys of 1 KiB; one proxy process
//     with default flags follows it throughout. Windows of
//     -snapcache.e2e.quiet-window (20 s), CPU per second of each process
//     from /proc: no client at all ("idle"); -snapcache.e2e.quiet-write-rate
//     (20) single-key puts/s to etcd with no other client ("writes": the
//     proxy's CPU per write, over idle); for each count of
//     -snapcache.e2e.quiet-streams (200,2000), that many idle watch
//     streams, one a connection, each with one watch of a prefix with
//     prev_kv (unless -snapcache.e2e.quiet-prevkv=false) and
//     progress_notify from the head (kube-apiserver's cacher's shape), on etcd directly and then through the proxy (the proxy's CPU
//     per stream, over idle); and for the first count, the streams with
//     the puts, sent through the side measured. The streams watch
//     -snapcache.e2e.quiet-prefixes (1: every stream the whole keyspace,
//     so every put is an event on every stream; 100: a namespace each, a
//     few streams a put). SUMMARY lines: etcd's and the proxy's CPU in
//     ms/s and resident memory, etcd's watchers, watch streams and
//     requests per second, events received per second, and etcd+proxy
//     over etcd direct. With -snapcache.e2e.pprof, the proxy's CPU profile
//     of each of its windows is saved under $TMPDIR (quiet-pprof-*).
//   - BenchmarkHistoryMemory: the proxy's heap per retained revision,
//     without a history budget, and its heap under a budget
//     (--max-history-bytes). Here the proxy runs in the benchmark's
//     process: its live heap is then read exactly, with runtime.ReadMemStats
//     right after a forced collection, whereas a proxy process's /metrics
//     (go_memstats_heap_alloc_bytes) counts garbage not yet collected, up to
//     twice the live heap at GOGC=100. The benchmark's own clients keep
//     little and the same amount before and after what is measured.
//   - BenchmarkKeyspaceMemory: what the live keyspace costs the proxy
//     process with default flags, at -snapcache.e2e.keyspace-keys keys
//     (100000; run it at 100000,1000000) of 1 KiB values
//     (.keyspace-value), with --memory-limit=0 and with the default soft
//     limit (.keyspace-modes): the live heap after a forced collection
//     (the proxy's /debug/pprof/heap?gc=1, then its
//     go_memstats_heap_alloc_bytes), per key and over the data; the peak
//     RSS during the cold load (VmHWM once ready); RSS and RssAnon once
//     the first copy to disk is written and after .keyspace-steady (50,000)
//     puts, over the live heap then; the limit; etcd's RSS.
//     .keyspace-profiles saves the proxy's heap profiles.
//   - BenchmarkRestart: a restart of the proxy process over 100k and 1M
//     keys of 1 KiB (-snapcache.e2e.restart-keys, .restart-value): the
//     time from the new process's start to its /readyz, the bytes etcd
//     sent (etcd_network_client_grpc_sent_bytes_total) and the CPU it
//     spent meanwhile, and the proxy's memory once ready; b.N restarts,
//     the medians reported.
//   - BenchmarkPersistOverhead: what the copy on disk (--persist-cache)
//     costs: one etcd, two proxies following it, "on" (the default flags)
//     and "off" (--persist-cache=false); -snapcache.e2e.persist-rounds (3)
//     rounds of each workload, medians and the ratio on/off. apply:
//     -snapcache.e2e.persist-revisions (20,000) puts of 1 KiB by 16 writers,
//     followed by both at once: each one's CPU per 1000 revisions (until
//     both caches and on's copy hold etcd's head), its catch-up lag from
//     the writer's end (until a put right after the writer's last reaches
//     the proxy's watcher of it: polling /proxy/metrics, a few ms of the
//     proxy's CPU a scrape, would add to what is measured), on's lag to
//     its copy (etcd_snapcache_disk_revision, polled every 100ms), and
//     RSS. reads: -snapcache.e2e.persist-reads (200,000) serializable
//     single-key Gets from -snapcache.e2e.persist-read-clients (32)
//     goroutines through one proxy at a time while etcd is written at
//     -snapcache.e2e.persist-write-rate (500) revisions/s: ops/s and the
//     proxy's CPU per 10k ops. watch: -snapcache.e2e.persist-watchers (100)
//     watchers of the prefix on one proxy at a time, then
//     -snapcache.e2e.persist-watch-puts (5,000) puts: the time until every
//     watcher has every event, and events/s. Reads and watch alternate
//     on,off, off,on, .... Then on's writes of its copy during the run
//     (etcd_snapcache_disk_writes_total, the mean of
//     etcd_snapcache_disk_write_seconds); etcd_snapcache_disk_write_failing
//     must be 0.
//   - BenchmarkTracingCost: what --enable-distributed-tracing costs: one
//     etcd with -snapcache.e2e.tracing-keys (10,000) keys, and three proxies
//     in front of it, off, rate0 (tracing on, sampling rate 0: callers send
//     no trace context, so nothing is sampled) and rate100 (every request
//     sampled), tracing into a test OTLP receiver in the benchmark's
//     process; -snapcache.e2e.tracing-rounds (4) rounds that rotate the
//     order of etcd direct and the three, each of
//     -snapcache.e2e.tracing-gets (10,000) linearizable Gets of one key by
//     .tracing-get-clients (8), then .tracing-ranges (40) Ranges of every
//     key by .tracing-range-clients (2): per variant, ops/s, latency, the
//     serving process's CPU and allocations (go_memstats_mallocs_total) per
//     op, and the ratios to tracing off.
//
// With -snapcache.e2e.auth, etcd has auth enabled (a root user, and a user
// "bench" whose role may read and write /registry/), the proxy runs with
// --user=root, and the load authenticates as "bench", directly and through
// the proxy; the SUMMARY lines say "(auth on)". Run it beside the run
// without to compare. BenchmarkKubeList then runs as clusters that enable
// etcd's RBAC do: kube-apiserver authenticates by client certificate only,
// so etcd and the proxy serve mTLS with --client-cert-auth, kube-apiserver
// presents a certificate for the user kube-apiserver (read-write on
// /registry/, read on compact_rev_key), and the proxy reaches etcd with a
// certificate that names no user, as root by password (newKubeEnv).
//
// With -snapcache.e2e.tls, every hop is mTLS, as production runs it: one
// CA (internal/testsupport's PKI, WriteKubeEtcdPKI's files); etcd serves
// TLS with its certificate for 127.0.0.1, --client-cert-auth and the CA
// trusted; the proxy serves mTLS the same way (--cert-file, --key-file,
// --trusted-ca-file, --client-cert-auth) and reaches etcd with a client
// certificate that names no user (--cacert, --cert, --key); the load
// presents a client certificate without a common name to each side, and
// so do the kube-apiservers of BenchmarkKubeList and BenchmarkControlPlane
// (--etcd-cafile, --etcd-certfile, --etcd-keyfile; to the proxies and to
// etcd), the proxies of its sidecar and tiered topologies to their
// upstream too. It applies to the throughput benchmarks (newPairEnv, and
// BenchmarkWatchFanout's watch connections), BenchmarkKubeList,
// BenchmarkControlPlane and BenchmarkPersistOverhead (both proxies); the
// memory and restart benchmarks stay plaintext. With -snapcache.e2e.auth
// as well, etcd has auth on and the proxy runs as root, as above. The
// metrics are still read in plaintext (etcd's on a --listen-metrics-urls
// port of their own, the proxy's on --metrics-addr); with
// -snapcache.e2e.pprof, /debug/pprof/ is on the client ports, over mTLS
// (the PPROF line gives `go tool pprof`'s -tls_* flags). The SUMMARY
// lines of an mTLS run name the benchmark with "/tls" (e.g. "SUMMARY
// BenchmarkLinearizableGet/tls: proxy/etcd ..."; BenchmarkKubeList's auth
// runs too, mTLS either way), and a benchmark run starts with a
// configuration line of Go's benchmark format, "transport: tls" or
// "transport: plaintext" (benchstat -col transport), so that a plaintext
// run and an mTLS run put side by side give the ratios and etcd's CPU per
// op over each.
//
// Run (after -args, or in BENCH_E2E_FLAGS for make):
//
//	make bench-e2e BENCH='Linearizable|Watch|Paginated|Historical|KubeList' BENCHTIME=1x
//	make bench-e2e BENCH='Linearizable|Watch|Paginated|Historical|KubeList' BENCHTIME=1x BENCH_E2E_FLAGS=-snapcache.e2e.auth
//	make bench-e2e BENCH='Linearizable|Watch|Paginated|Historical|KubeList' BENCHTIME=1x BENCH_E2E_FLAGS=-snapcache.e2e.tls
//	make bench-e2e BENCH=ControlPlane
//	make bench-e2e BENCH=ControlPlane BENCH_E2E_FLAGS=-snapcache.e2e.tls
//	make bench-e2e BENCH=ControlPlane BENCH_E2E_FLAGS=-snapcache.e2e.cp-phases=steady,rolling-restart,defrag,move-leader,hung-leader,hung-watch-member,lost-member,cut-connection,downgrade-upgrade
//
// Flags: the throughput benchmarks' -snapcache.e2e.rounds, .round,
// .maxops, .conns, .op-timeout, .auth, .tls, .get-clients, .get-keys,
// .range-keys, .range-updates, .range-clients, .page, .watchers,
// .watch-conns, .watch-puts, .watch-keys, .watch-value, .watch-timeout,
// .kube-objects, .kube-value, .kube-clients, .kube-page;
// BenchmarkControlPlane's -snapcache.e2e.cp-objects, .cp-apiservers,
// .cp-nodes, .cp-informers, .cp-steady, .cp-settle, .cp-rounds, .cp-rate,
// .cp-watchlist, .cp-storm-load, .cp-topology, .cp-sides, .cp-proxy-flags,
// .cp-phases, .cp-etcd-members, .cp-timeout (and .pprof,
// .tls); BenchmarkQuietCluster's -snapcache.e2e.quiet-keys, .quiet-value,
// .quiet-streams, .quiet-prefixes, .quiet-prevkv, .quiet-write-rate, .quiet-write-value,
// .quiet-window, .quiet-rounds (and .pprof); BenchmarkHistoryMemory's
// -snapcache.e2e.keys, .revisions, .value, .budget, .writers; BenchmarkKeyspaceMemory's
// -snapcache.e2e.keyspace-keys, .keyspace-value, .keyspace-steady,
// .keyspace-modes, .keyspace-profiles; BenchmarkRestart's
// -snapcache.e2e.restart-keys, .restart-value; BenchmarkPersistOverhead's
// -snapcache.e2e.persist-rounds, .persist-keys, .persist-revisions,
// .persist-reads, .persist-read-clients, .persist-write-rate,
// .persist-watchers, .persist-watch-puts (and .conns, .watch-timeout,
// .auth, .tls, .pprof); BenchmarkTracingCost's -snapcache.e2e.tracing-rounds,
// .tracing-gets, .tracing-get-clients, .tracing-ranges,
// .tracing-range-clients, .tracing-keys, .tracing-value (and .conns,
// .pprof). $ETCD_BIN
// overrides the etcd binary, $SNAPCACHE_BIN the proxy's,
// $KUBE_APISERVER_BIN kube-apiserver's, $KUBELOAD_BIN the load
// generator's, $ETCDCTL_BIN etcdctl's (the maintenance phases).
package e2e
