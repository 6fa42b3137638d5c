#!/usr/bin/env bash
# Builds dist/spark-guard_VERSION_all.deb from this checkout.
# Debian's tools want debian/ at the top of the source: the tree is exported
# into a temporary directory, packaging/debian copied in there, and the
# checkout stays clean. Missing build tools are installed (as root) first.
set -euo pipefail
cd "$(dirname "$0")/.."
build_deps=(debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools
            python3-wheel bash-completion dpkg-dev fakeroot)
missing=()
for p in "${build_deps[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "build-deb: missing ${missing[*]}; run as root or install them" >&2; exit 1; }
  echo "build-deb: installing ${missing[*]}"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src="$work/spark-guard"
mkdir "$src"
# What is in the working tree now, tracked or not, minus what git ignores.
git ls-files --cached --others --exclude-standard -z | xargs -0 cp --parents -t "$src"
cp -r packaging/debian "$src/debian"
cp units/spark-guard.service "$src/debian/spark-guard.service"
cp packaging/spark-guard.tmpfiles "$src/debian/spark-guard.tmpfiles"
cp packaging/spark-guard.bash-completion "$src/debian/spark-guard.bash-completion"
# The distribution's python3 and tools only, whatever else is on PATH (pyenv, a venv).
(cd "$src" && PATH=/usr/sbin:/usr/bin:/sbin:/bin dpkg-buildpackage -us -uc -b --no-sign \
   >"$work/build.log" 2>&1) \
  || { tail -40 "$work/build.log" >&2; exit 1; }
mkdir -p dist
# Renamed into place: a test run building beside another never reads half a file.
for f in "$work"/spark-guard_*_all.deb; do
  cp "$f" "dist/.$(basename "$f").$$" && mv -f "dist/.$(basename "$f").$$" "dist/$(basename "$f")"
done
ls dist/spark-guard_*_all.deb
