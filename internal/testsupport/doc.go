// Package testsupport holds the helpers that the tests of every module of
// the repository share: the main module's packages, and the nested test
// modules integration/robustness and integration/clients. It uses the
// standard library alone, so that a module importing it gains no
// dependency: a TCP relay whose connections a test can cut (Relay), free
// loopback addresses and ports (FreeAddr, FreePorts), a test certificate
// authority for TLS and mTLS setups (PKI), and the one way tests wait for a
// condition (WaitFor, Poll), with a ticker and a deadline rather than
// pauses.
//
// Helpers that need etcd or the proxy's packages are in the sub-package
// servertest (of package server); a trace receiver for processes that
// export spans over OTLP is in the sub-package otlpsink.
//
// It is for tests only: no production code imports it.
package testsupport
