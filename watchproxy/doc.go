// Package watchproxy serves etcd's Watch service.
//
// For now it relays each client watch stream to etcd unchanged, one upstream
// stream per client stream, so watch behaviour is exactly etcd's. Serving
// watches from the proxy's own event history replaces this relay.
package watchproxy
