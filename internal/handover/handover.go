// Package handover hands a running proxy's listening sockets to a new
// process of it, so that a restart or an upgrade refuses no connection.
//
// The old process starts the new one (its executable as it is on disk now,
// with the same arguments) and passes it the listening sockets, and one
// end of a socket pair, as inherited file descriptors. The new process
// holds its accepts until it is ready, then says so on the pair; only
// then does the old one stop accepting and drain. Both accept on the same
// sockets for that moment, so every connection is accepted by one of
// them. If the new process fails before it is ready, the pair closes and
// the old one goes on serving.
//
// It is the mechanism nginx's binary upgrade and cloudflare/tableflip
// use; the sockets are never closed, so, unlike SO_REUSEPORT, no
// connection queued on a closing socket is reset.
package handover

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
)

// envFiles names the inherited descriptors: "name=fd,..." in the new
// process's environment.
const envFiles = "ETCD_SNAPCACHE_HANDOVER_FILES"

// controlName is the socket pair's inherited name.
const controlName = "control"

// readyLine is what the new process writes when it is ready.
const readyLine = "ready\n"

// Child is a new process started to take over.
type Child struct {
	cmd     *exec.Cmd
	control *os.File // the old process's end of the pair
	exited  chan struct{}
	err     error // Wait's, once exited is closed
}

// Start starts the new process with listeners, by name, inherited. Its
// standard output and error are the caller's.
func Start(listeners map[string]*os.File, extraEnv ...string) (*Child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("finding the executable to hand over to: %w", err)
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("handover socket pair: %w", err)
	}
	parent, child := os.NewFile(uintptr(fds[0]), "handover-parent"), os.NewFile(uintptr(fds[1]), "handover-child")
	defer child.Close()
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	var names []string
	add := func(name string, f *os.File) {
		// ExtraFiles[i] is descriptor 3+i in the child.
		names = append(names, fmt.Sprintf("%s=%d", name, 3+len(cmd.ExtraFiles)))
		cmd.ExtraFiles = append(cmd.ExtraFiles, f)
	}
	add(controlName, child)
	for name, f := range listeners {
		add(name, f)
	}
	cmd.Env = append(append(withoutHandover(os.Environ()), extraEnv...), envFiles+"="+strings.Join(names, ","))
	if err := cmd.Start(); err != nil {
		parent.Close()
		return nil, fmt.Errorf("starting %s: %w", exe, err)
	}
	c := &Child{cmd: cmd, control: parent, exited: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.exited)
	}()
	return c, nil
}

// withoutHandover is env without a handover of this process's own.
func withoutHandover(env []string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, envFiles+"=") {
			out = append(out, kv)
		}
	}
	return out
}

// Pid is the new process's.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// WaitReady waits until the new process says it is ready, and returns nil;
// or returns why it will not be: it exited or closed the pair, or ctx
// ended (then it is killed).
func (c *Child) WaitReady(ctx context.Context) error {
	line := make(chan error, 1)
	go func() {
		s, err := bufio.NewReader(c.control).ReadString('\n')
		switch {
		case err != nil:
			line <- fmt.Errorf("the new process closed the handover before it was ready: %w", err)
		case s != readyLine:
			line <- fmt.Errorf("the new process said %q", s)
		default:
			line <- nil
		}
	}()
	select {
	case err := <-line:
		if err != nil {
			c.abandon()
		}
		return err
	case <-ctx.Done():
		c.abandon()
		<-line
		return fmt.Errorf("the new process was not ready in time: %w", ctx.Err())
	}
}

// abandon kills the new process and waits for it.
func (c *Child) abandon() {
	_ = c.cmd.Process.Kill()
	c.control.Close()
	<-c.exited
}

// Exited is closed when the new process has exited; Err is then why.
func (c *Child) Exited() <-chan struct{} { return c.exited }

// Err is the new process's exit status, once Exited is closed.
func (c *Child) Err() error { return c.err }

// Inheritance is what a process started by Start inherited.
type Inheritance struct {
	control *os.File
	files   map[string]*os.File
}

// Inherited returns the handover this process was started for, or nil if
// it was started otherwise.
func Inherited() (*Inheritance, error) {
	spec, ok := os.LookupEnv(envFiles)
	if !ok {
		return nil, nil
	}
	os.Unsetenv(envFiles) // not for this process's own children
	in := &Inheritance{files: map[string]*os.File{}}
	for _, item := range strings.Split(spec, ",") {
		name, fd, ok := strings.Cut(item, "=")
		n, err := strconv.Atoi(fd)
		if !ok || err != nil || n < 3 {
			return nil, fmt.Errorf("%s: bad item %q", envFiles, item)
		}
		syscall.CloseOnExec(n)
		f := os.NewFile(uintptr(n), "handover-"+name)
		if name == controlName {
			in.control = f
			continue
		}
		in.files[name] = f
	}
	if in.control == nil {
		return nil, fmt.Errorf("%s: no control descriptor", envFiles)
	}
	return in, nil
}

// Listener returns the inherited listening socket called name, nil if
// none was.
func (in *Inheritance) Listener(name string) (net.Listener, error) {
	f, ok := in.files[name]
	if !ok {
		return nil, nil
	}
	defer f.Close() // FileListener holds its own copy
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("the inherited %s listener: %w", name, err)
	}
	return l, nil
}

// Ready tells the old process this one is ready: it stops accepting and
// drains.
func (in *Inheritance) Ready() error {
	defer in.control.Close()
	if _, err := in.control.WriteString(readyLine); err != nil {
		return fmt.Errorf("telling the old process this one is ready: %w", err)
	}
	return nil
}

// Close gives up the handover without being ready (the old process goes
// on serving).
func (in *Inheritance) Close() error {
	err := in.control.Close()
	for _, f := range in.files {
		f.Close()
	}
	if errors.Is(err, os.ErrClosed) {
		return nil
	}
	return err
}

// ListenerFile returns a copy of l's socket for Start: l must be a
// *net.TCPListener or *net.UnixListener.
func ListenerFile(l net.Listener) (*os.File, error) {
	type filer interface{ File() (*os.File, error) }
	fl, ok := l.(filer)
	if !ok {
		return nil, fmt.Errorf("a %T cannot be handed over", l)
	}
	f, err := fl.File()
	if err != nil {
		return nil, fmt.Errorf("handing over %s: %w", l.Addr(), err)
	}
	return f, nil
}
