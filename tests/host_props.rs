//! Random alloc/free/realloc sequences on a private `GlobalBfc` (real memory): blocks never overlap,
//! alignment is honoured, every block keeps the bytes written into it, and realloc preserves the
//! prefix. The heap checker runs after every step.

use std::alloc::{GlobalAlloc, Layout};
use std::collections::BTreeMap;

use bfc_alloc::{GlobalBfc, HostConfig};
use proptest::prelude::*;

#[path = "common/ops.rs"]
mod ops;
use ops::Op;

/// The byte block `tag` holds at offset `i`.
fn pattern(tag: u32, i: usize) -> u8 {
    (tag as usize).wrapping_mul(31).wrapping_add(i) as u8
}

/// Fills or verifies a sample of the block's bytes (the ends and a stride), so MiB blocks stay cheap.
fn sample(size: usize) -> impl Iterator<Item = usize> {
    let stride = (size / 64).max(1);
    (0..size.min(64))
        .chain((0..size).step_by(stride))
        .chain(size.saturating_sub(64)..size)
}

fn fill(p: *mut u8, size: usize, tag: u32) {
    for i in sample(size) {
        // SAFETY: `i < size` and the block holds `size` bytes.
        unsafe { *p.add(i) = pattern(tag, i) };
    }
}

fn verify(p: *mut u8, size: usize, tag: u32) {
    for i in sample(size) {
        // SAFETY: as in `fill`.
        let b = unsafe { *p.add(i) };
        assert_eq!(
            b,
            pattern(tag, i),
            "block {p:p} byte {i} changed (tag {tag})"
        );
    }
}

fn run(ops: Vec<Op>) {
    let a = GlobalBfc::with_config(HostConfig {
        arena_size: 1 << 30,
        ..HostConfig::DEFAULT
    });
    // ptr -> (layout, tag)
    let mut live: BTreeMap<usize, (Layout, u32)> = BTreeMap::new();
    let mut next_tag = 0u32;
    for op in ops {
        match op {
            Op::Alloc { size, align_log2 } => {
                let l = Layout::from_size_align(size, 1 << align_log2).unwrap();
                // SAFETY: non-zero size.
                let p = unsafe { a.alloc(l) };
                assert!(!p.is_null(), "1 GiB arena exhausted by {size} bytes");
                assert_eq!(p as usize % l.align(), 0);
                next_tag += 1;
                fill(p, size, next_tag);
                live.insert(p as usize, (l, next_tag));
            }
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(pick % live.len()).unwrap();
                let (l, tag) = live.remove(&p).unwrap();
                verify(p as *mut u8, l.size(), tag);
                // SAFETY: allocated by `a` with `l`, freed once.
                unsafe { a.dealloc(p as *mut u8, l) };
            }
            Op::Resize { pick, size } => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(pick % live.len()).unwrap();
                let (l, tag) = live.remove(&p).unwrap();
                // SAFETY: allocated by `a` with `l`; `size` is non-zero.
                let q = unsafe { a.realloc(p as *mut u8, l, size) };
                assert!(!q.is_null());
                assert_eq!(q as usize % l.align(), 0, "realloc lost the alignment");
                // The common prefix survived the move (or stayed in place): every sampled byte of
                // the old block that lies below the new size.
                let kept = l.size().min(size);
                for i in sample(l.size()).filter(|&i| i < kept) {
                    // SAFETY: `i < kept <= size`.
                    let b = unsafe { *q.add(i) };
                    assert_eq!(b, pattern(tag, i), "realloc lost byte {i}");
                }
                next_tag += 1;
                fill(q, size, next_tag);
                live.insert(
                    q as usize,
                    (Layout::from_size_align(size, l.align()).unwrap(), next_tag),
                );
            }
        }
        a.check().unwrap();
        let mut end = 0;
        for (&p, &(l, _)) in &live {
            assert!(p >= end, "blocks overlap at {p:#x}");
            end = p + l.size();
        }
    }
    for (&p, &(l, tag)) in &live {
        verify(p as *mut u8, l.size(), tag);
    }
    for (p, (l, _)) in live {
        // SAFETY: allocated by `a` with `l`, freed once.
        unsafe { a.dealloc(p as *mut u8, l) };
    }
    a.check().unwrap();
    assert_eq!(a.stats().bytes_in_use, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_keep_contents_and_alignment(ops in prop::collection::vec(ops::op(21, 3), 1..300)) {
        run(ops);
    }
}
