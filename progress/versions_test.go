package progress

import "testing"

// TestCheckRelease: the releases whose known bugs break the follower are
// refused, with the reason; the others and unknown ones are not.
func TestCheckRelease(t *testing.T) {
	for v, refused := range map[string]bool{
		"3.4.30": true, "3.5.7": true, "3.5.8": true, "3.5.12": true, "3.5.13": false, "3.5.21": false,
		"3.6.0": true, "3.6.1": true, "3.6.2": false, "3.6.16": false, "3.7.0": false, "3.7.3": false,
		"2.3.8": true, "4.0.0": true, "": false, "garbage": false,
	} {
		if err := checkRelease(v); (err != nil) != refused {
			t.Errorf("checkRelease(%q) = %v, refused %v", v, err, refused)
		}
	}
}
