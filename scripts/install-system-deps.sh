#!/usr/bin/env bash
# Optional Debian packages that ship corpora and image sets mhmoe reads (nothing is downloaded at run time):
#   python3.11-doc          the pydocs validation set (the Python documentation's reST sources)
#   wordnet-base            the WordNet validation set
#   manpages-* and mandoc   the man-page corpora (man-<lang>, manpages) of the multilingual settings
#   fonts-noto-color-emoji  the emoji image set of the masked multi-modal data
#   CORPUS_PKGS             the debdocs training corpus (38 documentation packages, ~400 MB to download,
#                           ~2.8 GB installed; minutes to install, so `make test` (SYSTEM_DEPS=test) leaves
#                           them out and the tests that need the real corpus skip)
# Without them everything else works: those validation sets are skipped with a one-line warning, and the
# corpora that need them raise an error naming the install command.
#
# This script says what it installs and why, then runs apt-get with its normal output (download and setup
# progress). It never fails the make target that calls it: where apt-get is missing, or it is not run as
# root, or the installation fails, it prints one line and exits 0. SYSTEM_DEPS=no (make ... SYSTEM_DEPS=no)
# skips it; SYSTEM_DEPS=check only reports what is missing; SYSTEM_DEPS=test installs everything but the
# debdocs corpus packages.
set -u
root="${SYSTEM_DEPS_ROOT:-}"  # tests: look for the packages' files under this directory instead of /
MAN_PKGS="manpages manpages-dev manpages-de manpages-de-dev manpages-fr manpages-fr-dev manpages-es manpages-es-dev
  manpages-it manpages-it-dev manpages-pt-br manpages-pt-br-dev manpages-nl manpages-nl-dev manpages-pl manpages-pl-dev
  manpages-cs manpages-cs-dev manpages-ru manpages-ru-dev manpages-uk manpages-uk-dev manpages-ja manpages-ja-dev
  manpages-zh mandoc"
# the debdocs corpus: the same list as mhmoe.data.debdocs.PACKAGES (tests/test_system_deps.py checks)
CORPUS_PKGS="linux-doc-6.1 perl-doc vim-runtime llvm-14-doc clang-14-doc cmake-doc python-sqlalchemy-doc sphinx-doc
  debian-policy ghc-doc nodejs-doc postgresql-doc-15 git-doc python-django-doc rust-doc qtbase5-doc-html sqlite3-doc
  erlang-doc racket-doc lilypond-doc-html libreoffice-help-en-us maxima-doc octave-doc apache2-doc gimp-help-en
  zsh-doc postfix-doc bind9-doc wireshark-doc debian-handbook debian-reference-en developers-reference abs-guide
  debian-edu-doc-en kicad-doc-en openjdk-17-doc cppreference-doc-en-html ada-reference-manual-2012"
mode="${SYSTEM_DEPS:-yes}"
[ "$mode" = no ] && exit 0

missing="" why=""
add() { missing="$missing $1"; case "$why" in *"$2"*) ;; *) why="${why:+$why, }$2" ;; esac; }
[ -d "$root/usr/share/doc/python3.11/html/_sources" ] || add python3.11-doc "pydocs validation set"
[ -f "$root/usr/share/wordnet/data.noun" ] || add wordnet-base "WordNet validation set"
for p in $MAN_PKGS; do
  [ -f "$root/var/lib/dpkg/info/$p.list" ] || add "$p" "man-page corpora"
done
[ -f "$root/var/lib/dpkg/info/fonts-noto-color-emoji.list" ] || add fonts-noto-color-emoji "emoji image set"
if [ "$mode" != test ]; then
  for p in $CORPUS_PKGS; do
    [ -f "$root/var/lib/dpkg/info/$p.list" ] || add "$p" "debdocs training corpus"
  done
fi
[ -z "$missing" ] && exit 0
count=$(echo $missing | wc -w)

note() { echo "mhmoe: note: $1" >&2; }
skipped="without them the $why are skipped (one warning line each); to install them later: make system-deps"
if [ "$mode" = check ]; then
  note "$count optional Debian packages are missing ($why):$missing"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  note "no apt-get on this system: $count optional Debian packages not installed; $skipped"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  note "not root: $count optional Debian packages not installed (as root: apt-get install$missing); $skipped"
  exit 0
fi
echo "mhmoe: installing $count Debian packages with apt-get for the $why (skip with SYSTEM_DEPS=no):" >&2
echo " $missing" | fold -s -w 110 >&2
export DEBIAN_FRONTEND=noninteractive
# do not rebuild man-db's index for ~10,000 new pages (slow; `man -k` is not used here)
echo "man-db man-db/auto-update boolean false" | debconf-set-selections 2>/dev/null || true
install() { apt-get install -y -q --no-install-recommends $missing; }
if install || { echo "mhmoe: apt-get update, then installing again" >&2 && apt-get update -q && install; }; then
  echo "mhmoe: installed the $count packages" >&2
else
  note "apt-get could not install the packages above; $skipped"
fi
exit 0
