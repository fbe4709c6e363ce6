"""Plain text from documentation sources: HTML (standard library ``html.parser``), POD, reST, Markdown.

Each converter returns a :class:`Text`: the text and how many of its characters are code (verbatim /
preformatted blocks), so a corpus can report and bound its code share. The rules, shared by every
format: paragraphs are separated by one blank line, runs of blank lines collapse, trailing spaces are
stripped; code blocks are kept verbatim (indentation included).

* **HTML** (:func:`html_to_text`): only the text inside the first element matching ``root`` (a
  selector ``tag``, ``.class``, ``#id`` or ``tag.class`` / ``tag#id``; ``""`` = the whole document),
  minus every element matching one of ``skip`` (navigation, sidebars, "¶" anchors); ``script``,
  ``style``, ``nav``, ``header``, ``footer`` and ``head`` are always skipped. Block elements end a
  paragraph, list items and table rows a line; ``<pre>`` is code. A page without its root gives "".
* **POD** (:func:`pod_to_text`): ``=head``/``=item`` become lines, ``=begin``..``=end`` regions and
  other commands are dropped, formatting codes (``B<..>``, ``C<< .. >>``, ``L<text|link>``,
  ``E<gt>``, ``X<..>``) are resolved; indented (verbatim) paragraphs are code.
* **reST** (:func:`rst_to_text`): comments and the directives that only make sense to Sphinx
  (``toctree``, ``kernel-doc``, ``include``, ``image``, ``only``, labels, substitutions) are dropped with
  their indented bodies, section adornment lines are dropped; literal blocks (``::`` and
  ``code-block``/``code``/``literalinclude`` bodies) are code.
* **Markdown** (:func:`markdown_to_text`): HTML comments dropped, ``[text](url)`` becomes ``text``,
  link reference definitions dropped; fenced and indented blocks are code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser

_WS = re.compile(r"\s+")
_BLANKS = re.compile(r"\n{3,}")
ALWAYS_SKIP = frozenset({"script", "style", "nav", "header", "footer", "head", "noscript", "svg", "button",
                         "form", "select", "template"})
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
                  "wbr"})
PARAGRAPH = frozenset({"p", "div", "section", "article", "main", "h1", "h2", "h3", "h4", "h5", "h6", "table",
                       "ul", "ol", "dl", "blockquote", "pre", "hr", "figure", "aside", "center", "body", "html"})
LINE = frozenset({"li", "tr", "dt", "dd", "br", "caption", "figcaption", "summary", "details", "title"})
CELL = frozenset({"td", "th"})


@dataclass(frozen=True)
class Text:
    """Converted text, how many of its characters are code (verbatim blocks kept) and how many code
    characters were dropped (blocks longer than ``max_code_lines``)."""

    text: str
    code_chars: int = 0
    dropped_code_chars: int = 0


def _finish(parts: list[tuple[str, bool]], max_code_lines: int | None = None) -> Text:
    """Join ``(block, is_code)`` paragraphs with blank lines; code blocks keep their lines, and those of
    more than ``max_code_lines`` lines (None: no limit) are dropped."""
    out, code, dropped = [], 0, 0
    for block, is_code in parts:
        if is_code:
            lines = [ln.rstrip() for ln in block.expandtabs(8).split("\n")]
            while lines and not lines[0].strip():
                lines.pop(0)
            while lines and not lines[-1].strip():
                lines.pop()
            block = "\n".join(lines)
            if max_code_lines is not None and len(lines) > max_code_lines:
                dropped += len(block)
                continue
        else:
            block = "\n".join(ln.strip() for ln in block.split("\n") if ln.strip())
        if block:
            out.append(block)
            code += len(block) if is_code else 0
    text = _BLANKS.sub("\n\n", "\n\n".join(out)).strip()
    return Text(text, min(code, len(text)), dropped)


@dataclass(frozen=True)
class Selector:
    """``tag``, ``.class``, ``#id``, ``tag.class`` or ``tag#id``."""

    tag: str = ""
    cls: str = ""
    id: str = ""

    @classmethod
    def parse(cls, spec: str) -> Selector:
        m = re.fullmatch(r"([a-z0-9]*)(?:\.([\w-]+)|#([\w-]+))?", spec)
        if not m or not spec:
            raise ValueError(f"HTML selector {spec!r}: expected tag, .class, #id, tag.class or tag#id")
        return cls(m.group(1) or "", m.group(2) or "", m.group(3) or "")

    def matches(self, tag: str, attrs: dict[str, str]) -> bool:
        return ((not self.tag or tag == self.tag) and (not self.cls or self.cls in attrs.get("class", "").split())
                and (not self.id or attrs.get("id") == self.id))


