#[global_allocator]
static A: std::alloc::System = std::alloc::System;

fn main() {
    bench_peers::main();
}
