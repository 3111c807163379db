module github.com/etcd-snapcache/etcd-snapcache/integration/clients

go 1.26.0
