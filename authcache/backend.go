package authcache

import (
	"sort"
	"sync"

	"go.etcd.io/etcd/api/v3/authpb"
	"go.etcd.io/etcd/server/v3/auth"
)

// memBackend is an in-memory auth.AuthBackend: etcd's auth store runs on it
// unchanged, reading the users and roles of one Snapshot. It is written
// only while the store is built.
type memBackend struct {
	mu sync.RWMutex
	// Guarded by mu.
	enabled  bool
	revision uint64
	users    map[string]*authpb.User
	roles    map[string]*authpb.Role
}

var (
	_ auth.AuthBackend = (*memBackend)(nil)
	_ auth.AuthReadTx  = (*memTx)(nil)
	_ auth.AuthBatchTx = (*memTx)(nil)
)

func newMemBackend(s Snapshot) *memBackend {
	b := &memBackend{enabled: s.Enabled, revision: s.Revision, users: map[string]*authpb.User{}, roles: map[string]*authpb.Role{}}
	for _, u := range s.Users {
		b.users[string(u.Name)] = u
	}
	for _, r := range s.Roles {
		b.roles[string(r.Name)] = r
	}
	return b
}

func (b *memBackend) CreateAuthBuckets()        {}
func (b *memBackend) ForceCommit()              {}
func (b *memBackend) ReadTx() auth.AuthReadTx   { return &memTx{b} }
func (b *memBackend) BatchTx() auth.AuthBatchTx { return &memTx{b} }
func (b *memBackend) GetUser(n string) *authpb.User {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.users[n]
}
func (b *memBackend) GetAllUsers() []*authpb.User {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.allUsers()
}
func (b *memBackend) GetRole(n string) *authpb.Role {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.roles[n]
}
func (b *memBackend) GetAllRoles() []*authpb.Role {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.allRoles()
}

// allUsers and allRoles are sorted by name, as etcd's bbolt buckets are.
func (b *memBackend) allUsers() []*authpb.User {
	out := make([]*authpb.User, 0, len(b.users))
	for _, u := range b.users {
		out = append(out, u)
	}
	sort.Slice(out, func(i, j int) bool { return string(out[i].Name) < string(out[j].Name) })
	return out
}

func (b *memBackend) allRoles() []*authpb.Role {
	out := make([]*authpb.Role, 0, len(b.roles))
	for _, r := range b.roles {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return string(out[i].Name) < string(out[j].Name) })
	return out
}

// memTx is a transaction on memBackend; its locks are the backend's.
type memTx struct{ b *memBackend }

func (t *memTx) Lock()    { t.b.mu.Lock() }
func (t *memTx) Unlock()  { t.b.mu.Unlock() }
func (t *memTx) RLock()   { t.b.mu.RLock() }
func (t *memTx) RUnlock() { t.b.mu.RUnlock() }

// The Unsafe methods run with the lock held, as etcd's callers hold it.

func (t *memTx) UnsafeReadAuthEnabled() bool         { return t.b.enabled }
func (t *memTx) UnsafeReadAuthRevision() uint64      { return t.b.revision }
func (t *memTx) UnsafeGetUser(n string) *authpb.User { return t.b.users[n] }
func (t *memTx) UnsafeGetRole(n string) *authpb.Role { return t.b.roles[n] }
func (t *memTx) UnsafeGetAllUsers() []*authpb.User   { return t.b.allUsers() }
func (t *memTx) UnsafeGetAllRoles() []*authpb.Role   { return t.b.allRoles() }
func (t *memTx) UnsafeSaveAuthEnabled(enabled bool)  { t.b.enabled = enabled }
func (t *memTx) UnsafeSaveAuthRevision(rev uint64)   { t.b.revision = rev }
func (t *memTx) UnsafePutUser(u *authpb.User)        { t.b.users[string(u.Name)] = u }
func (t *memTx) UnsafeDeleteUser(n string)           { delete(t.b.users, n) }
func (t *memTx) UnsafePutRole(r *authpb.Role)        { t.b.roles[string(r.Name)] = r }
func (t *memTx) UnsafeDeleteRole(n string)           { delete(t.b.roles, n) }
