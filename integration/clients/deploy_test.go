package clients

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// The deploy kit (deploy/ at the repository's root) is tested here:
//
//   - TestDeployDockerfile: the Dockerfile is multi-stage, builds with
//     CGO_ENABLED=0 on the Go release of go.mod, and runs as a non-root user
//     on a distroless static (or scratch) base; its build context holds
//     every file the build reads; its default command's flags exist (there
//     is no docker here);
//   - TestDeployStaticBinary: the Dockerfile's own go build command, run
//     from the repository's root, produces a static ELF executable;
//   - TestDeploySystemdUnit: systemd-analyze verify accepts the unit, and
//     every flag it passes exists;
//   - TestDeploySidecar (deploy_sidecar_test.go): the static pod manifest,
//     run and dry-run against a real etcd and kube-apiserver over mTLS;
//   - TestDeployMetricsExist: every metric the Grafana dashboard and the
//     Prometheus rules query exists on a running proxy;
//   - TestDeployPromQLNames: the metric-name extraction those tests use.

// deployDir is deploy/ at the repository's root.
const deployDir = "../../deploy"

func readDeploy(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(deployDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// dockerInstr is one Dockerfile instruction, continuation lines joined.
type dockerInstr struct {
	cmd  string // upper case: FROM, RUN, ...
	args string
	line int
}

func parseDockerfile(t testing.TB, src string) []dockerInstr {
	t.Helper()
	var out []dockerInstr
	var cur strings.Builder
	start := 0
	for i, l := range strings.Split(src, "\n") {
		trimmed := strings.TrimSpace(l)
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue // comments and blank lines, also inside continuations
		}
		if cur.Len() == 0 {
			start = i + 1
		}
		if cont, ok := strings.CutSuffix(trimmed, `\`); ok {
			cur.WriteString(cont + " ")
			continue
		}
		cur.WriteString(trimmed)
		full := cur.String()
		cur.Reset()
		cmd, args, _ := strings.Cut(full, " ")
		out = append(out, dockerInstr{cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args), line: start})
	}
	if cur.Len() != 0 {
		t.Fatalf("Dockerfile ends in a continuation line")
	}
	return out
}

// staticBuildCommand is the Dockerfile's build command (deploy/Dockerfile,
// the RUN of the build stage). TestDeployDockerfile requires the Dockerfile
// to run exactly this, with the output path as the only difference, and
// TestDeployStaticBinary runs it: keep the two identical.
var staticBuildCommand = []string{"CGO_ENABLED=0", "go", "build", "-trimpath", "-ldflags=-s -w", "-o", "OUT", "./cmd/etcd-snapcache"}

// shellWords splits a simple shell command line: words separated by blanks,
// with single and double quotes (no expansions).
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case c == '\'' || c == '"':
			j := strings.IndexByte(s[i+1:], c)
			if j < 0 {
				return nil, fmt.Errorf("unterminated %c quote in %q", c, s)
			}
			w.WriteString(s[i+1 : i+1+j])
			i += j + 1
			inWord = true
		case c == '\\' || c == '$' || c == '`' || c == ';' || c == '&' || c == '|':
			return nil, fmt.Errorf("%q: only plain words and quotes are understood", s)
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// dockerBuildCommand returns the Dockerfile's go build command as words,
// and its output path.
func dockerBuildCommand(t testing.TB) (words []string, out string) {
	t.Helper()
	var runs []dockerInstr
	for _, in := range parseDockerfile(t, string(readDeploy(t, "Dockerfile"))) {
		if in.cmd == "RUN" && strings.Contains(in.args, "go build") {
			runs = append(runs, in)
		}
	}
	if len(runs) != 1 {
		t.Fatalf("deploy/Dockerfile: want one RUN with go build, found %d", len(runs))
	}
	words, err := shellWords(runs[0].args)
	if err != nil {
		t.Fatalf("deploy/Dockerfile:%d: %v", runs[0].line, err)
	}
	i := slices.Index(words, "-o")
	if i < 0 || i+1 >= len(words) {
		t.Fatalf("deploy/Dockerfile:%d: no -o in %q", runs[0].line, words)
	}
	out = words[i+1]
	norm := slices.Clone(words)
	norm[i+1] = "OUT"
	if !slices.Equal(norm, staticBuildCommand) {
		t.Fatalf("deploy/Dockerfile:%d builds with\n  %q\nthe tests build with\n  %q\n(with OUT the output): keep them identical", runs[0].line, norm, staticBuildCommand)
	}
	return words, out
}

// TestDeployDockerfile checks what it can of deploy/Dockerfile without
// docker: two stages, the builder on go.mod's Go release, a CGO_ENABLED=0
// build (the command TestDeployStaticBinary runs), a distroless static or
// scratch final base, a numeric non-root USER, and an ENTRYPOINT that is
// the binary copied from the builder.
func TestDeployDockerfile(t *testing.T) {
	instrs := parseDockerfile(t, string(readDeploy(t, "Dockerfile")))
	var froms []dockerInstr
	for _, in := range instrs {
		if in.cmd == "FROM" {
			froms = append(froms, in)
		}
	}
	if len(froms) < 2 {
		t.Fatalf("want a multi-stage build (two FROM or more), found %d FROM", len(froms))
	}

	// The builder: golang:<go.mod's major.minor>, named.
	gomod, err := os.ReadFile(filepath.Join(repoRoot(t), "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("go.mod: no go line")
	}
	builder := strings.Fields(froms[0].args)
	if len(builder) != 3 || !strings.EqualFold(builder[1], "AS") {
		t.Errorf("line %d: the builder stage should be named (FROM image AS name): %q", froms[0].line, froms[0].args)
	}
	wantGo := "golang:" + string(m[1])
	if img := builder[0]; img != wantGo && !strings.HasPrefix(img, wantGo+".") && !strings.HasPrefix(img, wantGo+"-") {
		t.Errorf("line %d: builder image %s; go.mod asks for Go %s (want %s, %s.x or %s-<variant>)", froms[0].line, img, m[1], wantGo, wantGo, wantGo)
	}

	// The build: the command the tests run, CGO_ENABLED=0 included.
	words, out := dockerBuildCommand(t)
	if !slices.Contains(words, "CGO_ENABLED=0") {
		t.Errorf("the build does not set CGO_ENABLED=0: %q", words)
	}

	// The final stage.
	last := froms[len(froms)-1]
	final := strings.Fields(last.args)[0]
	if final != "scratch" && !regexp.MustCompile(`^gcr\.io/distroless/static(-debian\d+)?(:[a-z0-9.-]+)?(@sha256:[0-9a-f]{64})?$`).MatchString(final) {
		t.Errorf("line %d: final base %s; want gcr.io/distroless/static* or scratch", last.line, final)
	}
	var user, entrypoint, copied, cmdLine string
	for _, in := range instrs {
		if in.line < last.line {
			continue
		}
		switch in.cmd {
		case "USER":
			user = in.args
		case "ENTRYPOINT":
			entrypoint = in.args
		case "CMD":
			cmdLine = in.args
		case "COPY":
			f := strings.Fields(in.args)
			if len(f) == 3 && strings.HasPrefix(f[0], "--from=") && f[1] == out {
				copied = f[2]
			}
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("final stage USER %q: want a numeric non-root uid (65532, distroless's nonroot), so that runAsNonRoot can check it", user)
	}
	if copied == "" {
		t.Errorf("the final stage does not COPY --from the builder's %s", out)
	}
	var ep []string
	if err := json.Unmarshal([]byte(entrypoint), &ep); err != nil || len(ep) == 0 || ep[0] != copied {
		t.Errorf("ENTRYPOINT %s: want the exec form running %s", entrypoint, copied)
	}
	// The default command's flags exist.
	var cmdArgs []string
	if err := json.Unmarshal([]byte(cmdLine), &cmdArgs); err != nil || len(cmdArgs) == 0 || cmdArgs[0] != "serve" {
		t.Errorf("CMD %s: want the exec form of serve and its flags", cmdLine)
	} else {
		checkFlags(t, "CMD", cmdArgs[1:], serveFlags(t, snapcacheBin(t)))
	}
	t.Logf("%d stages, builder %s, final %s, USER %s, ENTRYPOINT %s, CMD %s", len(froms), builder[0], final, user, entrypoint, cmdLine)

	// The build context (deploy/Dockerfile.dockerignore) holds every file
	// the build reads: go.mod, go.sum and the sources of the main module's
	// packages the binary is built from.
	ignore := dockerignore(t, string(readDeploy(t, "Dockerfile.dockerignore")))
	root := repoRoot(t)
	cmd := exec.Command("go", "list", "-deps", "-f",
		`{{if .Module}}{{if .Module.Main}}{{.Dir}}|{{join .GoFiles ","}},{{join .EmbedFiles ","}},{{join .SFiles ","}}{{end}}{{end}}`,
		"./cmd/etcd-snapcache")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	b, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps ./cmd/etcd-snapcache: %v", err)
	}
	needed := []string{"go.mod", "go.sum"}
	for l := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		dir, names, ok := strings.Cut(l, "|")
		if !ok {
			continue
		}
		rel, err := filepath.Rel(root, dir)
		if err != nil {
			t.Fatal(err)
		}
		for n := range strings.SplitSeq(names, ",") {
			if n != "" {
				needed = append(needed, filepath.ToSlash(filepath.Join(rel, n)))
			}
		}
	}
	for _, f := range needed {
		if ignore(f) {
			t.Errorf("Dockerfile.dockerignore excludes %s, which the build needs", f)
		}
	}
	for _, f := range []string{".git/HEAD", ".tools/bin/etcd", "bin/etcd-snapcache", "integration/clients/go.mod", "kvproxy/route_test.go"} {
		if !ignore(f) {
			t.Errorf("Dockerfile.dockerignore lets %s into the build context", f)
		}
	}
	t.Logf("build context: the %d files the build reads are in it", len(needed))
}

// dockerignore returns whether a .dockerignore excludes a path (relative
// to the context, with slashes): a pattern excludes what it matches and
// everything under it; * and ? do not cross a slash, ** does. Exceptions
// (!pattern) are not understood.
func dockerignore(t testing.TB, src string) func(string) bool {
	t.Helper()
	var res []*regexp.Regexp
	for l := range strings.SplitSeq(src, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if strings.HasPrefix(l, "!") {
			t.Fatalf("dockerignore: exception %q: not understood by the test", l)
		}
		l = strings.TrimPrefix(strings.TrimSuffix(l, "/"), "/")
		var re strings.Builder
		for i := 0; i < len(l); i++ {
			switch c := l[i]; {
			case strings.HasPrefix(l[i:], "**/"):
				re.WriteString(`(.*/)?`)
				i += 2
			case strings.HasPrefix(l[i:], "**"):
				re.WriteString(`.*`)
				i++
			case c == '*':
				re.WriteString(`[^/]*`)
			case c == '?':
				re.WriteString(`[^/]`)
			default:
				re.WriteString(regexp.QuoteMeta(string(c)))
			}
		}
		res = append(res, regexp.MustCompile(`^`+re.String()+`(/.*)?$`))
	}
	return func(p string) bool {
		for _, re := range res {
			if re.MatchString(p) {
				return true
			}
		}
		return false
	}
}

// TestDeployStaticBinary runs the Dockerfile's build command from the
// repository's root (the same command, see staticBuildCommand) and checks
// that the result is a static executable: no program interpreter and no
// dynamic section, so it runs on distroless static or scratch.
func TestDeployStaticBinary(t *testing.T) {
	words, _ := dockerBuildCommand(t)
	out := filepath.Join(t.TempDir(), "etcd-snapcache")
	var env []string
	for len(words) > 0 && strings.Contains(words[0], "=") {
		env = append(env, words[0])
		words = words[1:]
	}
	words[slices.Index(words, "-o")+1] = out
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, words[0], words[1:]...)
	cmd.Dir = repoRoot(t)
	cmd.Env = append(os.Environ(), env...)
	start := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(append(env, words...), " "), err, b)
	}
	t.Logf("built in %v: %s", time.Since(start).Round(100*time.Millisecond), strings.Join(append(env, words...), " "))

	f, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Type != elf.ET_EXEC {
		t.Errorf("ELF type %v, want %v (a position-dependent static executable)", f.Type, elf.ET_EXEC)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("program header %v: the binary is dynamically linked", p.Type)
		}
	}
	for _, name := range []string{".interp", ".dynamic", ".dynsym"} {
		if f.Section(name) != nil {
			t.Errorf("section %s: the binary is dynamically linked", name)
		}
	}
	if libs, err := f.ImportedLibraries(); err != nil || len(libs) > 0 {
		t.Errorf("imported libraries %v (%v)", libs, err)
	}
	// -s -w: no symbol table and no DWARF.
	if f.Section(".symtab") != nil {
		t.Errorf("the binary has a symbol table (-ldflags=-s missing?)")
	}
	// And it runs.
	b, err := exec.CommandContext(ctx, out, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("%s version: %v\n%s", out, err, b)
	}
	t.Logf("static ELF; version: %s", bytes.TrimSpace(b))
}

