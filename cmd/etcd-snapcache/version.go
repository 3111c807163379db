package main

import (
	"fmt"
	"runtime"

	"github.com/urfave/cli/v2"

	etcdversion "go.etcd.io/etcd/api/v3/version"
)

func versionCommand() *cli.Command {
	return &cli.Command{
		Name:  "version",
		Usage: "print the version of etcd-snapcache and of the etcd API it speaks",
		Action: func(c *cli.Context) error {
			fmt.Fprintf(c.App.Writer, "etcd-snapcache version: %s\netcd API version: %s\nGo version: %s\nGo OS/Arch: %s/%s\n",
				version, etcdversion.Version, runtime.Version(), runtime.GOOS, runtime.GOARCH)
			return nil
		},
	}
}
