#!/usr/bin/env bash
# The lock resolves from PyPI alone, with wheels, for every platform and Python version we promise
# (Linux x86_64 and aarch64, macOS 14+ arm64; Python 3.11-3.13): each exact version the lock pins is resolved
# again for that target. CI runs this next to `uv lock --check`; it needs PyPI, nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}  # a command, maybe "python3 -m uv": expanded unquoted on purpose
pinned=$(mktemp --suffix=.txt)
resolved=$(mktemp --suffix=.txt)
trap 'rm -f "$pinned" "$resolved"' EXIT
$UV export --frozen --all-groups --all-extras --no-hashes --no-emit-workspace --no-header -q -o "$pinned"
status=0
for platform in x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu aarch64-apple-darwin; do
  for python in 3.11 3.12 3.13; do
    # torch's macOS wheels are built for macOS 14 (the deployment target uv assumes otherwise is older)
    # (and a target the lock's markers exclude would resolve to nothing: torch must be among the results)
    if MACOSX_DEPLOYMENT_TARGET=14.0 $UV pip compile "$pinned" --python-platform "$platform" \
        --python-version "$python" --only-binary :all: --no-deps -q -o "$resolved" && grep -q '^torch==' "$resolved"
    then
      echo "resolves: $platform, Python $python"
    else
      echo "DOES NOT RESOLVE: $platform, Python $python" >&2
      status=1
    fi
  done
done
exit $status
