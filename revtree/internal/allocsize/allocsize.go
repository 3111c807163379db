// Package allocsize says how much heap the Go allocator spends on an
// allocation of a given size: its size class, or whole pages for a large
// object. revtree's memory estimates are made of it.
package allocsize

// classes are the Go allocator's small object size classes
// (internal/runtime/gc/sizeclasses.go, Go 1.26). Larger objects take whole
// 8 KiB pages.
var classes = [...]int64{
	8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
	288, 320, 352, 384, 416, 448, 480, 512, 576, 640, 704, 768, 896, 1024, 1152, 1280,
	1408, 1536, 1792, 2048, 2304, 2688, 3072, 3200, 3456, 4096, 4864, 5376, 6144, 6528,
	6784, 6912, 8192, 9472, 9728, 10240, 10880, 12288, 13568, 14336, 16384, 18432, 19072,
	20480, 21760, 24576, 27264, 28672, 32768,
}

// Class returns the heap bytes an allocation of n bytes takes.
func Class(n int64) int64 {
	switch {
	case n <= 0:
		return 0
	case n > classes[len(classes)-1]:
		const page = 8192
		return (n + page - 1) / page * page
	}
	lo, hi := 0, len(classes)-1
	for lo < hi {
		mid := (lo + hi) / 2
		if classes[mid] < n {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return classes[lo]
}

// Bytes is the heap an allocation of a []byte of n bytes takes. Below 16
// bytes the allocator packs pointer-free objects together (its tiny
// allocator), so they cost about their length.
func Bytes(n int) int64 {
	if n < 16 {
		return int64(n)
	}
	return Class(int64(n))
}
