package drain

import (
	"context"
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/balancer"
	"google.golang.org/grpc/connectivity"
)

// fakeSubConn stands for a subchannel; only its identity is used.
type fakeSubConn struct {
	balancer.SubConn
	name string
}

// cycling picks its subchannels in turn, as round_robin's picker does.
type cycling struct {
	subConns []balancer.SubConn
	next     int
}

func (c *cycling) Pick(balancer.PickInfo) (balancer.PickResult, error) {
	sc := c.subConns[c.next%len(c.subConns)]
	c.next++
	return balancer.PickResult{SubConn: sc}, nil
}

// fakeConn is a clientConn over READY subchannels named by names, and a
// picker over them as round_robin would publish it.
func fakeConn(names ...string) (*clientConn, *picker, map[string]*subConn) {
	cc := newClientConn(nil)
	inner := &cycling{}
	byName := map[string]*subConn{}
	for _, n := range names {
		f := &fakeSubConn{name: n}
		sc := &subConn{addr: n, state: connectivity.Ready}
		cc.subConns[f] = sc
		byName[n] = sc
		inner.subConns = append(inner.subConns, f)
	}
	return cc, &picker{Picker: inner, cc: cc}, byName
}

func pickNames(t *testing.T, p *picker, n int) []string {
	t.Helper()
	var got []string
	for range n {
		res, err := p.Pick(balancer.PickInfo{Ctx: context.Background()})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, res.SubConn.(*fakeSubConn).name)
	}
	return got
}

// TestPickerSkipsUnresponsive: the picker picks as round_robin does, but
// never an unresponsive subchannel while a responsive one is READY; when
// none is responsive it picks as round_robin does.
func TestPickerSkipsUnresponsive(t *testing.T) {
	for _, tc := range []struct {
		name         string
		unresponsive []string
		want         string // the picks in a row
	}{
		{"all responsive", nil, "a b c a b c"},
		{"one unresponsive", []string{"b"}, "a c a c a c"},
		{"two unresponsive", []string{"a", "c"}, "b b b b b b"},
		{"none responsive", []string{"a", "b", "c"}, "a b c a b c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, p, scs := fakeConn("a", "b", "c")
			for _, n := range tc.unresponsive {
				scs[n].setResponsive(false)
			}
			if got := strings.Join(pickNames(t, p, 6), " "); got != tc.want {
				t.Fatalf("picks %q, want %q", got, tc.want)
			}
		})
	}
}

// TestUnresponsiveEndsStreamsOnlyWithSomewhereToGo: a stream on a
// subchannel that becomes unresponsive ends (ErrUnresponsive, naming it)
// only while another subchannel is READY and responsive; if none is, it
// stays, and ends once one becomes responsive again.
func TestUnresponsiveEndsStreamsOnlyWithSomewhereToGo(t *testing.T) {
	cc, p, scs := fakeConn("a", "b")
	ctx, cancel := Context(context.Background())
	defer cancel()
	res, err := p.Pick(balancer.PickInfo{Ctx: ctx})
	if err != nil {
		t.Fatal(err)
	}
	on := res.SubConn.(*fakeSubConn).name
	other := map[string]string{"a": "b", "b": "a"}[on]
	if Member(ctx) != on {
		t.Fatalf("Member %q, want %q", Member(ctx), on)
	}

	// Both stop answering: nowhere to go, the stream stays.
	for _, n := range []string{other, on} {
		if scs[n].setResponsive(false) {
			cc.moveOffUnresponsive()
		}
	}
	if ctx.Err() != nil {
		t.Fatalf("stream ended with no responsive member: %v", context.Cause(ctx))
	}
	// The other answers again: the stream moves.
	if scs[other].setResponsive(true) {
		cc.moveOffUnresponsive()
	}
	if !errors.Is(context.Cause(ctx), ErrUnresponsive) || !strings.Contains(context.Cause(ctx).Error(), on) {
		t.Fatalf("cause %v, want ErrUnresponsive naming %s", context.Cause(ctx), on)
	}
	res.Done(balancer.DoneInfo{})
}

