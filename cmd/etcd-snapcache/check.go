package main

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/urfave/cli/v2"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcd-snapcache/etcd-snapcache/hashcheck"
	"github.com/etcd-snapcache/etcd-snapcache/server"
)

func checkCommand() *cli.Command {
	return &cli.Command{
		Name:  "check",
		Usage: "compare a running proxy's keyspace with etcd's at one revision; exit 1 on a mismatch",
		Description: "check reads the proxy's current revision R, then hashes (key, mod_revision) of every key\n" +
			"at R as the proxy answers and as etcd answers (paginated keys-only Ranges), and compares.",
		Flags: []cli.Flag{
			&cli.StringSliceFlag{Name: "endpoints", Usage: "etcd client endpoints", Required: true},
			&cli.StringSliceFlag{Name: "proxy", Usage: "the proxy's client endpoint", Required: true},
			&cli.StringFlag{Name: "cacert", Usage: "verify servers' certificates with this CA bundle"},
			&cli.StringFlag{Name: "cert", Usage: "client certificate"},
			&cli.StringFlag{Name: "key", Usage: "client key"},
			&cli.DurationFlag{Name: "timeout", Value: time.Minute, Usage: "timeout of the whole check"},
		},
		Action: check,
	}
}

func check(c *cli.Context) error {
	tlsInfo := transport.TLSInfo{CertFile: c.String("cert"), KeyFile: c.String("key"), TrustedCAFile: c.String("cacert")}
	etcd, err := dial(c.StringSlice("endpoints"), tlsInfo)
	if err != nil {
		return err
	}
	defer etcd.Close()
	proxy, err := dial(c.StringSlice("proxy"), tlsInfo)
	if err != nil {
		return err
	}
	defer proxy.Close()

	ctx, cancel := context.WithTimeout(c.Context, c.Duration("timeout"))
	defer cancel()
	proxyKV, etcdKV := pb.NewKVClient(proxy.ActiveConnection()), pb.NewKVClient(etcd.ActiveConnection())
	// The proxy's revision: a serializable read is answered by its cache.
	head, err := proxyKV.Range(ctx, &pb.RangeRequest{Key: []byte{0}, CountOnly: true, Serializable: true})
	if err != nil {
		return fmt.Errorf("reading the proxy's revision: %w", err)
	}
	rev := head.Header.Revision
	res, err := hashcheck.Compare(rev, hashcheck.RangeEntries(ctx, proxyKV, rev), hashcheck.RangeEntries(ctx, etcdKV, rev))
	if err != nil {
		return err
	}
	fmt.Fprintf(c.App.Writer, "revision %d: %d keys; proxy hash %016x, etcd hash %016x\n", res.Rev, res.Keys, res.CacheHash, res.EtcdHash)
	if !res.Match() {
		return cli.Exit("MISMATCH: "+res.FirstDiff, 1)
	}
	fmt.Fprintln(c.App.Writer, "OK: the proxy matches etcd")
	return nil
}

func dial(endpoints []string, info transport.TLSInfo) (*clientv3.Client, error) {
	tlsCfg, err := server.ClientTLSConfig(info, false)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		TLS:         tlsCfg,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32))},
	})
	if err != nil {
		return nil, fmt.Errorf("connecting to %v: %w", endpoints, err)
	}
	return cli, nil
}
