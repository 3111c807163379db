// The docs directory holds the project's documentation. This test keeps
// architecture.md's map of packages true to the tree: a package added
// without a row, a row left for a package removed, or a package without the
// doc comment that says what it is for fails it.
package docs

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// repoRoot is the repository, from this test's directory.
const repoRoot = ".."

// packageRow is a row of architecture.md's package table: | `path` | job |.
var packageRow = regexp.MustCompile("(?m)^\\| `([^`]+)` \\|")

// skipped are directories that hold no package of the project's: tools'
// output, logs, and test data.
func skipped(rel string, d fs.DirEntry) bool {
	name := d.Name()
	return rel != "." && (strings.HasPrefix(name, ".") || name == "testdata" || name == "node_modules" || rel == "bin" || rel == "docs")
}

// packages returns every directory of the tree (nested modules included)
// with Go files other than tests, and whether each has a doc comment.
func packages(t *testing.T) map[string]bool {
	t.Helper()
	pkgs := map[string]bool{}
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(repoRoot, path)
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if skipped(rel, d) {
			return filepath.SkipDir
		}
		files, err := filepath.Glob(filepath.Join(path, "*.go"))
		if err != nil {
			return err
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			if _, ok := pkgs[rel]; !ok {
				pkgs[rel] = false
			}
			file, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.PackageClauseOnly|parser.ParseComments)
			if err != nil {
				return err
			}
			if file.Doc != nil && strings.TrimSpace(file.Doc.Text()) != "" {
				pkgs[rel] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pkgs
}

func TestArchitectureMapsEveryPackage(t *testing.T) {
	doc, err := os.ReadFile("architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	var rows []string
	for _, m := range packageRow.FindAllStringSubmatch(string(doc), -1) {
		rows = append(rows, m[1])
	}
	pkgs := packages(t)
	var paths []string
	for p := range pkgs {
		paths = append(paths, filepath.ToSlash(p))
	}
	slices.Sort(paths)
	for _, p := range paths {
		if !slices.Contains(rows, p) {
			t.Errorf("package %s has no row in architecture.md's package table", p)
		}
		if !pkgs[p] {
			t.Errorf("package %s has no doc comment saying what it is for", p)
		}
	}
	for _, r := range rows {
		if _, ok := pkgs[filepath.FromSlash(r)]; !ok {
			t.Errorf("architecture.md's package table has a row for %s, which is not a package of the tree", r)
		}
	}
}
