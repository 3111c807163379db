package testsupport

import (
	"os"
	"os/exec"
	"testing"
)

// ReadOnlyDir returns an empty directory that the kernel refuses to write
// in, for tests of what a program does when it cannot: a read-only bind
// mount of itself when the test runs as root (root writes through file
// modes), else a directory of mode 0555. It is made writable again and
// removed when the test ends.
func ReadOnlyDir(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	if os.Geteuid() != 0 {
		if err := os.Chmod(dir, 0o555); err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { os.Chmod(dir, 0o755) })
		return dir
	}
	if out, err := exec.Command("mount", "--bind", "-o", "ro", dir, dir).CombinedOutput(); err != nil {
		tb.Fatalf("making %s read-only with a bind mount: %v: %s", dir, err, out)
	}
	tb.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			tb.Errorf("unmounting %s: %v: %s", dir, err, out)
		}
	})
	if f, err := os.CreateTemp(dir, "probe"); err == nil {
		f.Close()
		tb.Fatalf("%s is still writable after a read-only bind mount", dir)
	}
	return dir
}
