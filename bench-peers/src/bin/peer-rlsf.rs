#[global_allocator]
static A: rlsf::GlobalTlsf = rlsf::GlobalTlsf::new();

fn main() {
    bench_peers::main();
}
