#!/usr/bin/env bash
# Source on the device after `source .whl/setup.sh`: shared/device/setup.sh installs `packages/* .` in one pip
# call, which silently installed nothing for this workspace (seen 2026-11-29); one pip call per package works.
for p in packages/* .; do
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site "$p" \
    2>&1 | grep -i error | head -3
done
python3 -c "from importlib.metadata import entry_points; print('backends:', sorted(e.name for e in entry_points(group='rustinfer.backends')))"
