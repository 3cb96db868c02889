#!/usr/bin/env bash
# Build the compiled extension (native/, Rust: PyO3 + maturin) and install it into the virtualenv.
# Run by `make native` (part of `make setup`). Needs cargo: on PATH or where rustup puts it
# (~/.cargo/bin). The wheel goes to native/dist/ (the compose host image installs it from there);
# cargo's build directory native/target/ is kept, so an unchanged crate is not compiled again.
#   scripts/build-native.sh PYTHON
set -euo pipefail
PY=${1:?usage: build-native.sh PYTHON}
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "error: cargo (Rust) is needed to build Capsule's compiled extension (native/), and it is neither" >&2
    echo "on PATH nor in ~/.cargo/bin. Install it with rustup (https://rustup.rs), then run make setup again." >&2
    exit 1
  fi
fi
export CARGO_TARGET_DIR="$PWD/native/target" CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
rm -rf native/dist
"$PY" -m pip wheel -q --no-deps -w native/dist ./native
"$PY" -m pip install -q --no-deps --force-reinstall native/dist/capsule_native-*.whl
"$PY" -c "import capsule_native" || { echo "error: capsule_native was built but does not import" >&2; exit 1; }
