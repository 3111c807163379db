//go:build e2edeps

// Never built (no build uses the e2edeps tag), but `go mod tidy` reads
// every file whatever its tags: these are the packages that etcd's e2e and
// common test packages import, so that go.mod and go.sum keep what
// `go test go.etcd.io/etcd/tests/v3/e2e` and `.../common` need (go mod tidy
// keeps the dependencies of this module's own packages and tests only).
// Regenerate after a version bump with
//
//	go list -tags e2e,cluster_proxy -e -f '{{join .TestImports "\n"}}{{"\n"}}{{join .Imports "\n"}}' \
//	    go.etcd.io/etcd/tests/v3/e2e go.etcd.io/etcd/tests/v3/common | grep '\.' | sort -u

package e2e

import (
	_ "github.com/coreos/go-semver/semver"
	_ "github.com/golang-jwt/jwt/v5"
	_ "github.com/golang/protobuf/proto"
	_ "github.com/google/go-cmp/cmp"
	_ "github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	_ "github.com/stretchr/testify/assert"
	_ "github.com/stretchr/testify/require"
	_ "go.etcd.io/etcd/api/v3/authpb"
	_ "go.etcd.io/etcd/api/v3/etcdserverpb"
	_ "go.etcd.io/etcd/api/v3/mvccpb"
	_ "go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	_ "go.etcd.io/etcd/api/v3/version"
	_ "go.etcd.io/etcd/client/pkg/v3/fileutil"
	_ "go.etcd.io/etcd/client/pkg/v3/testutil"
	_ "go.etcd.io/etcd/client/pkg/v3/transport"
	_ "go.etcd.io/etcd/client/pkg/v3/types"
	_ "go.etcd.io/etcd/client/v3"
	_ "go.etcd.io/etcd/etcdutl/v3/snapshot"
	_ "go.etcd.io/etcd/pkg/v3/expect"
	_ "go.etcd.io/etcd/pkg/v3/featuregate"
	_ "go.etcd.io/etcd/pkg/v3/flags"
	_ "go.etcd.io/etcd/pkg/v3/stringutil"
	_ "go.etcd.io/etcd/server/v3/embed"
	_ "go.etcd.io/etcd/server/v3/etcdserver"
	_ "go.etcd.io/etcd/server/v3/etcdserver/api/membership"
	_ "go.etcd.io/etcd/server/v3/etcdserver/api/snap"
	_ "go.etcd.io/etcd/server/v3/etcdserver/api/v2store"
	_ "go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
	_ "go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
	_ "go.etcd.io/etcd/server/v3/etcdserver/txn"
	_ "go.etcd.io/etcd/server/v3/storage/datadir"
	_ "go.etcd.io/etcd/server/v3/storage/mvcc/testutil"
	_ "go.etcd.io/etcd/tests/v3/framework"
	_ "go.etcd.io/etcd/tests/v3/framework/config"
	_ "go.etcd.io/etcd/tests/v3/framework/e2e"
	_ "go.etcd.io/etcd/tests/v3/framework/integration"
	_ "go.etcd.io/etcd/tests/v3/framework/interfaces"
	_ "go.etcd.io/etcd/tests/v3/framework/testutils"
	_ "go.etcd.io/raft/v3"
	_ "go.uber.org/zap"
	_ "go.uber.org/zap/zaptest"
	_ "golang.org/x/sync/errgroup"
	_ "google.golang.org/protobuf/encoding/protojson"
	_ "google.golang.org/protobuf/proto"
	_ "google.golang.org/protobuf/testing/protocmp"
)
