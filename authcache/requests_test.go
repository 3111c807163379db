package authcache_test

import (
	"testing"

	"github.com/etcd-snapcache/etcd-snapcache/authcache"
)

// TestRulesFor: the release differences read from etcd's sources.
func TestRulesFor(t *testing.T) {
	for _, tc := range []struct {
		version string
		want    authcache.Rules
	}{
		{"3.7.3", authcache.Rules{Release: "3.7.3", BearerStripped: true}},
		{"3.6.16", authcache.Rules{Release: "3.6.16", BearerStripped: true, AuthStatusAdminOnly: true}},
		{"3.6.12", authcache.Rules{Release: "3.6.12", AuthStatusAdminOnly: true}},
		{"3.6.11", authcache.Rules{Release: "3.6.11", AuthStatusAdminOnly: true, StatusAdminOnly: true}},
		{"3.6.9", authcache.Rules{Release: "3.6.9", AuthStatusAdminOnly: true, StatusAdminOnly: true, MemberListAdminOnly: true, AlarmGetAdminOnly: true, Stricter: true}},
		{"3.5.35", authcache.Rules{Release: "3.5.35", BearerStripped: true, AuthStatusAdminOnly: true}},
		{"3.4.30", authcache.Rules{Release: "3.4.30", AuthStatusAdminOnly: true, StatusAdminOnly: true, MemberListAdminOnly: true, AlarmGetAdminOnly: true, Stricter: true}},
	} {
		got, err := authcache.RulesFor(tc.version)
		if err != nil || got != tc.want {
			t.Errorf("RulesFor(%q) = %+v, %v; want %+v", tc.version, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "3", "3.x.1", "4.0.0"} {
		if _, err := authcache.RulesFor(bad); err == nil {
			t.Errorf("RulesFor(%q) accepted", bad)
		}
	}
}
