#!/usr/bin/env bash
# The whole test suite: unit, integration, doc tests, the no_std build, and the loom models.
# This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== unit, integration and doc tests"
cargo test --all-targets
cargo test --doc --features cuda   # the device pool's examples too
cargo test --all-targets --features cuda   # the device pool; GPU tests skip without a driver
# Release builds check some bad frees later than debug builds (the fast paths trust the layout).
cargo test --release --test global

echo "== no_std core (no default features), host and bare-metal target"
cargo build --no-default-features
cargo test --no-default-features
# The host allocator without std: the lock alone, no thread caches.
cargo build --no-default-features --features host
cargo test --no-default-features --features host
if rustup target list --installed 2>/dev/null | grep -qx thumbv7em-none-eabihf \
   || rustup target add thumbv7em-none-eabihf >/dev/null 2>&1; then
  cargo build --no-default-features --target thumbv7em-none-eabihf
else
  echo "skipping the thumbv7em-none-eabihf build: the target could not be installed"
fi

if [ -f loom-tests/models.rs ]; then
  echo "== loom models (release, bounded)"
  RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}" \
    cargo test --release --features cuda --test loom -- --test-threads=1
fi
