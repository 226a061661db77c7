//! Runs every workload with every allocator, each as the `#[global_allocator]` of its own process,
//! and prints one table of times and one of peak RSS.
//!
//! `cargo run --release --manifest-path bench-peers/Cargo.toml [-- --rounds N] [--allocs a,b] [workload...]`

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use bench_peers::WORKLOADS;

/// Times of the rounds and the highest peak RSS (KiB) of one (workload, allocator).
type Runs = (Vec<f64>, u64);

const ALLOCATORS: &[&str] = &[
    "bfc", "system", "mimalloc", "jemalloc", "talc", "rlsf", "dlmalloc",
];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut rounds = 5usize;
    let mut allocs: Vec<String> = ALLOCATORS.iter().map(|s| s.to_string()).collect();
    let mut workloads: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => {
                rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--rounds N")
            }
            "--allocs" => {
                allocs = args
                    .next()
                    .expect("--allocs a,b")
                    .split(',')
                    .map(str::to_string)
                    .collect()
            }
            w => workloads.push(w.to_string()),
        }
    }
    if workloads.is_empty() {
        workloads = WORKLOADS.iter().map(|(w, _)| w.to_string()).collect();
    }

    // Build the peer binaries (`cargo run` builds only this one).
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let status = Command::new(cargo)
        .args(["build", "--release", "--bins", "--manifest-path", manifest])
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the peer binaries failed");
    let dir: PathBuf = std::env::current_exe().unwrap().parent().unwrap().into();

    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "bench-peers: {rounds} rounds, {cpus} CPUs; median time per unit (lower is better), \
         each (workload, allocator) in its own process; rounds interleave the allocators"
    );
    println!(
        "command: cargo run --release --manifest-path bench-peers/Cargo.toml -- {}\n",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );

    // (workload, allocator) -> (times, peak RSS KiB); None when a run failed.
    let mut results: HashMap<(String, String), Option<Runs>> = HashMap::new();
    for round in 0..rounds {
        for w in &workloads {
            for k in 0..allocs.len() {
                let a = &allocs[(k + round) % allocs.len()];
                let out = Command::new(dir.join(format!("peer-{a}"))).arg(w).output();
                let parsed = out.ok().filter(|o| o.status.success()).and_then(|o| {
                    let line = String::from_utf8_lossy(&o.stdout).trim().to_string();
                    let mut f = line.split_whitespace().skip(1);
                    Some((
                        f.next()?.parse::<f64>().ok()?,
                        f.next()?.parse::<u64>().ok()?,
                    ))
                });
                let entry = results
                    .entry((w.clone(), a.clone()))
                    .or_insert_with(|| Some((Vec::new(), 0)));
                match (entry.as_mut(), parsed) {
                    (Some((times, rss)), Some((t, r))) => {
                        times.push(t);
                        *rss = (*rss).max(r);
                    }
                    _ => *entry = None,
                }
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }

    let cell = |w: &str, a: &str| {
        results
            .get(&(w.to_string(), a.to_string()))
            .cloned()
            .flatten()
    };
    let unit = |w: &str| {
        WORKLOADS
            .iter()
            .find(|(n, _)| *n == w)
            .map_or("?", |(_, u)| u)
    };

    print!("| workload | unit |");
    for a in &allocs {
        print!(" {a} |");
    }
    println!(" bfc / best peer |");
    println!("|---|---|{}---|", "---|".repeat(allocs.len()));
    for w in &workloads {
        print!("| {w} | {} |", unit(w));
        let mut best: Option<(f64, &str)> = None;
        let mut bfc = None;
        for a in &allocs {
            match cell(w, a) {
                Some((mut t, _)) => {
                    let m = median(&mut t);
                    print!(" {m:.2} |");
                    if a == "bfc" {
                        bfc = Some(m);
                    } else if best.is_none_or(|(b, _)| m < b) {
                        best = Some((m, a));
                    }
                }
                None => print!(" failed |"),
            }
        }
        match (bfc, best) {
            (Some(b), Some((p, name))) => println!(" {:.2} ({name}) |", b / p),
            _ => println!(" - |"),
        }
    }

    println!("\nPeak RSS (VmHWM), MiB:\n");
    print!("| workload |");
    for a in &allocs {
        print!(" {a} |");
    }
    println!(" bfc / glibc |");
    println!("|---|{}---|", "---|".repeat(allocs.len()));
    for w in &workloads {
        print!("| {w} |");
        for a in &allocs {
            match cell(w, a) {
                Some((_, r)) => print!(" {:.1} |", r as f64 / 1024.0),
                None => print!(" failed |"),
            }
        }
        match (cell(w, "bfc"), cell(w, "system")) {
            (Some((_, b)), Some((_, s))) if s > 0 => println!(" {:.2} |", b as f64 / s as f64),
            _ => println!(" - |"),
        }
    }
}
