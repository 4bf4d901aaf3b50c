"""mkdocs hook: serve the repository's README.md as the site's front page.

The README links to the topic pages as `docs/<page>.md`, which works on GitHub; on the site
the front page sits beside those pages, so the prefix is dropped there.
"""

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add README.md to the site as index.md."""
    files.append(File.generated(config, "index.md", abs_src_path=str(README)))
    return files


def on_page_markdown(markdown: str, page: Page, **_: object) -> str:
    """Point the front page's `docs/<page>.md` links at the pages beside it."""
    if page.file.src_uri == "index.md":
        return DOCS_LINK.sub("](", markdown)
    return markdown
