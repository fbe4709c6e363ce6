#!/usr/bin/env bash
# Debian packages that ship the cross-domain validation corpora (Python reST docs, WordNet glosses).
# Optional: without them the pydocs/wordnet validation sets are skipped with a warning.
set -u
PKGS="python3.11-doc wordnet-base"
missing=""
[ -d /usr/share/doc/python3.11/html/_sources ] || missing="$missing python3.11-doc"
[ -f /usr/share/wordnet/data.noun ] || missing="$missing wordnet-base"
[ -z "$missing" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "note: install$missing with apt-get (as root) for the pydocs/wordnet validation sets" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1; } \
  || echo "note: apt-get could not install$missing; pydocs/wordnet validation sets will be skipped" >&2
exit 0