// serveFlags returns the long flags `etcd-snapcache serve --help` lists.
func serveFlags(t testing.TB, bin string) map[string]bool {
	t.Helper()
	b, err := exec.Command(bin, "serve", "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("%s serve --help: %v\n%s", bin, err, b)
	}
	return helpFlags(string(b))
}

// helpFlags returns the long flags (--name) a --help output lists at the
// start of its lines.
func helpFlags(help string) map[string]bool {
	flags := map[string]bool{}
	re := regexp.MustCompile(`^\s+(?:-[a-zA-Z], )?--([a-z0-9][a-z0-9-]*)`)
	for l := range strings.SplitSeq(help, "\n") {
		if m := re.FindStringSubmatch(l); m != nil {
			flags[m[1]] = true
		}
	}
	return flags
}

// checkFlags fails t for every --flag[=value] in args that flags lacks.
func checkFlags(t testing.TB, what string, args []string, flags map[string]bool) {
	t.Helper()
	if len(flags) == 0 {
		t.Fatalf("%s: no flags found in --help", what)
	}
	for _, a := range args {
		name, ok := strings.CutPrefix(a, "--")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(name, "=")
		if !flags[name] {
			t.Errorf("%s: --%s is not a flag of the binary", what, name)
		}
	}
}

// TestDeploySystemdUnit runs `systemd-analyze verify` on
// deploy/etcd-snapcache.service (with ExecStart pointing at the built
// binary, which verify requires to exist), which must print nothing, and
// checks every flag of its ExecStart against `etcd-snapcache serve --help`.
func TestDeploySystemdUnit(t *testing.T) {
	bin := snapcacheBin(t)
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze not found (apt-get install systemd): %v", err)
	}
	unit := string(readDeploy(t, "etcd-snapcache.service"))
	const installed = "/usr/local/bin/etcd-snapcache"

	// ExecStart, continuation lines joined.
	var execLine string
	sc := bufio.NewScanner(strings.NewReader(unit))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if !strings.HasPrefix(l, "ExecStart=") {
			continue
		}
		for strings.HasSuffix(l, `\`) && sc.Scan() {
			l = strings.TrimSuffix(l, `\`) + " " + strings.TrimSpace(sc.Text())
		}
		execLine = strings.TrimPrefix(l, "ExecStart=")
	}
	args := strings.Fields(execLine)
	if len(args) < 2 || args[0] != installed || args[1] != "serve" {
		t.Fatalf("ExecStart=%s: want %s serve ...", execLine, installed)
	}
	checkFlags(t, "ExecStart", args[2:], serveFlags(t, bin))

	dir := t.TempDir()
	path := filepath.Join(dir, "etcd-snapcache.service")
	writeFile(t, path, strings.Replace(unit, "ExecStart="+installed, "ExecStart="+bin, 1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, analyze, "verify", "--man=no", path)
	cmd.Dir = dir
	b, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(b)) != 0 {
		// verify exits 0 on unknown keys and bad values, which it only
		// prints: any output is a finding.
		t.Fatalf("systemd-analyze verify: %v\n%s", err, b)
	}
	t.Logf("systemd-analyze verify: clean; ExecStart: %d flags, all known", len(args)-2)
}

// promqlNonMetric are the identifiers of PromQL that are not metric names
// when they are not followed by "(" (functions always are): aggregation
// operators (sum by (...) (...)), binary and set operators, modifiers,
// keywords.
var promqlNonMetric = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
	"limitk": true, "limit_ratio": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"bool": true, "and": true, "or": true, "unless": true, "atan2": true,
	"offset": true, "start": true, "end": true, "inf": true, "nan": true,
}

// promqlLabelLists are the keywords followed by a parenthesised list of
// label names, which are not metric names either.
var promqlLabelLists = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

var metricNameRE = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)

// promqlMetricNames returns the metric names a PromQL expression selects,
// with a tokenizer, not a parser: strings, label matchers ({...}), range
// and subquery brackets ([...]), Grafana variables ($x, ${x}), numbers and
// durations, and the label lists of by/without/on/ignoring/group_left/
// group_right are skipped; an identifier followed by "(" is a function;
// the remaining identifiers, less PromQL's keywords and operators, are
// metric names.
func promqlMetricNames(expr string) ([]string, error) {
	var names []string
	s := expr
	isIdent := func(c byte, first bool) bool {
		return c == '_' || c == ':' || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z') || (!first && '0' <= c && c <= '9')
	}
	// skipTo returns the index after the bracket that closes the one at i,
	// skipping strings.
	skipTo := func(i int, open, close byte) (int, error) {
		depth := 0
		for j := i; j < len(s); j++ {
			switch c := s[j]; c {
			case '"', '\'', '`':
				k, err := skipString(s, j)
				if err != nil {
					return 0, err
				}
				j = k - 1
			case open:
				depth++
			case close:
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unbalanced %c in %q", open, expr)
	}
	nextNonSpace := func(i int) int {
		for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
			i++
		}
		return i
	}
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			j, err := skipString(s, i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '{':
			j, err := skipTo(i, '{', '}')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '[':
			j, err := skipTo(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '}' || c == ']':
			return nil, fmt.Errorf("unbalanced %c in %q", c, expr)
		case c == '#':
			for i < len(s) && s[i] != '\n' {
				i++
			}
		case c == '$':
			i++
			if i < len(s) && s[i] == '{' {
				j, err := skipTo(i, '{', '}')
				if err != nil {
					return nil, err
				}
				i = j
			}
			for i < len(s) && isIdent(s[i], false) {
				i++
			}
		case ('0' <= c && c <= '9') || (c == '.' && i+1 < len(s) && '0' <= s[i+1] && s[i+1] <= '9'):
			// A number (1, 0.5, 1e18, 0x1f, Inf excluded) or a duration (5m).
			i++
			for i < len(s) {
				d := s[i]
				if isIdent(d, false) || d == '.' {
					i++
				} else if (d == '+' || d == '-') && (s[i-1] == 'e' || s[i-1] == 'E') && !strings.ContainsAny(s[:i], "xX") {
					i++
				} else {
					break
				}
			}
		case isIdent(c, true):
			j := i
			for j < len(s) && isIdent(s[j], false) {
				j++
			}
			id := s[i:j]
			k := nextNonSpace(j)
			followedByParen := k < len(s) && s[k] == '('
			switch {
			case promqlLabelLists[strings.ToLower(id)] && followedByParen:
				end, err := skipTo(k, '(', ')')
				if err != nil {
					return nil, err
				}
				j = end
			case followedByParen, promqlNonMetric[strings.ToLower(id)]:
				// A function, an aggregation, a keyword.
			default:
				if !metricNameRE.MatchString(id) {
					return nil, fmt.Errorf("%q: bad metric name %q", expr, id)
				}
				names = append(names, id)
			}
			i = j
		default:
			i++ // operators, parentheses, commas, @
		}
	}
	for _, pair := range [][2]byte{{'(', ')'}} {
		if strings.Count(s, string(pair[0])) != strings.Count(s, string(pair[1])) {
			return nil, fmt.Errorf("unbalanced %c in %q", pair[0], expr)
		}
	}
	return names, nil
}

