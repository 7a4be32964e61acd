//! The allow path of a known tenant allocates nothing: a counting global
//! allocator (this test binary's), counting only on the thread that asks.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use super::*;

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: the thread may be tearing down its locals.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

// SAFETY: every method forwards to the system allocator with the caller's
// own arguments, so `Counting` keeps `System`'s contract; counting touches
// only thread-locals and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's `layout`, under `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: `ptr` came from this allocator (i.e. `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `realloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|on| on.set(true));
    f();
    COUNTING.with(|on| on.set(false));
    ALLOCATIONS.with(|n| n.get())
}

#[test]
fn the_counting_allocator_counts() {
    assert!(allocations(|| drop(std::hint::black_box(vec![1u8; 64]))) >= 1);
}

#[test]
fn charging_a_known_tenant_allocates_nothing() {
    let guarded = policy_with(
        r#"{"api":{"guard":"db"}}"#,
        r#","ratelimit_headers":false,"guards":{"db":{"limits":[{"rate":1000000,"per":"1s"}]}}"#,
    );
    let two_limits = policy(r#","ratelimit_headers": false"#);
    for (p, tenant) in [(&two_limits, "bigco"), (&two_limits, "combo"), (&guarded, "acme")] {
        let store = SharedStore::new();
        let host = req(&store, "api", tenant);
        let prepared = prepare(p, &host).unwrap();
        let mut scratch = Scratch::default();
        // The first request inserts the key, the second reads it back: the
        // buffers have grown to the entry's size.
        for _ in 0..2 {
            assert_eq!(
                charge(p, &prepared, &host, T0, &mut scratch).reason,
                Reason::Allowed
            );
        }
        let mut reasons = Vec::with_capacity(100);
        let n = allocations(|| {
            for i in 0..100 {
                let now = T0 + (i + 1) * 6 * S; // within every limit of the three plans
                reasons.push(charge(p, &prepared, &host, now, &mut scratch).reason);
            }
        });
        assert!(
            reasons.iter().all(|r| *r == Reason::Allowed),
            "{tenant}: {reasons:?}"
        );
        assert_eq!(n, 0, "{tenant}: heap allocations in 100 allowed charges");
    }
}
