#!/usr/bin/env bash
# On the GPU machine, from the repository root with .titan-wheels/ carried
# (scripts/titan_wheels.sh made it): installs one torchtitan version and what its trainer needs
# into a folder of its own, without the network, and prints the PYTHONPATH to use.
#
#   scripts/titan_install.sh 0.2.2 [TARGET]     (default TARGET: /tmp/titan-0.2.2)
#   export PYTHONPATH=/tmp/titan-0.2.2
#
# optional-VERSION/ (torchao, the release that version's float8 converters import) is
# installed where it was downloaded.
set -euo pipefail
version=${1:?which torchtitan: 0.2.2 or 0.3.0}
target=${2:-/tmp/titan-$version}
wheels=(.titan-wheels/common/*.whl ".titan-wheels/$version"/*.whl)
[ -d ".titan-wheels/optional-$version" ] && wheels+=(".titan-wheels/optional-$version"/*.whl)
# the wheels installed last time are recorded by their contents' hashes; the same wheels again
# are not reinstalled, so two scripts that run at once on one machine do not replace each
# other's imports under them (any other wheel, even under the same name, is installed)
stamp="$target/.blockscale-wheels"
listed=$(for w in "${wheels[@]}"; do sha256sum "$w" | cut -d' ' -f1; done | sort)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$listed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --find-links .titan-wheels/common --find-links ".titan-wheels/$version" \
    --target "$target" "${wheels[@]}"
  printf '%s\n' "$listed" > "$stamp"
fi
echo "export PYTHONPATH=$target"
