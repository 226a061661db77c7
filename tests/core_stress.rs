//! Random operation sequences against the engine where `core_props` does not go: chunk tables of
//! 3 to 4,096 records, a source that refuses regions and maps at random, alignments up to 2^30,
//! caller bounds, in-place resizes, releases and sweeps. After every step the engine's own check
//! runs, and every counter is compared with a shadow model and with the source.
use std::collections::BTreeMap;
use std::ptr::NonNull;

use bfc_alloc::core::sim::SimSource;
use bfc_alloc::core::{AllocError, Bfc, Chunk, ChunkHandle, Config, MemorySource, Resize};

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;

/// A [`SimSource`] that refuses `refuse_pct` percent of regions and half as many maps.
struct Flaky {
    inner: SimSource,
    rng: Rng,
    refuse_pct: u64,
}

// SAFETY: every call that is not refused goes to `SimSource`, which keeps the contract; a refusal
// hands out nothing.
unsafe impl MemorySource for Flaky {
    fn alloc_region(&mut self, size: usize, align: usize) -> Option<usize> {
        if self.rng.next() % 100 < self.refuse_pct {
            return None;
        }
        self.inner.alloc_region(size, align)
    }

    unsafe fn free_region(&mut self, base: usize, size: usize) {
        // SAFETY: the engine passes on a region this source handed out, as the contract requires.
        unsafe { self.inner.free_region(base, size) }
    }

    fn alloc_map(&mut self, base: usize, entries: usize) -> Option<NonNull<Option<ChunkHandle>>> {
        if self.rng.next() % 100 < self.refuse_pct / 2 {
            return None;
        }
        self.inner.alloc_map(base, entries)
    }

    unsafe fn free_map(&mut self, base: usize, map: NonNull<Option<ChunkHandle>>, entries: usize) {
        // SAFETY: the engine passes on a map this source handed out, as the contract requires.
        unsafe { self.inner.free_map(base, map, entries) }
    }
}

const BASE: usize = 1 << 44;

