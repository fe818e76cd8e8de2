#!/usr/bin/env bash
# Maintainer tool: after editing the series, put the pristine files (from a pristine
# copy of site-packages, argument 1) back into the venv's vLLM and apply the new series.
set -euo pipefail
cd "$(dirname "$0")/.."
PRISTINE="${1:?usage: scripts/reapply_patch_dev.sh PRISTINE_SITE_PACKAGES}"
SITE=$(.venv/bin/python -c "from ratebench.patching import site_packages_of_vllm as s; print(s())")
grep -v '^#' patches/vllm-0.32.0/pristine.sha256 | while read -r hash path; do
    if [ "$hash" = absent ]; then rm -f "$SITE/$path"; else cp "$PRISTINE/$path" "$SITE/$path"; fi
done
.venv/bin/ratebench patch apply
