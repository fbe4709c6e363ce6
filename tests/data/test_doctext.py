"""The documentation converters of mhmoe.data.doctext: HTML, POD, reST, Markdown."""

import pytest

from mhmoe.data.doctext import Selector, html_to_text, markdown_to_text, pod_to_text, rst_to_text

PAGE = """<html><head><title>T</title><style>p {color: red}</style></head><body>
<div class="nav">Home | Next</div>
<div id="content" class="body main">
  <h1>Title<a class="headerlink" href="#t">¶</a></h1>
  <p>First   paragraph
     spans lines &amp; has an entity.</p>
  <ul><li>one</li><li>two</li></ul>
  <pre>
def f():
    return 1
</pre>
  <pre>1
2
3
4</pre>
  <table><tr><td>a</td><td>b</td></tr></table>
  <script>var x = "<p>not text</p>";</script>
</div>
<div class="footer">Copyright</div>
</body></html>"""


def test_html_root_skip_and_code():
    t = html_to_text(PAGE, "div#content", (".headerlink",))
    assert t.text.split("\n\n")[:2] == ["Title", "First paragraph spans lines & has an entity."]
    assert "- one\n- two" in t.text
    assert "def f():\n    return 1" in t.text  # indentation kept inside <pre>
    assert "Home" not in t.text and "Copyright" not in t.text and "not text" not in t.text and "¶" not in t.text
    assert t.code_chars == len("def f():\n    return 1") + len("1\n2\n3\n4")
    short = html_to_text(PAGE, ".main", (".headerlink",), max_code_lines=3)  # the 4-line block is dropped
    assert "def f()" in short.text and "1\n2\n3\n4" not in short.text and short.dropped_code_chars == 7
    assert html_to_text(PAGE, "div#missing").text == ""  # no content element: nothing
    assert "Home" in html_to_text(PAGE).text  # no root: the whole page (less script/style/head)


def test_html_unclosed_and_nested_tags():
    t = html_to_text("<body><main><p>a<p>b<div><p>c</main><p>after</body>", "main")
    assert t.text == "a\n\nb\n\nc"


@pytest.mark.parametrize("bad", ["", "div.", "#", "a b", "div#x.y"])
def test_selector_rejects(bad):
    with pytest.raises(ValueError):
        Selector.parse(bad)


def test_pod():
    pod = """=head1 NAME

perlx - B<bold> and C<< $a->[0] >> with L<perlfunc/"open"> and L<text|perlop>

=cut

code that is not pod

=pod

=over 4

=item * First E<lt>itemE<gt>

Body X<index entry>text.

    my $x = 1;

=back

=begin html

<p>raw html</p>

=end html

Done."""
    t = pod_to_text(pod)
    lines = t.text.split("\n\n")
    assert lines[0] == "NAME"
    assert lines[1] == 'perlx - bold and $a->[0] with open in perlfunc and text'
    assert "- First <item>" in lines and "Body text." in lines and "    my $x = 1;" in lines
    assert "not pod" not in t.text and "raw html" not in t.text and lines[-1] == "Done."
    assert t.code_chars == len("    my $x = 1;")


def test_rst():
    rst = """.. SPDX-License-Identifier: GPL-2.0

.. _label:

=====
Title
=====

Some *text* here::

    code block
      indented

.. toctree::
   :maxdepth: 2

   intro

.. note::
   A note body.

.. code-block:: c
   :linenos:

   int x;

.. kernel-doc:: include/linux/x.h
   :internal:

Last line."""
    t = rst_to_text(rst)
    assert t.text.split("\n\n") == ["Title", "Some *text* here:", "    code block\n      indented",
                                    "A note body.", "   int x;", "Last line."]
    assert "SPDX" not in t.text and "intro" not in t.text and "kernel-doc" not in t.text
    assert t.code_chars == len("    code block\n      indented") + len("   int x;")


def test_markdown():
    md = """# Title

<!-- YAML
added: v0.1
-->

See [the docs](https://x.org/a_(b)) and [ref][1].

```js
const a = 1;
```

[1]: https://example.org
"""
    t = markdown_to_text(md)
    assert t.text == "# Title\n\nSee the docs and ref.\n\nconst a = 1;"
    assert t.code_chars == len("const a = 1;")
    assert markdown_to_text("```\na\nb\nc\n```", max_code_lines=2).text == ""
