package server

import (
	"net"
	"os"
	"sync"

	"github.com/etcd-snapcache/etcd-snapcache/internal/handover"
)

// Names of the listening sockets a handover passes on.
const (
	clientListenerName  = "client"
	metricsListenerName = "metrics"
)

// Inherited are listening sockets handed over by a running proxy
// (internal/handover): the new process serves on them instead of
// listening, and accepts nothing on them until it is ready, while the old
// process still serves.
type Inherited struct {
	// Client is the --listen-addr socket; Metrics the --metrics-addr
	// one, nil if the old process had none.
	Client, Metrics net.Listener
}

// ListenerFiles returns copies of the listening sockets, by name, for a
// new process to take over (handover.Start).
func (s *Server) ListenerFiles() (map[string]*os.File, error) {
	files := map[string]*os.File{}
	for name, l := range map[string]net.Listener{clientListenerName: s.clientRaw, metricsListenerName: s.metricsRaw} {
		if l == nil {
			continue
		}
		f, err := handover.ListenerFile(l)
		if err != nil {
			for _, f := range files {
				f.Close()
			}
			return nil, err
		}
		files[name] = f
	}
	return files, nil
}

// InheritedListeners turns the listening sockets a handover passed on into
// an Inherited.
func InheritedListeners(in *handover.Inheritance) (Inherited, error) {
	client, err := in.Listener(clientListenerName)
	if err != nil {
		return Inherited{}, err
	}
	metrics, err := in.Listener(metricsListenerName)
	if err != nil {
		if client != nil {
			client.Close()
		}
		return Inherited{}, err
	}
	return Inherited{Client: client, Metrics: metrics}, nil
}

// ReleaseDisk writes the cache's copy on disk a last time and closes it,
// for a new process to restore from; the copy is not written again until
// ResumeDisk. Without a copy it does nothing.
func (s *Server) ReleaseDisk() error {
	if s.persister == nil {
		return nil
	}
	return s.persister.Release(s.follower)
}

// ResumeDisk takes the copy on disk back after a handover failed.
func (s *Server) ResumeDisk() {
	if s.persister != nil {
		s.persister.Resume()
	}
}

// heldListener is a listener whose Accept waits until open is closed: a
// process taking over holds its accepts until it is ready, so that the
// old process serves every connection until then.
type heldListener struct {
	net.Listener
	open   chan struct{}
	closed chan struct{}
	once   sync.Once
}

func holdAccepts(l net.Listener, open chan struct{}) net.Listener {
	return &heldListener{Listener: l, open: open, closed: make(chan struct{})}
}

func (l *heldListener) Accept() (net.Conn, error) {
	select {
	case <-l.open:
		return l.Listener.Accept()
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *heldListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return l.Listener.Close()
}
