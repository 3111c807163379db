package main

import (
	"bytes"
	"reflect"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/etcd-snapcache/etcd-snapcache/revtree"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

// Every goroutine a test starts, an embedded etcd's and the proxy's
// included, must be gone when the tests end.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// run runs the CLI in-process and returns its output and error; exit codes
// are returned, not acted on.
func run(args ...string) (string, error) {
	var out bytes.Buffer
	app := newApp()
	app.Writer = &out
	app.ExitErrHandler = func(*cli.Context, error) {}
	err := app.Run(append([]string{"etcd-snapcache"}, args...))
	return out.String(), err
}

func TestVersion(t *testing.T) {
	out, err := run("version")
	if err != nil || !strings.Contains(out, "etcd-snapcache version:") || !strings.Contains(out, "etcd API version: 3.7") {
		t.Fatalf("version: %q, %v", out, err)
	}
}

// TestServeRejectsBadFlags: a bad flag value stops serve at once, before
// anything is dialed or bound, with one line that names the flag.
func TestServeRejectsBadFlags(t *testing.T) {
	missing := t.TempDir() + "/missing.pem"
	ep := []string{"serve", "--endpoints", "127.0.0.1:2379", "--listen-addr", "127.0.0.1:0"}
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"serve", "--log-level", "loud"}, "--log-level"},
		{append(ep, "--consistent-read-fallback", "maybe"), "--consistent-read-fallback"},
		{[]string{"serve", "--endpoints="}, "--endpoints"},
		{[]string{"serve", "--endpoints", "::bad"}, "--endpoints"},
		{[]string{"serve", "--endpoints", "ftp://etcd:2379"}, "--endpoints"},
		{append(ep, "--cert-file", missing, "--key-file", missing), "--cert-file"},
		{append(ep, "--cacert", missing), "--cacert"},
		{append(ep, "--cert-file", missing), "--cert-file"},
		{append(ep, "--tls-min-version", "TLS1.9"), "--tls-min-version"},
		{append(ep, "--tls-max-version", "SSL3"), "--tls-max-version"},
		{append(ep, "--tls-min-version", "TLS1.3", "--tls-max-version", "TLS1.2"), "--tls-min-version"},
		{append(ep, "--listen-cipher-suites", "TLS_NOT_A_SUITE"), "--listen-cipher-suites"},
		{append(ep, "--tls-min-version", "TLS1.3", "--listen-cipher-suites", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"), "--listen-cipher-suites"},
		{append(ep, "--metrics-addr", "ftp://127.0.0.1:1"), "--metrics-addr"},
		{append(ep, "--metrics-addr", "http://[::1"), "--metrics-addr"},
		{append(ep, "--metrics", "verbose"), "--metrics"},
		{append(ep, "--auto-tls", "--self-signed-cert-validity", "0"), "--self-signed-cert-validity"},
		{append(ep, "--resolver-prefix", "/proxies"), "--resolver-ttl"},
		{append(ep, "--resolver-ttl", "10"), "--resolver-prefix"},
		{append(ep, "--namespace", "/tenant/"), "--namespace"},
		{append(ep, "--experimental-leasing-prefix", "/lease/"), "--experimental-leasing-prefix"},
		{append(ep, "--max-history-bytes", "-1"), "--max-history-bytes"},
		{append(ep, "--memory-limit", "lots"), "--memory-limit"},
		{append(ep, "--memory-limit", "3XB"), "--memory-limit"},
	} {
		_, err := run(tc.args...)
		if err == nil {
			t.Errorf("%v: no error", tc.args)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, tc.flag) || strings.Contains(msg, "\n") {
			t.Errorf("%v: %q, want one line naming %s", tc.args, msg, tc.flag)
		}
	}
}

// TestServeTakesEtcdE2EProxyFlags: etcd's e2e framework passes
// --client-crl-file with http endpoints and no serving certificate, which
// grpc-proxy ignores, and an empty --advertise-client-url, which makes
// MemberList etcd's; serve does the same.
func TestServeTakesEtcdE2EProxyFlags(t *testing.T) {
	app := newApp()
	var cfgErr error
	var cfg server.Config
	app.Commands[0].Action = func(c *cli.Context) error {
		cfg, cfgErr = serverConfig(c, zap.NewNop())
		return nil
	}
	err := app.Run([]string{"etcd-snapcache", "serve", "--endpoints", "http://127.0.0.1:2379",
		"--client-crl-file", t.TempDir() + "/revoke.crl", "--advertise-client-url", ""})
	if err != nil || cfgErr != nil {
		t.Fatalf("a CRL without serving TLS: %v, %v", err, cfgErr)
	}
	if !cfg.ForwardMemberList || len(cfg.AdvertiseClientURLs) != 0 {
		t.Fatalf("--advertise-client-url '': ForwardMemberList %v, URLs %q", cfg.ForwardMemberList, cfg.AdvertiseClientURLs)
	}
}