// skipString returns the index after the string literal that starts at i.
func skipString(s string, i int) (int, error) {
	q := s[i]
	for j := i + 1; j < len(s); j++ {
		switch s[j] {
		case '\\':
			if q != '`' {
				j++
			}
		case q:
			return j + 1, nil
		}
	}
	return 0, fmt.Errorf("unterminated string in %q", s)
}

func TestDeployPromQLNames(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`rate(a_total{job=~"$job", x="y{]"}[$__rate_interval])`, []string{"a_total"}},
		{`histogram_quantile(0.99, sum by (le, grpc_method) (rate(h_bucket{grpc_type="unary"}[5m])))`, []string{"h_bucket"}},
		{`sum(rate(a[1m])) by (instance) / ignoring(source, reason) group_left() sum without (le) (b)`, []string{"a", "b"}},
		{`a > 0.5 * b or c > 1e18 and d offset 5m unless on(instance) e @ start()`, []string{"a", "b", "c", "d", "e"}},
		{"min_over_time(x[5m:30s]) > 1000\nand\nchanges(y[10m]) == bool 0", []string{"x", "y"}},
		{`clamp_min(ns:metric:rate5m, 1) - 1 - 2.5e-3`, []string{"ns:metric:rate5m"}},
		{`count_values("v", m) # a comment with words`, []string{"m"}},
	} {
		got, err := promqlMetricNames(tc.expr)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("promqlMetricNames(%q) = %q, %v; want %q", tc.expr, got, err, tc.want)
		}
	}
	for _, bad := range []string{`rate(a[5m]`, `a{x="y"`, `sum(a))`, `a{x="y}`} {
		if got, err := promqlMetricNames(bad); err == nil {
			t.Errorf("promqlMetricNames(%q) = %q, want an error", bad, got)
		}
	}
}