class _Extractor(HTMLParser):
    """One pass over a page: a stack of open elements with (inside root, skipped, preformatted) flags."""

    def __init__(self, root: Selector | None, skip: tuple[Selector, ...]) -> None:
        super().__init__(convert_charrefs=True)
        self.root, self.skip = root, skip
        self.stack: list[tuple[str, bool, bool, bool]] = []  # tag, in_root, skipped, pre
        self.root_done = False
        self.parts: list[tuple[str, bool]] = []
        self.line: list[str] = []  # the current paragraph's pieces
        self.pre: list[str] | None = None

    def _state(self) -> tuple[bool, bool, bool]:
        if not self.stack:
            return self.root is None, False, False
        return self.stack[-1][1:]

    def _break(self, paragraph: bool) -> None:
        if self.pre is not None:
            return
        text = "".join(self.line)
        if paragraph:
            if text.strip():
                self.parts.append((text, False))
            self.line = []
        elif text and not text.endswith("\n"):
            self.line.append("\n")

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attrs_list}
        in_root, skipped, pre = self._state()
        if not in_root and not self.root_done and self.root is not None and self.root.matches(tag, attrs):
            in_root = True
        skipped = skipped or tag in ALWAYS_SKIP or any(s.matches(tag, attrs) for s in self.skip)
        if in_root and not skipped:
            if tag == "pre" and self.pre is None:
                self._break(True)
                self.pre, pre = [], True
            elif tag in PARAGRAPH:
                self._break(True)
            elif tag in LINE:
                self._break(False)
            elif tag in CELL:
                self.line.append(" ")
            if tag == "li" and self.pre is None:
                self.line.append("- ")
        if tag not in VOID:
            self.stack.append((tag, in_root, skipped, pre))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        idx = next((i for i in range(len(self.stack) - 1, -1, -1) if self.stack[i][0] == tag), None)
        if idx is None:
            return
        while len(self.stack) > idx:
            closed, in_root, skipped, pre = self.stack.pop()
            parent_in_root = self.stack[-1][1] if self.stack else self.root is None
            if in_root and not parent_in_root:
                self.root_done = True
            if not in_root or skipped:
                continue
            if closed == "pre" and self.pre is not None and not (self.stack and self.stack[-1][3]):
                self.parts.append(("".join(self.pre), True))
                self.pre = None
            elif closed in PARAGRAPH:
                self._break(True)
            elif closed in LINE:
                self._break(False)

    def handle_data(self, data: str) -> None:
        in_root, skipped, _ = self._state()
        if not in_root or skipped:
            return
        if self.pre is not None:
            self.pre.append(data)
        else:
            self.line.append(_WS.sub(" ", data))

    def result(self, max_code_lines: int | None = None) -> Text:
        if self.pre is not None:
            self.parts.append(("".join(self.pre), True))
            self.pre = None
        self._break(True)
        return _finish(self.parts, max_code_lines)


def _precut(html: str, root: Selector) -> str:
    """``html`` from the first tag that looks like ``root`` (a cheap search: pages whose navigation
    precedes the content parse several times faster); the parser still checks the match."""
    if not (root.cls or root.id):
        return html
    attr = (rf"\bid=[\"']?{re.escape(root.id)}\b" if root.id
            else rf"\bclass=[\"']?(?:[^\"'>]*\s)?{re.escape(root.cls)}[\s\"'>]")
    m = re.search(rf"<{re.escape(root.tag) if root.tag else '[a-zA-Z][a-zA-Z0-9]*'}\b[^>]*{attr}", html)
    return html[m.start():] if m else html