// parseServe returns the server configuration `serve args...` makes, and
// serverConfig's error.
func parseServe(t *testing.T, args ...string) (server.Config, error) {
	t.Helper()
	app := newApp()
	var cfg server.Config
	var cfgErr error
	app.Commands[0].Action = func(c *cli.Context) error {
		cfg, cfgErr = serverConfig(c, zap.NewNop())
		return nil
	}
	if err := app.Run(append([]string{"etcd-snapcache", "serve"}, args...)); err != nil {
		t.Fatal(err)
	}
	return cfg, cfgErr
}

// TestServeWithoutEndpoints: no --endpoints is the embedded etcd (make
// run), whose endpoint is known only once it has started; the rest of the
// configuration is still checked.
func TestServeWithoutEndpoints(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{nil, ""},
		{[]string{"--btree-degree", "1"}, "--btree-degree"},
	} {
		cfg, cfgErr := parseServe(t, tc.args...)
		switch {
		case tc.wantErr == "" && cfgErr != nil:
			t.Errorf("%v: %v", tc.args, cfgErr)
		case tc.wantErr == "" && len(cfg.Endpoints) != 0:
			t.Errorf("%v: endpoints %q, want none (the embedded etcd's, once started)", tc.args, cfg.Endpoints)
		case tc.wantErr != "" && (cfgErr == nil || !strings.Contains(cfgErr.Error(), tc.wantErr)):
			t.Errorf("%v: error %v, want one naming %s", tc.args, cfgErr, tc.wantErr)
		}
	}
}

// TestServeMaxHistoryBytes: --max-history-bytes reaches the server as a
// byte count; not given, the default; 0, unbounded (the server's 0 too).
func TestServeMaxHistoryBytes(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want int64
	}{
		{nil, revtree.DefaultMaxHistoryBytes},
		{[]string{"--max-history-bytes", "1048576"}, 1 << 20},
		{[]string{"--max-history-bytes=0"}, 0},
	} {
		cfg, err := parseServe(t, append([]string{"--endpoints", "http://127.0.0.1:2379"}, tc.args...)...)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if cfg.MaxHistoryBytes != tc.want {
			t.Errorf("%v: MaxHistoryBytes %d, want %d", tc.args, cfg.MaxHistoryBytes, tc.want)
		}
	}
}

// TestServeMemoryLimit: --memory-limit reaches the server as a byte count
// (units as Kubernetes and etcd write them); auto and not given, the
// automatic limit; 0, none.
func TestServeMemoryLimit(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want server.MemoryLimit
	}{
		{nil, server.MemoryLimit{Mode: server.MemoryLimitAuto}},
		{[]string{"--memory-limit=auto"}, server.MemoryLimit{Mode: server.MemoryLimitAuto}},
		{[]string{"--memory-limit", "3GiB"}, server.FixedMemoryLimit(3 << 30)},
		{[]string{"--memory-limit", "512Mi"}, server.FixedMemoryLimit(512 << 20)},
		{[]string{"--memory-limit", "2G"}, server.FixedMemoryLimit(2e9)},
		{[]string{"--memory-limit", "1073741824"}, server.FixedMemoryLimit(1 << 30)},
		{[]string{"--memory-limit=0"}, server.MemoryLimit{Mode: server.MemoryLimitNone}},
	} {
		cfg, err := parseServe(t, append([]string{"--endpoints", "http://127.0.0.1:2379"}, tc.args...)...)
		if err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if cfg.MemoryLimit != tc.want {
			t.Errorf("%v: MemoryLimit %v, want %v", tc.args, cfg.MemoryLimit, tc.want)
		}
	}
}

// TestServeDefaultsAreDefaultConfig: `serve` with only --endpoints is
// server.DefaultConfig, field for field: every flag takes its default from
// it, and no default lives in a flag alone.
func TestServeDefaultsAreDefaultConfig(t *testing.T) {
	cfg, err := parseServe(t, "--endpoints", "http://127.0.0.1:2379")
	if err != nil {
		t.Fatal(err)
	}
	want := server.DefaultConfig()
	want.Endpoints = []string{"http://127.0.0.1:2379"}
	cfg.Logger = nil
	if len(cfg.AdvertiseClientURLs) == 0 {
		cfg.AdvertiseClientURLs = nil // the flag's empty list: the default
	}
	got, wantV := reflect.ValueOf(cfg), reflect.ValueOf(want)
	for i := range got.NumField() {
		if !reflect.DeepEqual(got.Field(i).Interface(), wantV.Field(i).Interface()) {
			t.Errorf("serve's %s is %#v, DefaultConfig's %#v", got.Type().Field(i).Name, got.Field(i).Interface(), wantV.Field(i).Interface())
		}
	}
}
