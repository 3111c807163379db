// Command kube-apiserver is an unmodified kube-apiserver, built from the
// released k8s.io/kubernetes module named in go.mod. It is the same main as
// k8s.io/kubernetes/cmd/kube-apiserver/apiserver.go.
//
// Build it with tools/build.sh (or `make tools`), not from here: the script
// stamps the version that kube-apiserver reports and uses for its feature
// gates' emulation version.
package main

import (
	"os"
	_ "time/tzdata" // for timeZone support in CronJob

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // load all the prometheus client-go plugins
	_ "k8s.io/component-base/metrics/prometheus/version"  // for version metric registration
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	command := app.NewAPIServerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
