//! Random alloc/free/resize sequences on the core against a shadow model, with the invariant checker
//! after every step. The engine runs over the simulated source (addresses only).

use std::collections::BTreeMap;

use bfc_alloc::core::sim::SimSource;
use bfc_alloc::core::{AllocError, Bfc, Chunk, Config, OomCause, Resize};
use proptest::prelude::*;

#[path = "common/ops.rs"]
mod ops;
use ops::Op;

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;

/// Runs `ops`; returns how many allocations failed for want of memory and the most regions held.
fn run(config: Config, ops: Vec<Op>) -> (usize, usize) {
    let limit = config.memory_limit;
    let (mut ooms, mut max_regions) = (0, 0);
    let source = SimSource::new(1 << 44, 1 << 40);
    let mut b = Bfc::new(config, source, vec![Chunk::EMPTY; 1 << 14]).unwrap();
    // ptr -> (usable size, requested size)
    let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Alloc { size, align_log2 } => {
                let align = 1usize << align_log2;
                match b.allocate(size, align) {
                    Ok(p) => {
                        assert_eq!(p % align, 0, "alignment {align} not honoured");
                        let usable = b.usable_size(p).unwrap();
                        assert!(usable >= size);
                        live.insert(p, (usable, size));
                    }
                    Err(AllocError::OutOfMemory(r)) => {
                        // Refused only when growing by the request would pass the limit, with
                        // nothing changed and no free chunk that would have held the request with
                        // its alignment slack.
                        ooms += 1;
                        assert_eq!(r.requested, size);
                        assert_eq!(r.cause, OomCause::LimitReached, "{r}");
                        assert!(r.stats.bytes_reserved + r.needed > limit, "{r}");
                        assert!(r.stats.largest_free_block < r.needed, "{r}");
                        assert_eq!(
                            r.stats.bytes_in_use,
                            live.values().map(|v| v.0).sum::<usize>()
                        );
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(pick % live.len()).unwrap();
                let (usable, _) = live.remove(&p).unwrap();
                let f = b.deallocate(p).unwrap();
                assert_eq!((f.ptr, f.size), (p, usable));
                assert!(f.merged_ptr <= p && f.merged_ptr + f.merged_size >= p + usable);
            }
            Op::Resize { pick, size } => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(pick % live.len()).unwrap();
                match b.resize_in_place(p, size).unwrap() {
                    Resize::Done { size: got, .. } => {
                        assert!(got >= size);
                        assert_eq!(b.usable_size(p), Ok(got));
                        live.insert(p, (got, size));
                    }
                    Resize::Moved => assert!(size > live[&p].0),
                }
            }
        }
        if let Err(e) = b.check() {
            panic!("{e}");
        }
        max_regions = max_regions.max(b.stats().num_regions);
        // No two live blocks overlap.
        let mut end = 0;
        for (&p, &(usable, _)) in &live {
            assert!(p >= end, "blocks overlap at {p:#x}");
            end = p + usable;
        }
        assert_eq!(
            b.stats().bytes_in_use,
            live.values().map(|v| v.0).sum::<usize>()
        );
    }
    for (p, _) in live {
        b.deallocate(p).unwrap();
    }
    b.check().unwrap();
    assert_eq!(b.stats().bytes_in_use, 0);
    b.flush_quick_lists();
    b.check().unwrap();
    // Everything coalesced back: one free chunk per region.
    assert_eq!(b.stats().num_free_chunks, b.stats().num_regions);
    (ooms, max_regions)
}

/// Random operations under a limit the live blocks reach: the device configuration grows region by
/// region up to its limit, and requests past it fail cleanly (the out-of-memory branch of `run`,
/// which the 256 MiB limit below never reaches). A fixed sequence, so that both are known to happen.
#[test]
fn device_config_reaches_its_limit() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let ops: Vec<Op> = (0..2000)
        .map(|_| match rng.next() % 7 {
            0..=3 => Op::Alloc {
                size: rng.log_size(1, 4 << 20),
                align_log2: (rng.next() % 21) as u32,
            },
            4 | 5 => Op::Free {
                pick: rng.next() as usize,
            },
            _ => Op::Resize {
                pick: rng.next() as usize,
                size: rng.log_size(1, 4 << 20),
            },
        })
        .collect();
    let mut c = Config::device(20 << 20);
    c.initial_region_size = 1 << 20;
    let (ooms, max_regions) = run(c, ops);
    assert!(ooms > 0, "the limit was never reached");
    assert!(max_regions > 1, "the pool never grew");
}

fn cases() -> u32 {
    if cfg!(miri) {
        4
    } else {
        64
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn host_config_random_ops(ops in prop::collection::vec(ops::op(22, 2), 1..if cfg!(miri) { 40 } else { 400 })) {
        run(Config::host(1 << 32), ops);
    }

    #[test]
    fn device_config_with_growth_and_limit(ops in prop::collection::vec(ops::op(22, 2), 1..if cfg!(miri) { 40 } else { 400 })) {
        let mut c = Config::device(256 << 20);
        c.initial_region_size = 1 << 20;
        run(c, ops);
    }
}
