//! Runs every workload with every allocator, each as the `#[global_allocator]` of its own process,
//! and prints one table of times and one of peak RSS.
//!
//! `cd bench-peers && cargo run --release [-- --rounds N] [--allocs a,b] [workload...]`
//!
//! The peer binaries are always built from this directory, so `.cargo/config.toml` here applies to
//! them (it aligns every loop to 64 bytes: otherwise the same workload loop sits at a different
//! alignment in each binary, which alone moved the `vec` row by up to 40%).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bench_peers::WORKLOADS;

/// Allocators in table order (binary `peer-<name>`); `system` is glibc's malloc.
const ALLOCATORS: &[&str] = &[
    "bfc", "system", "mimalloc", "jemalloc", "talc", "rlsf", "dlmalloc",
];

/// `(name, binary, environment)`.
type Variant = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// Variants, run after the allocators by default and counted as peers: `(name, binary,
/// environment)`. mimalloc asks for transparent huge pages on its arenas (`MADV_HUGEPAGE`, its
/// `allow_thp` default) while bfc-alloc keeps the system's policy on its arena (it refuses them only
/// on its metadata); `mimalloc-nothp` is mimalloc with THP off, so the two choices can be told apart
/// from the allocators (with first-byte writes a 2 MiB fault serves one written byte, which moves
/// mimalloc's `large` time and every RSS of its). It is in the best-peer column: the THP policy must
/// not decide which mimalloc bfc-alloc is measured against.
const VARIANTS: &[Variant] = &[("mimalloc-nothp", "mimalloc", &[("MIMALLOC_ALLOW_THP", "0")])];

/// A run taking longer than this is killed and counted as failed.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// Results of one (workload, allocator): times of the rounds, highest peak RSS (KiB), failures.
#[derive(Default)]
struct Cell {
    times: Vec<f64>,
    rss_kib: u64,
    failures: Vec<String>,
}

impl Cell {
    /// Median time, when no round failed.
    fn median(&self) -> Option<f64> {
        if !self.failures.is_empty() || self.times.is_empty() {
            return None;
        }
        let mut v = self.times.clone();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        Some(if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        })
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: bench-peers [--rounds N] [--allocs a,b,...] [workload...]\n  allocators: {},{}\n  workloads: {}",
        ALLOCATORS.join(","),
        VARIANTS.iter().map(|v| v.0).collect::<Vec<_>>().join(","),
        WORKLOADS.iter().map(|w| w.0).collect::<Vec<_>>().join(" ")
    );
    std::process::exit(2)
}

