"""A fake Debian installation for the ``debdocs`` reader: two packages' files and dpkg file lists."""

import random
from pathlib import Path

from mhmoe.data.debdocs import Source

WORDS = ("the kernel reads each page of memory before a driver may write data to the device and every "
         "user should check which option controls how a process handles its signals").split()
BOILERPLATE = "This page is part of the fixture documentation, all rights reserved."
SOURCES = (
    Source("pkga", "rst", r"/_sources/.*\.rst\.txt$", r"/translations/", licence="GPL-2", what="reST"),
    Source("pkgb", "html", r"\.html$", "", "div#content", (".nav",), licence="MIT", what="HTML"),
)


def prose(rng: random.Random, n_paragraphs: int = 4, words: int = 40) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(n_paragraphs)]


def make_install(root: Path, n_rst: int = 24, n_html: int = 8) -> Path:
    """Files under ``root/usr/share/doc`` and ``root/info/<pkg>.list``; returns the info directory."""
    rng = random.Random(0)
    info = root / "info"
    info.mkdir(parents=True)
    a = root / "usr/share/doc/pkga/html/_sources"
    (a / "sub").mkdir(parents=True)
    (a / "translations").mkdir()
    listed = []
    texts = {}
    for i in range(n_rst):
        paras = prose(rng)
        texts[i] = paras
        body = "\n\n".join([f"Chapter {i}\n=========", *paras, BOILERPLATE])
        path = a / ("sub" if i % 2 else "") / f"doc{i:02d}.rst.txt"
        path.write_text(body)
        listed.append(path)
    # a near duplicate of doc00 (one sentence added), a short page, an identifier list, a translation
    (a / "zz-copy.rst.txt").write_text("\n\n".join(["Chapter copy\n====", *texts[0], "One more line."]))
    (a / "zz-short.rst.txt").write_text("Too short.")
    (a / "zz-api.rst.txt").write_text("\n".join(f"__x{i}_ptr->m_{i}[{i}] = 0x{i:04x};" for i in range(60)))
    (a / "translations/doc00.rst.txt").write_text("\n\n".join(texts[1]))
    listed += [a / "zz-copy.rst.txt", a / "zz-short.rst.txt", a / "zz-api.rst.txt", a / "translations/doc00.rst.txt",
               a / "sub", a / "missing.rst.txt"]
    (a / "link.rst.txt").symlink_to(a / "doc00.rst.txt")
    listed.append(a / "link.rst.txt")
    (info / "pkga.list").write_text("".join(f"{p}\n" for p in listed))
    b = root / "usr/share/doc/pkgb/html"
    b.mkdir(parents=True)
    listed = []
    for i in range(n_html):
        paras = "".join(f"<p>{p}</p>" for p in prose(rng))
        page = (f"<html><body><div class='nav'>Home Next Previous</div><div id='content'><h1>Page {i}</h1>{paras}"
                f"<pre>x = {i}</pre></div></body></html>")
        (b / f"page{i}.html").write_text(page)
        listed.append(b / f"page{i}.html")
    (b / "style.css").write_text("p { }")
    listed.append(b / "style.css")
    (info / "pkgb.list").write_text("".join(f"{p}\n" for p in listed))
    return info