def html_to_text(html: str, root: str = "", skip: tuple[str, ...] = (), max_code_lines: int | None = None) -> Text:
    """Text of the ``root`` element of ``html`` without the ``skip`` elements (see the module docstring)."""
    sel = Selector.parse(root) if root else None
    parser = _Extractor(sel, tuple(Selector.parse(s) for s in skip))
    parser.feed(_precut(html, sel) if sel is not None else html)
    parser.close()
    return parser.result(max_code_lines)


# ---- POD -----------------------------------------------------------------------------------------------
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'",
                 "nbsp": " ", "copy": "©", "eacute": "é", "auml": "ä", "ouml": "ö", "uuml": "ü"}
_POD_MULTI = re.compile(r"([A-Z])(<{2,})\s+(.*?)\s+(>{2,})", re.S)
_POD_SIMPLE = re.compile(r"([A-Z])<([^<>]*)>")


def _pod_code(letter: str, body: str) -> str:
    if letter in "XZ":
        return ""
    if letter == "E":
        if body.isdigit():
            return chr(int(body)) if int(body) < 0x110000 else ""
        if body.lower().startswith("0x"):
            try:
                return chr(int(body, 16))
            except ValueError:
                return ""
        return _POD_ENTITIES.get(body, body)
    if letter == "L":
        if "|" in body:
            return body.split("|", 1)[0]
        if "/" in body and not re.match(r"\w+://", body):
            name, sec = body.split("/", 1)
            sec = sec.strip('"')
            return f"{sec} in {name}" if name else sec
        return body
    return body


def pod_inline(text: str) -> str:
    """Resolve POD formatting codes (nested ones from the inside out)."""
    for _ in range(32):  # bounded: each pass removes at least one code or stops
        new = _POD_MULTI.sub(lambda m: m.group(0) if len(m.group(2)) != len(m.group(4))
                             else _pod_code(m.group(1), m.group(3)), text)
        new = _POD_SIMPLE.sub(lambda m: _pod_code(m.group(1), m.group(2)), new)
        if new == text:
            break
        text = new
    return text


def pod_to_text(pod: str, max_code_lines: int | None = None) -> Text:
    """Plain text of a POD document (see the module docstring)."""
    parts: list[tuple[str, bool]] = []
    in_pod, region = False, 0
    for para in re.split(r"\n[ \t]*\n", pod.replace("\r\n", "\n")):
        if not para.strip():
            continue
        if para.startswith("="):
            cmd, _, rest = para[1:].partition(" ")
            cmd = cmd.split("\n", 1)[0]
            in_pod = cmd != "cut"
            if cmd == "begin":
                region += 1
            elif cmd == "end":
                region = max(0, region - 1)
            elif region == 0 and (cmd.startswith("head") or cmd == "item"):
                line = _WS.sub(" ", pod_inline(rest)).strip()
                if cmd == "item" and line in ("*", "-", "o") or not line:
                    continue
                if cmd == "item":
                    line = "- " + re.sub(r"^[*o-]\s+", "", line)
                parts.append((line, False))
            continue
        if not in_pod or region:
            continue
        if para[0] in " \t":
            parts.append((para, True))
        else:
            parts.append((_WS.sub(" ", pod_inline(para)), False))
    return _finish(parts, max_code_lines)


# ---- reST ----------------------------------------------------------------------------------------------
_RST_DROP = re.compile(r"^\.\. +(toctree|kernel-doc|kernel-abi|kernel-feat|kernel-include|include|image|figure|"
                       r"only|raw|index|contents|highlight|tabularcolumns|cssclass|c:namespace.*|"
                       r"default-domain|currentmodule|module|program|automodule|autoclass|autofunction|"
                       r"literalinclude|csv-table|list-table|meta|sectionauthor|moduleauthor)::")
