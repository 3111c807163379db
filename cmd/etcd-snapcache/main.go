// Command etcd-snapcache serves the etcd v3 API in front of an etcd cluster,
// answering reads at any retained revision from an in-memory MVCC copy.
package main

import (
	"fmt"
	"os"

	"github.com/urfave/cli/v2"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	if err := newApp().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "etcd-snapcache:", err)
		os.Exit(1)
	}
}

func newApp() *cli.App {
	return &cli.App{
		Name:  "etcd-snapcache",
		Usage: "an etcd v3 endpoint that serves reads at any revision from an in-memory MVCC cache",
		Description: "etcd-snapcache sits in front of an etcd cluster. Clients (kube-apiserver, etcdctl,\n" +
			"clientv3 programs) connect to it as if it were etcd. It keeps a copy-on-write\n" +
			"snapshot of the keyspace for every revision etcd retains, fed by one upstream\n" +
			"watch, and answers historical and serializable reads from memory. Writes,\n" +
			"leases, auth, cluster and maintenance calls go to etcd.",
		Version:  version,
		Commands: []*cli.Command{serveCommand(), checkCommand(), statusCommand(), versionCommand()},
		// Hide the global --version flag: the version command says more.
		HideVersion: true,
	}
}