// grafanaDashboard is the part of a Grafana dashboard the tests read.
type grafanaDashboard struct {
	Title      string         `json:"title"`
	UID        string         `json:"uid"`
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type grafanaPanel struct {
	ID         int                      `json:"id"`
	Type       string                   `json:"type"`
	Title      string                   `json:"title"`
	Datasource *struct{ UID string }    `json:"datasource"`
	GridPos    struct{ H, W, X, Y int } `json:"gridPos"`
	Targets    []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's panels
}

// dashboardExprs reads deploy/grafana-dashboard.json, checks its shape
// (titled panels with unique ids inside the 24-column grid, every non-row
// panel querying the dashboard's data source variable with at least one
// PromQL target) and returns every query, by where it is.
func dashboardExprs(t testing.TB) map[string]string {
	t.Helper()
	var d grafanaDashboard
	dec := json.NewDecoder(bytes.NewReader(readDeploy(t, "grafana-dashboard.json")))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	if d.Title == "" || d.UID == "" || len(d.Panels) == 0 {
		t.Fatalf("grafana-dashboard.json: no title, uid or panels")
	}
	exprs := map[string]string{}
	ids := map[int]bool{}
	cells := map[[2]int]string{} // grid cell -> the panel on it
	// nested: the panels of a collapsed row, placed as if it were expanded.
	var walk func(ps []grafanaPanel, nested bool)
	walk = func(ps []grafanaPanel, nested bool) {
		for _, p := range ps {
			where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
			if ids[p.ID] || p.ID == 0 {
				t.Errorf("%s: missing or duplicate id", where)
			}
			ids[p.ID] = true
			if p.Title == "" {
				t.Errorf("%s: no title", where)
			}
			g := p.GridPos
			if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
				t.Errorf("%s: gridPos %+v outside the 24-column grid", where, g)
			}
			for x := g.X; x < g.X+g.W && !nested; x++ {
				for y := g.Y; y < g.Y+g.H; y++ {
					if other, ok := cells[[2]int{x, y}]; ok {
						t.Errorf("%s overlaps %s at (%d, %d)", where, other, x, y)
					}
					cells[[2]int{x, y}] = where
				}
			}
			if p.Type == "row" {
				walk(p.Panels, true)
				continue
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("%s: data source %+v, want the ${datasource} variable", where, p.Datasource)
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: no targets", where)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("%s target %s: no expr", where, tg.RefID)
				}
				exprs[where+" target "+tg.RefID] = tg.Expr
			}
		}
	}
	walk(d.Panels, false)
	// Template variables: label_values(<selector>, label) selects a metric.
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			var s string
			if err := json.Unmarshal(v.Query, &s); err != nil {
				t.Fatalf("variable %s: query %s: %v", v.Name, v.Query, err)
			}
			q.Query = s
		}
		if m := labelValues.FindStringSubmatch(q.Query); m != nil {
			exprs["variable "+v.Name] = m[1]
		} else {
			t.Errorf("variable %s: query %q is not label_values(<selector>, <label>)", v.Name, q.Query)
		}
	}
	return exprs
}