fn run(seed: u64, config: Config, table: usize, refuse_pct: u64) {
    let mut rng = Rng(seed);
    let source = Flaky {
        inner: SimSource::new(BASE, 1 << 34),
        rng: Rng(seed ^ 0x1234_5678),
        refuse_pct,
    };
    let mut b = Bfc::new(config, source, vec![Chunk::EMPTY; table]).unwrap();
    let mut live: BTreeMap<usize, usize> = BTreeMap::new();
    let (mut peak, mut peak_reserved, mut allocs) = (0usize, 0usize, 0u64);
    for step in 0..STEPS {
        match rng.next() % 16 {
            0..=6 => {
                let size = match rng.next() % 4 {
                    0 => rng.log_size(1, 2048),
                    1 => rng.log_size(1, 1 << 22),
                    2 => rng.log_size(1, 1 << 26),
                    _ => [0, 1, 16, 256, 4096][rng.next() as usize % 5],
                };
                let align =
                    1usize << [0, 3, 4, 8, 12, 20, 21, 22, 24, 26, 30][rng.next() as usize % 11];
                let bound = if rng.next() % 5 == 0 {
                    BASE + (rng.next() as usize % (1 << 30))
                } else {
                    usize::MAX
                };
                match b.allocate_block_below(size, align, bound) {
                    Ok(a) => {
                        assert_eq!(a.ptr % align, 0, "step {step}");
                        assert!(a.size >= size.max(1), "step {step}");
                        assert!(a.ptr + a.size <= bound, "step {step}");
                        assert_eq!(b.usable_size(a.ptr), Ok(a.size));
                        if let Some((&p, &s)) = live.range(..a.ptr + a.size).next_back() {
                            assert!(p + s <= a.ptr, "step {step}: overlaps the block at {p:#x}");
                        }
                        live.insert(a.ptr, a.size);
                        allocs += 1;
                    }
                    Err(AllocError::OutOfMemory(rep)) => {
                        assert_eq!(rep.stats.bytes_in_use, live.values().sum::<usize>());
                        let counted: usize =
                            rep.free_by_size.iter().map(|s| s.count as usize).sum();
                        assert_eq!(counted, rep.stats.num_free_chunks, "{rep}");
                        // Every failure comes after the slow path, which flushes the quick lists.
                        assert_eq!(rep.stats.num_cached_chunks, 0, "step {step}: {rep}");
                    }
                    Err(AllocError::BeyondBound { .. }) => {}
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            7..=11 => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(rng.next() as usize % live.len()).unwrap();
                let s = live.remove(&p).unwrap();
                let f = b.deallocate(p).unwrap();
                assert_eq!((f.ptr, f.size), (p, s));
            }
            12 | 13 => {
                if live.is_empty() {
                    continue;
                }
                let p = *live.keys().nth(rng.next() as usize % live.len()).unwrap();
                let want = rng.log_size(1, 1 << 24);
                let grown = b.grown_end(p, want);
                match b.resize_in_place(p, want).unwrap() {
                    Resize::Done { size, freed } => {
                        assert!(size >= want);
                        let old = live[&p];
                        if size > old {
                            assert_eq!(grown, Some(p + size));
                        } else {
                            assert_eq!(grown, None);
                        }
                        if let Some(f) = freed {
                            assert_eq!((f.ptr, f.size), (p + size, old - size));
                        }
                        live.insert(p, size);
                        if let Some((&q, _)) = live.range(p + 1..).next() {
                            assert!(p + size <= q, "step {step}: grew into the block at {q:#x}");
                        }
                    }
                    Resize::Moved => assert_eq!(grown, None),
                }
            }
            14 => {
                b.release_free_regions();
            }
            _ => {
                // The owner refuses to return some chunks' pages (they stay unmarked).
                let aging = rng.next() % 2 == 0;
                b.sweep_dirty(4096, aging, |_, _| rng.next() % 4 != 0);
            }
        }
        if let Err(e) = b.check() {
            panic!("step {step}: {e}");
        }
        let st = b.stats();
        let used: usize = live.values().sum();
        peak = peak.max(used);
        assert_eq!(st.bytes_in_use, used, "step {step}");
        assert_eq!(st.num_chunks_in_use, live.len(), "step {step}");
        assert_eq!(st.num_allocs, allocs, "step {step}");
        assert!(st.peak_bytes_in_use >= peak, "step {step}");
        assert_eq!(
            st.bytes_reserved,
            b.source().inner.bytes_live(),
            "step {step}"
        );
        assert_eq!(
            st.num_regions,
            b.source().inner.regions_live(),
            "step {step}"
        );
        peak_reserved = peak_reserved.max(st.bytes_reserved);
        assert_eq!(st.peak_bytes_reserved, peak_reserved, "step {step}");
        assert!(st.bytes_reserved <= config.memory_limit, "step {step}");
    }
    for (p, _) in std::mem::take(&mut live) {
        b.deallocate(p).unwrap();
    }
    b.release_free_regions();
    b.check().unwrap();
    assert_eq!(b.source().inner.bytes_live(), 0);
}

// Under Miri (about 20 s a run of 50 steps): one table size and one refusal rate per config.
const STEPS: usize = if cfg!(miri) { 50 } else { 1500 };

#[test]
fn random_sequences_with_small_tables_and_a_refusing_source() {
    let configs = [
        Config::device(1 << 30),
        Config::host(1 << 30),
        Config {
            allow_growth: true,
            initial_region_size: 1 << 20,
            ..Config::host(3 << 28)
        },
        Config {
            granule: 8,
            map_block_granules: 1,
            fit_scan: 1,
            quick_max_size: 512,
            ..Config::host(1 << 28)
        },
        Config {
            granule: 1 << 21,
            ..Config::device(1 << 31)
        },
        Config {
            initial_region_size: 4096,
            quick_max_size: 4096,
            quick_depth: 4,
            ..Config::device(1 << 30)
        },
        Config {
            allow_growth: false,
            ..Config::device((1 << 30) + 12345)
        },
    ];
    let seeds = if cfg!(miri) { 1 } else { 3 };
    for seed in 1..=seeds {
        for (ci, &config) in configs.iter().enumerate() {
            for &table in if cfg!(miri) {
                &[8][..]
            } else {
                &[3, 8, 40, 4096]
            } {
                for &refuse_pct in if cfg!(miri) { &[30][..] } else { &[0, 30, 90] } {
                    let r = std::panic::catch_unwind(|| {
                        run(seed * 7919 + ci as u64, config, table, refuse_pct)
                    });
                    assert!(
                        r.is_ok(),
                        "seed {seed}, config {ci}, table {table}, refusing {refuse_pct}%"
                    );
                }
            }
        }
    }
}