_RST_CODE = re.compile(r"^\.\. +(code-block|code|sourcecode|parsed-literal)::")
_RST_DIRECTIVE = re.compile(r"^\.\. +[\w:-]+::")
_RST_OPTION = re.compile(r"^\s+:[\w -]+:( |$)")
_RST_ADORNMENT = re.compile(r"^([=\-~`#*^\"'+_.:<>])\1{2,}\s*$")


def _indented_block(lines: list[str], i: int) -> int:
    """Index after the indented (or blank) lines that follow line ``i``."""
    j = i + 1
    while j < len(lines) and (not lines[j].strip() or lines[j][:1] in " \t"):
        j += 1
    while j > i + 1 and not lines[j - 1].strip():
        j -= 1
    return j


def rst_to_text(rst: str, max_code_lines: int | None = None) -> Text:
    """Plain text of a reST source (see the module docstring)."""
    return _finish(_rst_parts(rst.replace("\r\n", "\n").split("\n"), 0), max_code_lines)


def _rst_parts(lines: list[str], depth: int) -> list[tuple[str, bool]]:
    parts: list[tuple[str, bool]] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            parts.append(("\n".join(para), False))
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            flush()
            i += 1
            continue
        if _RST_ADORNMENT.match(stripped) and line[:1] not in " \t":
            i += 1
            continue
        if line.startswith(".. "):
            flush()
            end = _indented_block(lines, i)
            body = [ln for ln in lines[i + 1:end] if not _RST_OPTION.match(ln)]
            if _RST_CODE.match(line):
                parts.append(("\n".join(body), True))
            elif not _RST_DROP.match(line) and _RST_DIRECTIVE.match(line):
                head = line.split("::", 1)[1].strip()  # note, warning, a function's signature...
                parts.extend([(head, False)] if head else [])
                if depth < 8:
                    parts.extend(_rst_parts(_dedent(body), depth + 1))
            i = end  # comments (".. text", ".. _label:", ".. |sub| ...") and Sphinx-only directives: dropped
            continue
        if stripped.endswith("::"):
            kept = line.rstrip()[:-1]
            if kept.strip() and kept.strip() != ":":
                para.append(kept)
            flush()
            end = _indented_block(lines, i)
            parts.append(("\n".join(lines[i + 1:end]), True))
            i = end
            continue
        para.append(line)
        i += 1
    flush()
    return parts


def _dedent(lines: list[str]) -> list[str]:
    widths = [len(ln) - len(ln.lstrip()) for ln in lines if ln.strip()]
    cut = min(widths, default=0)
    return [ln[cut:] for ln in lines]


# ---- Markdown ------------------------------------------------------------------------------------------
_MD_COMMENT = re.compile(r"<!--.*?-->", re.S)
_MD_LINK = re.compile(r"!?\[([^\]\n]*)\]\((?:[^()\s]|\([^()\s]*\))*(?:\s+\"[^\"]*\")?\)")
_MD_REFLINK = re.compile(r"\[([^\]\n]+)\]\[[^\]\n]*\]")
_MD_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s+\S+.*$")


def markdown_to_text(md: str, max_code_lines: int | None = None) -> Text:
    """Plain text of a Markdown source (see the module docstring)."""
    md = _MD_COMMENT.sub("", md.replace("\r\n", "\n"))
    parts: list[tuple[str, bool]] = []
    para: list[str] = []
    fence: list[str] | None = None

    def flush() -> None:
        if para:
            parts.append(("\n".join(para), all(ln.startswith(("    ", "\t")) for ln in para)))
            para.clear()

    for line in md.split("\n"):
        if fence is not None:
            if line.lstrip().startswith(("```", "~~~")):
                parts.append(("\n".join(fence), True))
                fence = None
            else:
                fence.append(line)
            continue
        if line.lstrip().startswith(("```", "~~~")):
            flush()
            fence = []
        elif not line.strip():
            flush()
        elif _MD_DEF.match(line):
            continue
        else:
            para.append(_MD_REFLINK.sub(r"\1", _MD_LINK.sub(r"\1", line)))
    if fence:
        parts.append(("\n".join(fence), True))
    flush()
    return _finish(parts, max_code_lines)
