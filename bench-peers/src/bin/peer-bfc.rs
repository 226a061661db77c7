#[global_allocator]
static A: bfc_alloc::GlobalBfc = bfc_alloc::GlobalBfc::new();

fn main() {
    bench_peers::main();
}
