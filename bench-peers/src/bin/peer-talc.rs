//! talc over a static 1.5 GiB arena in `.bss` (pages are committed only when touched), as its docs
//! show for hosted programs.
use talc::{ClaimOnOom, Span, Talc, Talck};

const ARENA_SIZE: usize = 3 << 29;
static mut ARENA: [u8; ARENA_SIZE] = [0; ARENA_SIZE];

#[global_allocator]
static A: Talck<spin::Mutex<()>, ClaimOnOom> = Talc::new(unsafe {
    // SAFETY: the arena is used by this allocator alone.
    ClaimOnOom::new(Span::from_array(core::ptr::addr_of!(ARENA).cast_mut()))
})
.lock();

fn main() {
    bench_peers::main();
}