// promRules is a Prometheus rules file.
type promRules struct {
	Groups []struct {
		Name     string `yaml:"name"`
		Interval string `yaml:"interval,omitempty"`
		Rules    []struct {
			Alert       string            `yaml:"alert,omitempty"`
			Record      string            `yaml:"record,omitempty"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for,omitempty"`
			KeepFiring  string            `yaml:"keep_firing_for,omitempty"`
			Labels      map[string]string `yaml:"labels,omitempty"`
			Annotations map[string]string `yaml:"annotations,omitempty"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

var promDurationRE = regexp.MustCompile(`^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$`)

// ruleExprs reads deploy/prometheus-rules.yaml as Prometheus reads a rules
// file (unknown fields are errors), checks each alert's shape and returns
// every expr, by alert. The alerts the kit promises must be there.
func ruleExprs(t testing.TB) map[string]string {
	t.Helper()
	var f promRules
	dec := yaml.NewDecoder(bytes.NewReader(readDeploy(t, "prometheus-rules.yaml")))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		t.Fatalf("prometheus-rules.yaml: %v", err)
	}
	if len(f.Groups) == 0 {
		t.Fatal("prometheus-rules.yaml: no groups")
	}
	exprs := map[string]string{}
	groups := map[string]bool{}
	for _, g := range f.Groups {
		if g.Name == "" || groups[g.Name] {
			t.Errorf("group %q: missing or duplicate name", g.Name)
		}
		groups[g.Name] = true
		if len(g.Rules) == 0 {
			t.Errorf("group %s: no rules", g.Name)
		}
		for i, r := range g.Rules {
			where := fmt.Sprintf("group %s rule %d (%s%s)", g.Name, i, r.Alert, r.Record)
			if (r.Alert == "") == (r.Record == "") {
				t.Errorf("%s: exactly one of alert and record", where)
			}
			if r.Alert != "" {
				if !regexp.MustCompile(`^[A-Z][A-Za-z0-9]+$`).MatchString(r.Alert) {
					t.Errorf("%s: alert name not in CamelCase", where)
				}
				if _, dup := exprs[r.Alert]; dup {
					t.Errorf("%s: duplicate alert", where)
				}
				if s := r.Labels["severity"]; s != "warning" && s != "critical" {
					t.Errorf("%s: severity %q, want warning or critical", where, s)
				}
				if r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
					t.Errorf("%s: want summary and description annotations", where)
				}
			}
			for _, d := range []string{r.For, r.KeepFiring} {
				if d != "" && (!promDurationRE.MatchString(d) || d == "0") {
					t.Errorf("%s: bad duration %q", where, d)
				}
			}
			if strings.TrimSpace(r.Expr) == "" {
				t.Errorf("%s: no expr", where)
			}
			for k, v := range r.Annotations {
				if strings.Count(v, "{{") != strings.Count(v, "}}") {
					t.Errorf("%s: annotation %s: unbalanced template braces", where, k)
				}
			}
			exprs[r.Alert+r.Record] = r.Expr
		}
	}
	for _, want := range []string{
		"EtcdSnapcacheConsistencyFallback",
		"EtcdSnapcacheUpstreamLag",
		"EtcdSnapcacheNotReady",
		"EtcdSnapcacheMemoryNearBudget",
	} {
		if _, ok := exprs[want]; !ok {
			t.Errorf("prometheus-rules.yaml: no alert %s", want)
		}
	}
	return exprs
}

// kitMetrics returns every metric name the dashboard and the rules query,
// with where each is used.
func kitMetrics(t testing.TB) map[string][]string {
	t.Helper()
	used := map[string][]string{}
	add := func(file string, exprs map[string]string) {
		for where, e := range exprs {
			names, err := promqlMetricNames(e)
			if err != nil {
				t.Errorf("%s %s: %v", file, where, err)
				continue
			}
			if len(names) == 0 {
				t.Errorf("%s %s: %q selects no metric", file, where, e)
			}
			for _, n := range names {
				used[n] = append(used[n], file+" "+where)
			}
		}
	}
	add("grafana-dashboard.json", dashboardExprs(t))
	add("prometheus-rules.yaml", ruleExprs(t))
	return used
}

// proxyOwnMetrics scrapes the proxy's own metrics from --metrics-addr and
// returns the exposition's sample names.
func proxyOwnMetrics(metricsAddr string) (map[string]bool, error) {
	names, _, err := scrapeProxyOwn(metricsAddr)
	return names, err
}

// scrapeProxyOwn returns the proxy's own metrics from --metrics-addr: the
// sample names, and the exposition.
func scrapeProxyOwn(metricsAddr string) (map[string]bool, string, error) {
	get := func(path string) (int, []byte, error) {
		resp, err := plainHTTP.Get("http://" + metricsAddr + path)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}
	code, body, err := get("/proxy/metrics")
	if err != nil {
		return nil, "", err
	}
	if code != http.StatusOK {
		return nil, "", fmt.Errorf("metrics: %d: %s", code, lastLines(string(body), 3))
	}
	names := map[string]bool{}
	for l := range strings.SplitSeq(string(body), "\n") {
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if i := strings.IndexAny(l, "{ "); i > 0 {
			names[l[:i]] = true
		}
	}
	return names, string(body), nil
}

// TestDeployMetricsExist checks that every metric the Grafana dashboard
// and the alerting rules query exists on a running proxy: one with
// --metrics=extensive (grpc_server_handling_seconds) and a short
// consistency-check interval, in front of a real etcd, after some traffic
// through it with etcdctl (a Put, Ranges, a Watch delivering one event, a
// Compact), since labelled series appear only once used. A metric the kit
// queries and the proxy does not export fails the test, named.
func TestDeployMetricsExist(t *testing.T) {
	used := kitMetrics(t)
	if t.Failed() {
		t.FailNow()
	}
	bin := snapcacheBin(t)
	ctl := etcdctlBin(t)
	extra := []string{"--consistency-check-interval=1s"}
	if serveFlags(t, bin)["metrics"] {
		extra = append(extra, "--metrics=extensive")
	} else {
		t.Errorf("etcd-snapcache serve has no --metrics flag: grpc_server_handling_seconds (--metrics=extensive) cannot exist")
	}
	e := startEtcd(t, "etcd")
	px := startProxy(t, "proxy", e.addr, extra...)

	run := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, ctl, append([]string{"--endpoints=" + px.addr}, args...)...)
		cmd.Env = ctlEnv()
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("etcdctl %s: %v\n%s", strings.Join(args, " "), err, b)
		}
		return string(b)
	}
	out := run("put", "/deploy/k", "v1", "-w", "json")
	var put struct {
		Header struct {
			Revision int64 `json:"revision"`
		} `json:"header"`
	}
	if err := json.Unmarshal([]byte(out), &put); err != nil || put.Header.Revision == 0 {
		t.Fatalf("etcdctl put -w json: %q: %v", out, err)
	}
	rev := put.Header.Revision
	run("get", "/deploy/k")                          // linearizable
	run("get", "/deploy/k", "--consistency=s")       // serializable
	run("get", "/deploy/k", "--rev="+itoa(rev))      // at a revision
	run("get", "/deploy", "--prefix", "--keys-only") // a prefix, keys only
	run("put", "/deploy/k", "v2")                    // a second revision
	run("compact", itoa(rev))                        // a compaction through the proxy
	run("get", "/deploy/k", "--rev="+itoa(rev+1), "-w", "json")

	// A watch delivering one event: from rev+1 (the second put), so the
	// event is in the history and no race with the watch's creation.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := exec.CommandContext(ctx, ctl, "--endpoints="+px.addr, "watch", "/deploy/k", "--rev="+itoa(rev+1))
	w.Env = ctlEnv()
	stdout, err := w.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var werr bytes.Buffer
	w.Stderr = &werr
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	lr := newLineReader(stdout)
	var got []string
	for len(got) < 3 {
		l, err := lr.next(time.Now().Add(20 * time.Second))
		if err != nil {
			t.Fatalf("etcdctl watch: %v after %q; stderr: %s", err, got, werr.String())
		}
		got = append(got, l)
	}
	if !slices.Equal(got, []string{"PUT", "/deploy/k", "v2"}) {
		t.Fatalf("etcdctl watch printed %q, want PUT /deploy/k v2", got)
	}
	_ = w.Process.Kill()
	_ = w.Wait()

	want := make([]string, 0, len(used))
	for n := range used {
		want = append(want, n)
	}
	sort.Strings(want)
	var missing []string
	var have map[string]bool
	// Some series appear a little later: the first consistency check
	// (--consistency-check-interval=1s), the end of the watch stream.
	pollUntil(t, 20*time.Second, "every metric the kit queries on the proxy", func() (bool, error) {
		m, err := proxyOwnMetrics(px.metricsAddr)
		if err != nil {
			return false, err
		}
		have = m
		missing = missing[:0]
		for _, n := range want {
			if !have[n] {
				missing = append(missing, n)
			}
		}
		return len(missing) == 0, fmt.Errorf("missing %s", strings.Join(missing, ", "))
	}, px.process)
	if len(missing) > 0 {
		for _, n := range missing {
			t.Errorf("%s: not exported by the proxy; used by %s", n, strings.Join(used[n], "; "))
		}
	}
	// What the proxy exports and the kit does not show, for the record.
	var unused []string
	for n := range have {
		if strings.HasPrefix(n, "etcd_snapcache_") && len(used[n]) == 0 {
			unused = append(unused, n)
		}
	}
	sort.Strings(unused)
	t.Logf("%d metrics queried by the kit, %d missing: %s", len(want), len(missing), strings.Join(want, " "))
	t.Logf("etcd_snapcache_ metrics exported and not queried: %v", unused)
}

// pollUntil is waitUntil that returns instead of failing when cond
// has not held by the deadline, so that the caller can report every
// missing item; a process in watch that exits fails the test at once.
func pollUntil(t testing.TB, timeout time.Duration, what string, cond func() (bool, error), watch ...*process) {
	t.Helper()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond()
		if ok {
			return
		}
		for _, p := range watch {
			if p.exited() {
				t.Fatalf("waiting for %s: %s exited: %v", what, p.name, p.err)
			}
		}
		select {
		case <-tick.C:
		case <-deadline.C:
			t.Logf("waiting for %s: not done after %v: %v", what, timeout, err)
			return
		}
	}
}
