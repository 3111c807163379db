package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// kubeload is the load generator (bench/kubeload) run as a process: its
// commands go to its stdin, its answers come on its stdout, one JSON line
// each; its log (client-go's) is a file.
type kubeload struct {
	cmd     *exec.Cmd
	in      io.WriteCloser
	lines   chan []byte
	done    chan struct{}
	logPath string
}

// loadCmd is kubeload sub with the cluster's flags and extra.
func (cp *controlPlane) loadCmd(ctx context.Context, sub string, extra ...string) *exec.Cmd {
	servers := ""
	for i, k := range cp.kubes {
		if i > 0 {
			servers += ","
		}
		servers += k.url()
	}
	args := append([]string{sub,
		"-servers=" + servers, "-ca=" + cp.caFile, "-token=" + cp.token,
		"-objects=" + strconv.Itoa(*cpObjects), "-nodes=" + strconv.Itoa(*cpNodes),
	}, extra...)
	return exec.CommandContext(ctx, cp.loadBin, args...)
}

// startLoad starts `kubeload run`: informers and the workload, on every
// kube-apiserver; it is stopped when the benchmark ends.
func (cp *controlPlane) startLoad(b *testing.B, side string, round int) *kubeload {
	b.Helper()
	l := &kubeload{lines: make(chan []byte, 16), done: make(chan struct{}),
		logPath: filepath.Join(cp.dir, fmt.Sprintf("kubeload-%s-%d.log", side, round))}
	logf, err := os.Create(l.logPath)
	if err != nil {
		b.Fatal(err)
	}
	l.cmd = cp.loadCmd(context.Background(), "run",
		"-run-id="+fmt.Sprintf("%s%d", side, round),
		"-informers="+strconv.Itoa(*cpInformers),
		"-rate-scale="+strconv.FormatFloat(*cpRate, 'g', -1, 64),
		"-watch-list="+strconv.FormatBool(*cpWatchList),
		// Without the load in the storms, it starts paused: start-storm.
		"-paused="+strconv.FormatBool(!*cpStormLoad),
		"-wait-timeout="+cpTimeout.String())
	l.cmd.Stderr = logf
	// The informers' LISTs of 100k objects come all at once after a
	// restart: a soft limit keeps the load's heap from doubling past them.
	l.cmd.Env = append(os.Environ(), "GOMEMLIMIT=4GiB")
	if v, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		l.cmd.Env = append(l.cmd.Env, "GOMEMLIMIT="+v)
	}
	if l.in, err = l.cmd.StdinPipe(); err != nil {
		b.Fatal(err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		b.Fatal(err)
	}
	l.cmd.Stdout = pw
	if err := l.cmd.Start(); err != nil {
		b.Fatal(err)
	}
	pw.Close()
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			l.lines <- bytes.Clone(sc.Bytes())
		}
		pr.Close()
		close(l.lines)
	}()
	go func() {
		l.cmd.Wait()
		logf.Close()
		close(l.done)
	}()
	b.Cleanup(func() { l.stop(b) })
	cp.load = l
	return l
}

// loadReply is kubeload's answer to a command.
type loadReply struct {
	Cmd    string      `json:"cmd"`
	OK     bool        `json:"ok"`
	Secs   float64     `json:"secs"`
	Error  string      `json:"error"`
	Report *loadReport `json:"report"`
}

// loadReport is what kubeload measured in a phase.
type loadReport struct {
	Secs        float64             `json:"secs"`
	Ops         map[string]loadDist `json:"ops"`
	Skipped     int64               `json:"skipped"`
	Delay       loadDist            `json:"delay"`
	DelayByRes  map[string]loadDist `json:"delay_by_resource"`
	Lists       int64               `json:"lists"`
	Watches     int64               `json:"watches"`
	WatchErrors int64               `json:"watch_errors"`
	OutOfOrder  int64               `json:"out_of_order"`
	Repeated    int64               `json:"repeated"`
	Errors      []string            `json:"error_samples"`
}

type loadDist struct {
	N      int64   `json:"n"`
	Errors int64   `json:"errors"`
	P50    float64 `json:"p50_ms"`
	P99    float64 `json:"p99_ms"`
	Max    float64 `json:"max_ms"`
}

// do sends cmd and returns kubeload's answer; it fails the benchmark if
// kubeload does not answer within the wait bound.
func (l *kubeload) do(b *testing.B, cmd string) loadReply {
	b.Helper()
	if _, err := fmt.Fprintln(l.in, cmd); err != nil {
		b.Fatalf("kubeload %s: %v: %s", cmd, err, tailOf(l.logPath))
	}
	select {
	case line, ok := <-l.lines:
		if !ok {
			<-l.done
			b.Fatalf("kubeload exited (%v): %s", l.cmd.ProcessState, tailOf(l.logPath))
		}
		var r loadReply
		if err := json.Unmarshal(line, &r); err != nil {
			b.Fatalf("kubeload %s: %v: %s", cmd, err, line)
		}
		return r
	case <-time.After(*cpTimeout + time.Minute):
		b.Fatalf("kubeload %s: no answer within %v: %s", cmd, *cpTimeout+time.Minute, tailOf(l.logPath))
	}
	return loadReply{}
}

func (l *kubeload) alive() error {
	select {
	case <-l.done:
		return fmt.Errorf("kubeload exited (%v): %s", l.cmd.ProcessState, tailOf(l.logPath))
	default:
		return nil
	}
}

// stop asks kubeload to stop, and kills it if it has not within a minute.
func (l *kubeload) stop(b *testing.B) {
	select {
	case <-l.done:
		return
	default:
	}
	fmt.Fprintln(l.in, "stop")
	l.in.Close()
	select {
	case <-l.done:
	case <-time.After(time.Minute):
		b.Logf("kubeload did not stop; killing it")
		l.cmd.Process.Kill()
		<-l.done
	}
	for range l.lines {
	}
}

// jsonLine decodes the last line of out into v.
func jsonLine(out []byte, v any) error {
	lines := bytes.Split(bytes.TrimSpace(out), []byte("\n"))
	return json.Unmarshal(lines[len(lines)-1], v)
}

func readAll(resp *http.Response) ([]byte, error) { return io.ReadAll(resp.Body) }
