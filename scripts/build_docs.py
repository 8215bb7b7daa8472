#!/usr/bin/env python3
"""Build the HTML documentation: the pages of docs/ and the README, and the API reference (pdoc).

    python scripts/build_docs.py [OUT]      (default build/docs; needs the [docs] extra: pdoc)

Every warning is an error (a module that fails to import, a broken docstring); a relative link
between the pages that points nowhere is an error too.
"""

from __future__ import annotations

import html
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{max-width:60rem;margin:2rem auto;font-family:sans-serif;line-height:1.45}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:.2rem .4rem;vertical-align:top}}
pre{{background:#f6f6f6;padding:.6rem;overflow-x:auto}}code{{background:#f6f6f6}}</style></head>
<body><nav>{nav}</nav><hr>{body}</body></html>
"""


def _pages() -> dict[str, Path]:
    """Output name -> markdown source: the README as the index, then docs/*.md."""
    pages = {"index.html": ROOT / "README.md"}
    for path in sorted((ROOT / "docs").glob("*.md")):
        pages[path.stem + ".html"] = path
    return pages


def _render(text: str) -> str:
    import markdown2  # noqa: PLC0415 - pdoc's own dependency

    body = markdown2.markdown(text, extras=["fenced-code-blocks", "tables", "header-ids", "code-friendly"])
    # Links between pages: docs/x.md -> x.html; README -> index.html.
    body = re.sub(r'href="(?:\.\./)?(?:docs/)?([\w-]+)\.md(#[^"]*)?"',
                  lambda m: f'href="{"index" if m.group(1) == "README" else m.group(1)}.html{m.group(2) or ""}"', body)
    return body


def build(out: Path) -> list[Path]:
    """Write the site into ``out``; the files written."""
    import pdoc  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    pages = _pages()
    nav = " | ".join(f'<a href="{name}">{html.escape(src.stem)}</a>' for name, src in pages.items())
    nav += ' | <a href="api/mpistrat.html">API reference</a>'
    written = []
    for name, src in pages.items():
        text = src.read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip() if text else src.stem
        (out / name).write_text(PAGE.format(title=html.escape(title), nav=nav, body=_render(text)), encoding="utf-8")
        written.append(out / name)
    pdoc.render.configure(docformat="restructuredtext", footer_text="mpistrat")
    pdoc.pdoc("mpistrat", output_directory=out / "api")
    written += sorted((out / "api").rglob("*.html"))
    broken = []
    for page in written:
        for target in re.findall(r'href="([^"#:?$]+)(?:#[^"]*)?"', page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(out)} -> {target}")
    if broken:
        raise SystemExit("broken links:\n  " + "\n  ".join(broken))
    return written


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "build" / "docs"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = build(out)
    print(f"{len(files)} pages in {out} (open {out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