/// Runs `peer-<alloc> <workload>`: `(time per unit, peak RSS KiB)`, or why it failed.
fn run_one(dir: &Path, alloc: &str, workload: &str) -> Result<(f64, u64), String> {
    let (bin, env): (&str, &[(&str, &str)]) = VARIANTS
        .iter()
        .find(|v| v.0 == alloc)
        .map_or((alloc, &[]), |v| (v.1, v.2));
    let mut child = Command::new(dir.join(format!("peer-{bin}")))
        .arg(workload)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            break s;
        }
        if start.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("timed out after {} s", RUN_TIMEOUT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    if !status.success() {
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!("{status}: {last}"));
    }
    let mut f = out.split_whitespace();
    let parsed = (|| {
        if f.next()? != workload {
            return None;
        }
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })();
    parsed.ok_or_else(|| format!("unexpected output {:?}", out.trim()))
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn main() {
    let mut rounds = 5usize;
    let mut allocs: Vec<String> = ALLOCATORS
        .iter()
        .copied()
        .chain(VARIANTS.iter().map(|v| v.0))
        .map(str::to_string)
        .collect();
    let mut workloads: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => {
                rounds = match args.next().and_then(|v| v.parse().ok()) {
                    Some(n) if n > 0 => n,
                    _ => usage(),
                }
            }
            "--allocs" => {
                allocs = args
                    .next()
                    .unwrap_or_else(|| usage())
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            }
            "-h" | "--help" => usage(),
            w => workloads.push(w.to_string()),
        }
    }
    if workloads.is_empty() {
        workloads = WORKLOADS.iter().map(|(w, _)| w.to_string()).collect();
    }
    for w in &workloads {
        if !WORKLOADS.iter().any(|(n, _)| n == w) {
            eprintln!("unknown workload {w:?}");
            usage();
        }
    }
    for a in &allocs {
        if !ALLOCATORS.contains(&a.as_str()) && !VARIANTS.iter().any(|v| v.0 == a) {
            eprintln!("unknown allocator {a:?}");
            usage();
        }
    }
    if allocs.is_empty() {
        usage();
    }

    // The peers are built with `--release` below but run from this binary's directory: a debug
    // runner would run the debug peers there (stale ones, or none), under a header that says
    // `--release`.
    if cfg!(debug_assertions) {
        eprintln!("run the runner with --release: cd bench-peers && cargo run --release [-- ...]");
        std::process::exit(2);
    }

    // Build the peer binaries (`cargo run` builds only this one), from this package's directory so
    // that its `.cargo/config.toml` applies however the runner was started.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--bins"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo");
    assert!(status.success(), "building the peer binaries failed");
    let dir: PathBuf = std::env::current_exe()
        .expect("current_exe")
        .parent()
        .expect("exe dir")
        .into();

    let mut results: HashMap<(String, String), Cell> = HashMap::new();
    for round in 0..rounds {
        for w in &workloads {
            // Rotate the allocator order each round, so no allocator always runs first or last.
            for k in 0..allocs.len() {
                let a = &allocs[(k + round) % allocs.len()];
                let cell = results.entry((w.clone(), a.clone())).or_default();
                match run_one(&dir, a, w) {
                    Ok((t, rss)) => {
                        cell.times.push(t);
                        cell.rss_kib = cell.rss_kib.max(rss);
                    }
                    Err(e) => {
                        eprintln!("peer-{a} {w}: FAILED ({e})");
                        cell.failures.push(e);
                    }
                }
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }

    let cell = |w: &str, a: &str| results.get(&(w.to_string(), a.to_string()));
    let unit = |w: &str| {
        WORKLOADS
            .iter()
            .find(|(n, _)| *n == w)
            .map_or("?", |(_, u)| u)
    };

    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!();
    println!("machine: {cpus} CPUs (nproc), {}", cpu_model());
    // mimalloc's RSS (and its `large` time) depend on it, and so, where it is `always`, do
    // bfc-alloc's: its arena keeps the system's policy (only its metadata refuses huge pages).
    println!(
        "transparent huge pages: {}",
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .map_or_else(|_| "unknown".into(), |s| s.trim().to_string())
    );
    println!(
        "command: cd bench-peers && cargo run --release --{}",
        std::env::args()
            .skip(1)
            .map(|a| format!(" {a}"))
            .collect::<String>()
    );
    println!(
        "{rounds} rounds; each (workload, allocator) runs in its own process with that allocator as \
         #[global_allocator]; allocators interleaved within each round. system = glibc malloc.\n"
    );
    println!("Median time per unit (lower is better):\n");
    print!("| workload | unit |");
    for a in &allocs {
        print!(" {a} |");
    }
    println!(" bfc / best peer |");
    println!("|---|---|{}---|", "---:|".repeat(allocs.len()));
    for w in &workloads {
        print!("| {w} | {} |", unit(w));
        let mut best: Option<(f64, &str)> = None;
        let mut bfc = None;
        // Peers left out of the best-peer ratio because a round of theirs failed.
        let mut excluded: Vec<&str> = Vec::new();
        for a in &allocs {
            match cell(w, a).and_then(Cell::median) {
                Some(m) => {
                    print!(" {} |", fmt_time(m));
                    if a == "bfc" {
                        bfc = Some(m);
                    } else if best.is_none_or(|(b, _)| m < b) {
                        best = Some((m, a));
                    }
                }
                None => {
                    print!(" failed |");
                    if a != "bfc" {
                        excluded.push(a);
                    }
                }
            }
        }
        let note = if excluded.is_empty() {
            String::new()
        } else {
            format!("; without failed {}", excluded.join(", "))
        };
        match (bfc, best) {
            (Some(b), Some((p, name))) => println!(" {:.2} ({name}{note}) |", b / p),
            _ => println!(" - |"),
        }
    }

    println!("\nPeak RSS (VmHWM, max over rounds), MiB:\n");
    print!("| workload |");
    for a in &allocs {
        print!(" {a} |");
    }
    println!(" bfc / glibc |");
    println!("|---|{}---|", "---:|".repeat(allocs.len()));
    let rss = |w: &str, a: &str| {
        cell(w, a)
            .filter(|c| c.failures.is_empty() && !c.times.is_empty())
            .map(|c| c.rss_kib)
    };
    for w in &workloads {
        print!("| {w} |");
        for a in &allocs {
            match rss(w, a) {
                Some(r) => print!(" {:.1} |", r as f64 / 1024.0),
                None => print!(" failed |"),
            }
        }
        match (rss(w, "bfc"), rss(w, "system")) {
            (Some(b), Some(s)) if s > 0 => println!(" {:.2} |", b as f64 / s as f64),
            _ => println!(" - |"),
        }
    }

    let mut failed: Vec<_> = results
        .iter()
        .filter(|(_, c)| !c.failures.is_empty())
        .collect();
    if !failed.is_empty() {
        failed.sort_by(|a, b| a.0.cmp(b.0));
        println!("\nFailures:");
        for ((w, a), c) in failed {
            println!(
                "- peer-{a} {w}: {} of {rounds} rounds failed; first: {}",
                c.failures.len(),
                c.failures[0]
            );
        }
    }
}

/// Three significant digits or so.
fn fmt_time(t: f64) -> String {
    if t >= 100.0 {
        format!("{t:.0}")
    } else if t >= 10.0 {
        format!("{t:.1}")
    } else {
        format!("{t:.2}")
    }
}
