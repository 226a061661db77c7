//! Fragmentation of our good-fit bins against TensorFlow's exact best fit on a random workload.
//!
//! The reference is a direct model of TF's policy: free chunks ordered by (size, address), the first
//! one that fits is taken, split with the same rule, coalesced on free. Both run the same operation
//! sequence over one region of the same size; we compare the footprint (highest address ever in use)
//! and the mean fragmentation (1 - largest free / total free) sampled after every operation.

use std::collections::{BTreeMap, BTreeSet};

use bfc_alloc::core::sim::SimSource;
use bfc_alloc::core::{Bfc, Chunk, Config};

/// TensorFlow's exact best fit over a single region, as a reference model.
struct ExactBestFit {
    granule: usize,
    /// start -> (size, in use)
    chunks: BTreeMap<usize, (usize, bool)>,
    free: BTreeSet<(usize, usize)>,
}

impl ExactBestFit {
    fn new(base: usize, size: usize, granule: usize) -> Self {
        let mut chunks = BTreeMap::new();
        chunks.insert(base, (size, false));
        let mut free = BTreeSet::new();
        free.insert((size, base));
        ExactBestFit {
            granule,
            chunks,
            free,
        }
    }

    fn allocate(&mut self, size: usize, split_ratio: usize, max_waste: usize) -> Option<usize> {
        let want = size.max(1).next_multiple_of(self.granule);
        let &(csize, p) = self.free.range((want, 0)..).next()?;
        self.free.remove(&(csize, p));
        let left = csize - want;
        if left >= self.granule && (csize / split_ratio >= want || left >= max_waste) {
            self.chunks.insert(p, (want, true));
            self.chunks.insert(p + want, (left, false));
            self.free.insert((left, p + want));
        } else {
            self.chunks.insert(p, (csize, true));
        }
        Some(p)
    }

    fn deallocate(&mut self, p: usize) {
        let (mut size, used) = self.chunks[&p];
        assert!(used);
        let mut start = p;
        if let Some((&n, &(ns, false))) = self.chunks.range(p + 1..).next() {
            if n == p + size {
                self.free.remove(&(ns, n));
                self.chunks.remove(&n);
                size += ns;
            }
        }
        if let Some((&q, &(qs, false))) = self.chunks.range(..p).next_back() {
            if q + qs == p {
                self.free.remove(&(qs, q));
                self.chunks.remove(&p);
                start = q;
                size += qs;
            }
        }
        self.chunks.insert(start, (size, false));
        self.free.insert((size, start));
    }

    fn fragmentation(&self) -> f64 {
        let total: usize = self.free.iter().map(|f| f.0).sum();
        let largest = self.free.iter().next_back().map_or(0, |f| f.0);
        if total == 0 {
            0.0
        } else {
            1.0 - largest as f64 / total as f64
        }
    }
}

#[path = "common/rng.rs"]
mod rng;
use rng::Rng;

struct Outcome {
    footprint: usize,
    mean_fragmentation: f64,
}

fn compare(
    config: Config,
    seed: u64,
    steps: usize,
    live_target: usize,
    lo: usize,
    hi: usize,
) -> (Outcome, Outcome) {
    const BASE: usize = 1 << 40;
    let region = config.memory_limit;
    let mut ours = Bfc::new(
        config,
        SimSource::new(BASE, region),
        vec![Chunk::EMPTY; 1 << 16],
    )
    .unwrap();
    let mut tf = ExactBestFit::new(BASE, region, config.granule);
    let mut rng = Rng(seed);
    let mut live: Vec<(usize, usize)> = Vec::new();
    let (mut fp_ours, mut fp_tf) = (0usize, 0usize);
    let (mut frag_ours, mut frag_tf) = (0.0, 0.0);
    for _ in 0..steps {
        let grow = live.len() < live_target / 2
            || (live.len() < live_target * 3 / 2 && rng.next() % 2 == 0);
        if grow {
            let size = rng.log_uniform(lo, hi);
            let a = ours.allocate(size, 1).expect("region is large enough");
            let b = tf
                .allocate(size, config.split_ratio, config.max_internal_fragmentation)
                .expect("reference region is large enough");
            fp_ours = fp_ours.max(a + ours.usable_size(a).unwrap() - BASE);
            fp_tf = fp_tf.max(b + tf.chunks[&b].0 - BASE);
            live.push((a, b));
        } else {
            let i = rng.next() as usize % live.len();
            let (a, b) = live.swap_remove(i);
            ours.deallocate(a).unwrap();
            tf.deallocate(b);
        }
        frag_ours += ours.stats().fragmentation();
        frag_tf += tf.fragmentation();
    }
    ours.check().unwrap();
    (
        Outcome {
            footprint: fp_ours,
            mean_fragmentation: frag_ours / steps as f64,
        },
        Outcome {
            footprint: fp_tf,
            mean_fragmentation: frag_tf / steps as f64,
        },
    )
}

#[test]
fn good_fit_footprint_stays_close_to_exact_best_fit() {
    let steps = if cfg!(debug_assertions) {
        20_000
    } else {
        100_000
    };
    let mut host = Config::host(1 << 30);
    host.allow_growth = false;
    let mut device = Config::device(1 << 34);
    device.allow_growth = false;
    let mut worst: f64 = 0.0;
    for (name, config, lo, hi) in [
        ("host 16..64K", host, 16, 65536),
        ("device 256..64M", device, 256, 64 << 20),
    ] {
        for seed in [1u64, 2, 3] {
            let (ours, tf) = compare(config, 0x5eed_0000 + seed, steps, 2000, lo, hi);
            let ratio = ours.footprint as f64 / tf.footprint as f64;
            println!(
                "{name} seed {seed}: footprint ours {} / TF exact best fit {} = {ratio:.3}; \
                 mean fragmentation ours {:.3}, TF {:.3}",
                ours.footprint, tf.footprint, ours.mean_fragmentation, tf.mean_fragmentation
            );
            worst = worst.max(ratio);
            assert!(ours.mean_fragmentation < tf.mean_fragmentation + 0.1);
        }
    }
    assert!(
        worst < 1.10,
        "good fit uses {worst:.3}x the footprint of exact best fit"
    );
}
