module github.com/etcd-snapcache/etcd-snapcache/integration/clients

go 1.26.8

replace github.com/etcd-snapcache/etcd-snapcache => ../..

require github.com/etcd-snapcache/etcd-snapcache v0.0.0-00010101000000-000000000000

require go.yaml.in/yaml/v3 v3.0.5
