//! The random operation sequences shared by the property tests (`core_props`, `host_props`).

use proptest::prelude::*;

#[derive(Clone, Debug)]
pub enum Op {
    Alloc {
        size: usize,
        align_log2: u32,
    },
    Free {
        pick: usize,
    },
    /// Resize (core) or realloc (host) a live block.
    Resize {
        pick: usize,
        size: usize,
    },
}

/// Sizes log-uniform from 1 byte up to `2^max_log2` bytes.
pub fn size(max_log2: u32) -> impl Strategy<Value = usize> {
    (0..max_log2, any::<u32>()).prop_map(|(bits, r)| {
        let lo = 1usize << bits;
        lo + (r as usize % lo)
    })
}

/// Allocations (alignments up to 1 MiB), frees and resizes, weighted 4 : 3 : `resize_weight`.
pub fn op(max_log2: u32, resize_weight: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (size(max_log2), 0u32..=20)
            .prop_map(|(size, align_log2)| Op::Alloc { size, align_log2 }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        resize_weight => (any::<usize>(), size(max_log2))
            .prop_map(|(pick, size)| Op::Resize { pick, size }),
    ]
}
