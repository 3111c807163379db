// Package integration holds the end-to-end tests of etcd-snapcache: a real
// etcd (embedded in the test process) with the proxy in front of it, driven
// by real clients, and every answer compared with etcd's own.
package integration