// TestPickerSendsProposalsToTheLeader: a call with a context from ToLeader
// is picked on the member whose probe answer said it leads while that
// member is READY, responsive and not avoided; otherwise as without it.
// Other calls keep round_robin's order.
func TestPickerSendsProposalsToTheLeader(t *testing.T) {
	_, p, scs := fakeConn("leader-a", "leader-b", "leader-c")
	for n := range scs {
		t.Cleanup(func() { statuses.Delete(n) })
	}
	picks := func(ctx context.Context) string {
		var got []string
		for range 3 {
			res, err := p.Pick(balancer.PickInfo{Ctx: ctx})
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, res.SubConn.(*fakeSubConn).name)
		}
		return strings.Join(got, " ")
	}
	toLeader := ToLeader(context.Background())

	// No probe has answered yet: round_robin.
	if got := picks(toLeader); got != "leader-a leader-b leader-c" {
		t.Fatalf("with no leader known: picks %q", got)
	}
	statuses.Store("leader-a", memberStatus{leader: false})
	statuses.Store("leader-b", memberStatus{leader: true})
	statuses.Store("leader-c", memberStatus{leader: false})
	if got := picks(toLeader); got != "leader-b leader-b leader-b" {
		t.Fatalf("proposals: picks %q, want the leader's", got)
	}
	if got := picks(context.Background()); got == "leader-b leader-b leader-b" {
		t.Fatalf("other calls: picks %q, want round_robin's", got)
	}
	// The leader hangs: proposals go round the others, as without a leader.
	scs["leader-b"].setResponsive(false)
	if got := picks(toLeader); strings.Contains(got, "leader-b") {
		t.Fatalf("with the leader unresponsive: picks %q", got)
	}
	scs["leader-b"].setResponsive(true)
	// Avoided (a hedged attempt): not the leader.
	if got := picks(Avoid(toLeader, "leader-b")); strings.Contains(got, "leader-b") {
		t.Fatalf("with the leader avoided: picks %q", got)
	}
	// A new leader is elected while the old one, hung but not yet found
	// so, still says it leads: the higher term wins.
	statuses.Store("leader-b", memberStatus{leader: true, term: 2})
	statuses.Store("leader-c", memberStatus{leader: true, term: 3})
	if got := picks(toLeader); got != "leader-c leader-c leader-c" {
		t.Fatalf("after an election: picks %q", got)
	}
}

// TestMixedReleases: the READY members' releases, as their probe answers
// say, are mixed while two differ in major.minor (a rolling upgrade), and
// each change closes the channel MixedReleases returned before it.
func TestMixedReleases(t *testing.T) {
	cc, _, scs := fakeConn("rel-a", "rel-b", "rel-c")
	track(cc)
	t.Cleanup(func() {
		untrack(cc)
		for n := range scs {
			statuses.Delete(n)
		}
		updateReleases()
	})
	for _, n := range []string{"rel-a", "rel-b", "rel-c"} {
		noteStatus(n, memberStatus{release: majorMinor("3.6.16")})
	}
	mixed, changed := MixedReleases()
	if mixed {
		t.Fatal("mixed with every member on 3.6")
	}
	// rel-a restarted as 3.7.
	noteStatus("rel-a", memberStatus{release: majorMinor("3.7.3")})
	select {
	case <-changed:
	default:
		t.Fatal("no change signaled when a member came back on 3.7")
	}
	if mixed, changed = MixedReleases(); !mixed {
		t.Fatal("not mixed with 3.6 and 3.7 members")
	}
	// A patch release is the same release.
	noteStatus("rel-b", memberStatus{release: majorMinor("3.6.15")})
	if m, _ := MixedReleases(); !m {
		t.Fatal("not mixed after a patch change")
	}
	// The 3.6 members go away (not READY): the rest agree.
	for _, n := range []string{"rel-b", "rel-c"} {
		if scs[n].setState(connectivity.Idle) {
			updateReleases()
		}
	}
	select {
	case <-changed:
	default:
		t.Fatal("no change signaled when the 3.6 members left")
	}
	if m, _ := MixedReleases(); m {
		t.Fatal("mixed with only a 3.7 member READY")
	}
}

// TestPickerFallsBackWhenTheLeaderIsNotInThePicker: round_robin's picker
// may not hold the leader's subchannel yet (it has not seen it READY); a
// proposal then goes to a member that answers, not to a hung first pick.
func TestPickerFallsBackWhenTheLeaderIsNotInThePicker(t *testing.T) {
	_, p, scs := fakeConn("fb-a", "fb-b", "fb-c")
	for n := range scs {
		t.Cleanup(func() { statuses.Delete(n) })
	}
	inner := p.Picker.(*cycling)
	inner.subConns = inner.subConns[:2] // without fb-c
	statuses.Store("fb-c", memberStatus{leader: true, term: 2})
	scs["fb-a"].setResponsive(false)
	for range 4 {
		res, err := p.Pick(balancer.PickInfo{Ctx: ToLeader(context.Background())})
		if err != nil {
			t.Fatal(err)
		}
		if got := res.SubConn.(*fakeSubConn).name; got != "fb-b" {
			t.Fatalf("picked %s, want fb-b, the one that answers", got)
		}
	}
}
