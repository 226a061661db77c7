//! The main demo: installs `GlobalBfc` as the global allocator, exercises it, and prints its stats.

use std::collections::{BTreeMap, HashMap};

#[global_allocator]
static A: bfc_alloc::GlobalBfc = bfc_alloc::GlobalBfc::new();

fn main() {
    let mut words: HashMap<String, usize> = HashMap::new();
    let text = "the quick brown fox jumps over the lazy dog ".repeat(10_000);
    for w in text.split_whitespace() {
        *words.entry(w.to_string()).or_default() += 1;
    }
    let mut tree = BTreeMap::new();
    for i in 0..100_000u64 {
        tree.insert(i, vec![i as u8; (i % 64) as usize]);
    }
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let mut v: Vec<Box<[u8]>> = Vec::new();
                for i in 0..50_000usize {
                    v.push(vec![t as u8; 8 + (i * 37) % 2048].into_boxed_slice());
                    if v.len() > 1000 {
                        v.swap_remove(i % 1000);
                    }
                }
                v.len()
            })
        })
        .collect();
    let kept: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let big = vec![7u8; 64 << 20];
    println!(
        "words: {}, tree: {}, kept: {}, big[0]: {}",
        words.len(),
        tree.len(),
        kept,
        big[0]
    );
    println!(
        "--- with a 64 MiB block, 100k tree nodes live ---\n{}",
        A.stats()
    );
    drop(big);
    drop(tree);
    A.check().expect("heap invariants");
    println!("--- after freeing them ---\n{}", A.stats());
}
