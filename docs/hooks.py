"""MkDocs hooks of nmtflow's documentation site (``hooks:`` in mkdocs.yml).

The site is laid out as the repository is: ``README.md`` is the home page, the pages under ``docs/`` keep their
``docs/...`` paths and ``benchmarks/README.md`` is included where it lies. A relative link therefore names the
same page on the site as in the repository (and on a code host). Headings get the anchors a code host such as
GitHub gives them, so ``PAGE.md#anchor`` links work in both places too.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

#: pages outside ``docs_dir`` that the site includes, at their paths in the repository
OUTSIDE_DOCS_DIR = ("README.md", "benchmarks/README.md")


def github_slug(text: str, separator: str = "-") -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation and symbols dropped, every space a hyphen
    (runs of hyphens are kept, unlike Python-Markdown's default)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", separator)


def on_config(config: Any) -> Any:
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files: Files, config: Any) -> Files:
    root = Path(config.config_file_path).resolve().parent
    docs_dir = Path(config.docs_dir).resolve()
    prefix = docs_dir.relative_to(root).as_posix()
    laid_out = []
    for file in files:
        if file.src_dir and Path(file.src_dir).resolve() == docs_dir:  # a page or image of docs/: its repository path
            if not file.inclusion.is_included():
                continue
            file = File(f"{prefix}/{file.src_uri}", str(root), config.site_dir, config.use_directory_urls)
        laid_out.append(file)  # the theme's own files as they are
    for path in OUTSIDE_DOCS_DIR:
        laid_out.append(File(path, str(root), config.site_dir, config.use_directory_urls))
    return Files(laid_out)
