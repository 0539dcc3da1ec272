"""A page of the documentation site rendered in headless Chromium looks like a page: the theme's
layout is there and every figure it shows exists. Skipped where mkdocs or Chromium is missing
(CI builds the site with `mkdocs build --strict`; this check needs a browser)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import check_docs_render as render  # noqa: E402

CHROMIUM = render.find_chromium(None)
pytestmark = pytest.mark.skipif(CHROMIUM is None or importlib.util.find_spec("mkdocs") is None,
                                reason="needs the docs extra (mkdocs) and a Chromium")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    built = tmp_path_factory.mktemp("docs") / "site"
    render.build(built)
    return built


def test_a_built_page_shows_the_theme_and_its_figures(site, tmp_path):
    assert render.check_page("ablation", site, CHROMIUM, tmp_path) == []


def test_a_page_without_its_stylesheet_or_a_figure_is_caught(site, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    shutil.rmtree(broken / "assets" / "stylesheets")
    figure = next((broken / "ablation").rglob("*.png"), None) or next(broken.rglob("ablation/*.png"))
    figure.unlink()
    problems = render.check_page("ablation", broken, CHROMIUM, tmp_path)
    assert any("header bar" in p for p in problems) and any("missing image" in p for p in problems), problems
