// Package server assembles etcd-snapcache: it dials the upstream etcd
// cluster, runs the follower that keeps the revtree store in step with it,
// and serves the etcd v3 gRPC API (KV and Watch through kvproxy and
// watchproxy; Lease, Cluster, Maintenance and Auth forwarded) together with
// an HTTP endpoint for Prometheus metrics and health checks.
//
// Every goroutine it starts is owned by a Server and ends with Stop.
package server
