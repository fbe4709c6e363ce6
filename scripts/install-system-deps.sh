#!/usr/bin/env bash
# Debian packages that ship the registry corpora and image sets:
#   pydocs/wordnet validation sets (python3.11-doc, wordnet-base);
#   the multilingual man-page corpora man-<lang>/manpages (manpages-*, rendered by mandoc);
#   the emoji image set of the masked multi-modal data (fonts-noto-color-emoji).
# Optional: without them those corpora raise CorpusUnavailableError with the install command, and
# validation sets that need them are skipped with a warning.
set -u
MAN_PKGS="manpages manpages-dev manpages-de manpages-de-dev manpages-fr manpages-fr-dev manpages-es manpages-es-dev
  manpages-it manpages-it-dev manpages-pt-br manpages-pt-br-dev manpages-nl manpages-nl-dev manpages-pl manpages-pl-dev
  manpages-cs manpages-cs-dev manpages-ru manpages-ru-dev manpages-uk manpages-uk-dev manpages-ja manpages-ja-dev
  manpages-zh mandoc"
missing=""
[ -d /usr/share/doc/python3.11/html/_sources ] || missing="$missing python3.11-doc"
[ -f /usr/share/wordnet/data.noun ] || missing="$missing wordnet-base"
for p in $MAN_PKGS fonts-noto-color-emoji; do
  [ -f "/var/lib/dpkg/info/$p.list" ] || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "note: install$missing with apt-get (as root) for the optional corpora and image sets" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# do not rebuild man-db's index for ~10,000 new pages (slow; `man -k` is not used here)
echo "man-db man-db/auto-update boolean false" | debconf-set-selections 2>/dev/null || true
apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1; } \
  || echo "note: apt-get could not install$missing; the corpora that need them are unavailable" >&2
exit 0
