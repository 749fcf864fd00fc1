"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

- The home page, the benchmarks page and the changelog are made from README.md, benchmarks/README.md and
  CHANGELOG.md, with their links rewritten from the repository's layout to the site's, so each text has one source.
- Links from docs/ pages to ../benchmarks/README.md point at the benchmarks page.
- The API reference (docs/api.md) must list every name in `lit_rlhf.__all__`; a missing one is a warning, which
  `mkdocs build --strict` turns into a failure.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.plugins.lit_rlhf")

# site page -> (source file, [(link target prefix in the source, the same target on the site)])
GENERATED = {
    "index.md": (
        "README.md",
        [
            ("docs/", ""),
            ("benchmarks/README.md", "benchmarks.md"),
            ("CHANGELOG.md", "changelog.md"),
            ("LICENSE", "https://www.apache.org/licenses/LICENSE-2.0"),
        ],
    ),
    "benchmarks.md": ("benchmarks/README.md", [("../docs/", "")]),
    "changelog.md": ("CHANGELOG.md", [("docs/", ""), ("benchmarks/README.md", "benchmarks.md")]),
}
DOCS_LINKS = [("../benchmarks/README.md", "benchmarks.md")]


def rewrite_links(markdown: str, prefixes: list[tuple[str, str]]) -> str:
    """`markdown` with every inline link or image target that starts with a source prefix given the site's."""
    for source, site in prefixes:
        markdown = re.sub(r"\]\(" + re.escape(source), lambda _, site=site: "](" + site, markdown)
    return markdown


def public_names() -> list[str]:
    """The names in `lit_rlhf.__all__`, read from the package's `__init__.py` without importing it."""
    tree = ast.parse((ROOT / "lit_rlhf" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]  # type: ignore[attr-defined]
    raise ValueError("lit_rlhf/__init__.py has no __all__")


def on_files(files: Files, config: Any) -> Files:
    """Add the pages made from the repository's top-level Markdown files."""
    for page, (source, prefixes) in GENERATED.items():
        text = rewrite_links((ROOT / source).read_text(encoding="utf-8"), prefixes)
        files.append(File.generated(config, page, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point the docs pages' links to the benchmarks README at the benchmarks page."""
    return rewrite_links(markdown, DOCS_LINKS)


def on_pre_build(config: Any) -> None:
    """Warn (an error under --strict) when the API reference leaves out a name of `lit_rlhf.__all__`."""
    listed = set(re.findall(r"^::: lit_rlhf\.(\w+)$", (ROOT / "docs" / "api.md").read_text(encoding="utf-8"), re.M))
    missing = [name for name in public_names() if name not in listed]
    if missing:
        log.warning("docs/api.md does not list %s from lit_rlhf.__all__; add a '::: lit_rlhf.<name>' line", missing)
