package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"go.uber.org/zap"

	"github.com/etcd-snapcache/etcd-snapcache/internal/handover"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// handoverTimeout bounds how long a running proxy waits for the process
// taking over to be ready: a cold load of a large keyspace takes tens of
// seconds; past this the new process is killed and the old one serves on.
const handoverTimeout = 5 * time.Minute

// takeOver prepares cfg to serve on the sockets a running proxy handed
// over, if this process was started for a handover (SIGHUP to the running
// one). Once ready it tells systemd it is the service's main process now
// and tells the old process to drain. Without a handover, it only tells
// systemd when the proxy is ready (Type=notify).
func takeOver(lg *zap.Logger, cfg *server.Config) error {
	in, err := handover.Inherited()
	if err != nil {
		return err
	}
	if in == nil {
		cfg.OnReady = func() { notifySystemd(lg, "READY=1") }
		return nil
	}
	if cfg.Inherited, err = server.InheritedListeners(in); err != nil {
		in.Close()
		return err
	}
	lg.Info("taking over from the running proxy: serving once ready", zap.Int("parent-pid", os.Getppid()))
	cfg.OnReady = func() {
		notifySystemd(lg, fmt.Sprintf("MAINPID=%d\nREADY=1", os.Getpid()))
		if err := in.Ready(); err != nil {
			lg.Warn("the old process did not hear that this one is ready; it drains when it stops", zap.Error(err))
		}
	}
	return nil
}

func notifySystemd(lg *zap.Logger, state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		lg.Warn("notifying systemd", zap.Error(err))
	}
}

// handOver starts a new process of the proxy (the executable on disk now,
// with the same arguments) on this one's listening sockets and copy on
// disk, and waits until it is ready: then this one must drain. It reports
// false, and this process serves on, if the new one fails first.
func handOver(lg *zap.Logger, srv *server.Server, sigs <-chan os.Signal) (*handover.Child, bool) {
	files, err := srv.ListenerFiles()
	if err != nil {
		lg.Error("cannot hand over; serving on", zap.Error(err))
		return nil, false
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	if err := srv.ReleaseDisk(); err != nil {
		lg.Warn("the copy on disk is not up to date for the new process; it reads more from etcd", zap.Error(err))
	}
	child, err := handover.Start(files)
	if err != nil {
		srv.ResumeDisk()
		lg.Error("cannot hand over; serving on", zap.Error(err))
		return nil, false
	}
	lg.Info("handing over to a new process; serving until it is ready", zap.Int("pid", child.Pid()))
	ctx, cancel := context.WithTimeout(context.Background(), handoverTimeout)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- child.WaitReady(ctx) }()
	select {
	case err = <-ready:
	case sig := <-sigs:
		lg.Warn("stopping during a handover: the new process is stopped", zap.Stringer("signal", sig))
		cancel()
		<-ready
		srv.ResumeDisk()
		return nil, false
	}
	if err != nil {
		srv.ResumeDisk()
		lg.Error("the new process did not take over; serving on", zap.Error(err))
		return nil, false
	}
	lg.Info("the new process is ready: draining", zap.Int("pid", child.Pid()))
	return child, true
}

// reapAsInit keeps process 1 of a container alive after it handed over:
// the container ends when it does. It relays stop signals to the new
// process and exits with it.
func reapAsInit(lg *zap.Logger, child *handover.Child) error {
	if os.Getpid() != 1 {
		return nil
	}
	lg.Info("process 1 of the container: waiting for the process that took over", zap.Int("pid", child.Pid()))
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	for {
		select {
		case <-child.Exited():
			return child.Err()
		case sig := <-sigs:
			_ = syscall.Kill(child.Pid(), sig.(syscall.Signal))
		}
	}
}
