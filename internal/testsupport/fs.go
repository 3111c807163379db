package testsupport

import (
	"os"
	"os/exec"
	"sync"
	"testing"
)

// ReadOnlyDir returns an empty directory that the kernel refuses to write
// in (ReadOnly), for tests of what a program does when it cannot.
func ReadOnlyDir(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	ReadOnly(tb, dir)
	return dir
}

// ReadOnly makes dir refuse writes until the test ends or the returned
// function is called: a read-only bind mount of itself when the test runs
// as root (root writes through file modes), else mode 0555.
func ReadOnly(tb testing.TB, dir string) (writable func()) {
	tb.Helper()
	var once sync.Once
	if os.Geteuid() != 0 {
		if err := os.Chmod(dir, 0o555); err != nil {
			tb.Fatal(err)
		}
		writable = func() { once.Do(func() { os.Chmod(dir, 0o755) }) }
	} else {
		if out, err := exec.Command("mount", "--bind", "-o", "ro", dir, dir).CombinedOutput(); err != nil {
			tb.Fatalf("making %s read-only with a bind mount: %v: %s", dir, err, out)
		}
		writable = func() {
			once.Do(func() {
				if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
					tb.Errorf("unmounting %s: %v: %s", dir, err, out)
				}
			})
		}
	}
	tb.Cleanup(writable)
	if f, err := os.CreateTemp(dir, "probe"); err == nil {
		f.Close()
		os.Remove(f.Name())
		tb.Fatalf("%s is still writable", dir)
	}
	return writable
}
