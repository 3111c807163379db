package main

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// fakeServer records how it was stopped; its Stop waits, as a graceful
// stop waits for open requests, until StopNow or release.
type fakeServer struct {
	errc     chan error
	stopping chan struct{} // closed when Stop begins
	now      chan struct{} // closed by StopNow
	release  chan struct{} // closed to let a graceful Stop finish
}

func newFakeServer() *fakeServer {
	return &fakeServer{errc: make(chan error, 1), stopping: make(chan struct{}), now: make(chan struct{}), release: make(chan struct{})}
}

func (f *fakeServer) Err() <-chan error { return f.errc }

func (f *fakeServer) Stop() {
	select {
	case <-f.stopping:
		return // a second call returns once the first is done, as Server.Stop
	default:
	}
	close(f.stopping)
	select {
	case <-f.now:
	case <-f.release:
	}
}

func (f *fakeServer) StopNow() { close(f.now) }

// TestSecondSignalStopsAtOnce: the first SIGTERM or SIGINT stops the
// server gracefully and waits for it; a second one during that stop
// stops it at once.
func TestSecondSignalStopsAtOnce(t *testing.T) {
	srv := newFakeServer()
	sigs := make(chan os.Signal, 2)
	done := make(chan error, 1)
	go func() { done <- serveUntilStopped(zap.NewNop(), nil, sigs, nil, nil, srv) }()
	sigs <- syscall.SIGTERM
	<-srv.stopping
	select {
	case err := <-done:
		t.Fatalf("returned during the graceful stop: %v", err)
	default:
	}
	sigs <- syscall.SIGINT
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	select {
	case <-srv.now:
	default:
		t.Fatal("the second signal did not stop the server at once")
	}
}

// TestOneSignalStopsGracefully: one signal lets the graceful stop finish;
// a fatal error stops the server and is returned.
func TestOneSignalStopsGracefully(t *testing.T) {
	srv := newFakeServer()
	sigs := make(chan os.Signal, 2)
	sigs <- syscall.SIGINT
	close(srv.release)
	if err := serveUntilStopped(zap.NewNop(), nil, sigs, nil, nil, srv); err != nil {
		t.Fatal(err)
	}
	select {
	case <-srv.now:
		t.Fatal("one signal stopped the server at once")
	default:
	}

	srv = newFakeServer()
	close(srv.release)
	boom := errors.New("serving failed")
	srv.errc <- boom
	if err := serveUntilStopped(zap.NewNop(), nil, make(chan os.Signal), nil, nil, srv); !errors.Is(err, boom) {
		t.Fatalf("after a fatal error: %v", err)
	}
	if _, ok := <-srv.stopping; ok {
		t.Fatal("not stopped after a fatal error")
	}
}

// TestEmbeddedEtcdWarns: without --endpoints the proxy warns that its
// embedded etcd is for development, and warns again when the embedded
// etcd's data directory is new (an empty keyspace); a restart on the same
// directory does not say it is new.
func TestEmbeddedEtcdWarns(t *testing.T) {
	dir := t.TempDir() + "/etcd"
	start := func() []observer.LoggedEntry {
		t.Helper()
		core, logs := observer.New(zapcore.InfoLevel)
		e, err := startEmbedded(zap.New(core), server.EmbeddedConfig{Dir: dir})
		if err != nil {
			t.Fatal(err)
		}
		e.Close()
		return logs.FilterLevelExact(zapcore.WarnLevel).All()
	}
	warned := func(entries []observer.LoggedEntry, words string) bool {
		for _, e := range entries {
			if strings.Contains(e.Message, words) {
				return true
			}
		}
		return false
	}
	first := start()
	if !warned(first, "for development only") || !warned(first, "data directory is new") {
		t.Fatalf("first start on a new directory warned %v; want the development and the new-directory warnings", first)
	}
	second := start()
	if !warned(second, "for development only") || warned(second, "data directory is new") {
		t.Fatalf("restart on the same directory warned %v; want only the development warning", second)
	}
}
