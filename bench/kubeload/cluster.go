package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// cluster is the kube-apiservers the load talks to, as clients reach them
// in production: through a load balancer that health-checks each one's
// /readyz. Each client has a home kube-apiserver; a new connection goes
// home while it is ready, else to the next ready one, and stays where it
// went (HTTP/2) until that kube-apiserver closes it.
type cluster struct {
	hosts   []string // 127.0.0.1:port of each kube-apiserver
	caFile  string   // the CA bundle that verifies every one of them
	token   string   // a bearer token every one of them accepts
	healthy []atomic.Bool
}

func newCluster(servers, caFile, token string) (*cluster, error) {
	c := &cluster{caFile: caFile, token: token}
	for s := range strings.SplitSeq(servers, ",") {
		s = strings.TrimPrefix(strings.TrimSpace(s), "https://")
		if s != "" {
			c.hosts = append(c.hosts, s)
		}
	}
	if len(c.hosts) == 0 || caFile == "" || token == "" {
		return nil, fmt.Errorf("-servers, -ca and -token are required")
	}
	c.healthy = make([]atomic.Bool, len(c.hosts))
	for i := range c.healthy {
		c.healthy[i].Store(true)
	}
	return c, nil
}

// checkHealth polls each kube-apiserver's /readyz every interval, as a
// load balancer does, until ctx ends.
func (c *cluster) checkHealth(ctx context.Context, interval time.Duration) error {
	pem, err := os.ReadFile(c.caFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificates in %s", c.caFile)
	}
	hc := &http.Client{Timeout: time.Second, Transport: &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"},
		DisableKeepAlives: true,
	}}
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			for i, h := range c.hosts {
				req, _ := http.NewRequestWithContext(ctx, "GET", "https://"+h+"/readyz", nil)
				req.Header.Set("Authorization", "Bearer "+c.token)
				resp, err := hc.Do(req)
				ok := err == nil && resp.StatusCode == http.StatusOK
				if err == nil {
					resp.Body.Close()
				}
				c.healthy[i].Store(ok)
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return nil
}

// dialer is the load balancer's choice for a client at home: home if
// ready, else the next ready kube-apiserver, else (none known ready) each
// in turn.
func (c *cluster) dialer(home int) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}
	n := len(c.hosts)
	return func(ctx context.Context, network, _ string) (net.Conn, error) {
		var order []int
		for k := range n {
			if i := (home + k) % n; c.healthy[i].Load() {
				order = append(order, i)
			}
		}
		for k := range n {
			if i := (home + k) % n; !c.healthy[i].Load() {
				order = append(order, i)
			}
		}
		var firstErr error
		for _, i := range order {
			conn, err := d.DialContext(ctx, network, c.hosts[i])
			if err == nil {
				return conn, nil
			}
			if firstErr == nil {
				firstErr = err
			}
		}
		return nil, firstErr
	}
}

// config is the rest.Config of one client process at home: its own
// connection (a Dial of its own keeps client-go from sharing a transport),
// protobuf as kube's own components speak it, and no client-side rate
// limit (the load sets its own rates). No client timeout, which would
// end watches too: each request of the load has a context deadline.
func (c *cluster) config(home int, agent string) *rest.Config {
	return &rest.Config{
		Host:            "https://" + c.hosts[home%len(c.hosts)],
		BearerToken:     c.token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: c.caFile, ServerName: "127.0.0.1"},
		ContentConfig: rest.ContentConfig{
			ContentType:        "application/vnd.kubernetes.protobuf",
			AcceptContentTypes: "application/vnd.kubernetes.protobuf,application/json",
		},
		UserAgent: "kubeload/" + agent,
		QPS:       -1,
		Dial:      c.dialer(home % len(c.hosts)),
	}
}

func (c *cluster) clientset(home int, agent string) (*kubernetes.Clientset, error) {
	return kubernetes.NewForConfig(c.config(home, agent))
}
