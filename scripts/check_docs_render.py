"""Render pages of the documentation site in headless Chromium and check what a reader would see.

`mkdocs build --strict` catches broken links and anchors; it cannot see a page whose stylesheet
did not load (the theme's layout gone) or whose figure is missing. This builds the site (or takes
a built one), then for each page: every image the HTML names exists in the site, and a screenshot
taken by Chromium shows the theme (its header bar's colour across the top) and a page that is not
blank. Screenshots are kept with ``--out``.

    python scripts/check_docs_render.py                          # build, check the default pages
    python scripts/check_docs_render.py --site site --out shots  # a built site; keep the screenshots
    python scripts/check_docs_render.py --pages ablation privacy

Needs the `docs` extra (mkdocs) and a Chromium (`apt install chromium`; `--chromium PATH`).
"""

from __future__ import annotations

import argparse
import html.parser
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAGES = ["index", "wrapping", "ablation", "privacy"]
#: The Material theme's default primary colour (indigo): its header bar.
HEADER_RGB = np.array([63, 81, 181])


class _Images(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.sources += [value for name, value in attrs if name == "src" and value]


def find_chromium(given: str | None) -> str | None:
    return given or next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def build(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                   check=True, capture_output=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})


def missing_images(page: Path, site: Path) -> list[str]:
    parser = _Images()
    parser.feed(page.read_text(encoding="utf-8"))
    return [src for src in parser.sources if "://" not in src and not src.startswith("data:")
            and not (page.parent / src.split("#")[0]).resolve().is_file()]


def screenshot(chromium: str, page: Path, out: Path) -> np.ndarray:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,1200", f"--screenshot={out}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    from matplotlib.image import imread

    return (imread(out)[..., :3] * 255).round()


def check_page(name: str, site: Path, chromium: str, out: Path) -> list[str]:
    """What is wrong with page ``name`` as rendered (nothing: an empty list)."""
    page = site / ("index.html" if name == "index" else f"{name}/index.html")
    if not page.exists():
        return [f"no page {page.relative_to(site)}"]
    problems = [f"missing image {src}" for src in missing_images(page, site)]
    pixels = screenshot(chromium, page, out / f"{name}.png")
    header = pixels[:40].reshape(-1, 3)
    if not (np.abs(header - HEADER_RGB).sum(axis=1) < 12).mean() > 0.5:
        problems.append("the theme's header bar is not there (its stylesheet did not load?)")
    if pixels.std() < 10:
        problems.append("the page is blank")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, default=None, help="a built site (default: build one)")
    parser.add_argument("--pages", nargs="+", default=DEFAULT_PAGES,
                        help=f"pages by path without .md (default: {' '.join(DEFAULT_PAGES)})")
    parser.add_argument("--out", type=Path, default=None, help="keep the screenshots here")
    parser.add_argument("--chromium", default=None, help="the browser (default: found on PATH)")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print("no Chromium found: install one (apt install chromium) or give --chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="splitft-docs-") as tmp:
        site = args.site or Path(tmp) / "site"
        if args.site is None:
            build(site)
        out = args.out or Path(tmp) / "shots"
        out.mkdir(parents=True, exist_ok=True)
        failed = 0
        for name in args.pages:
            problems = check_page(name, site, chromium, out)
            failed += bool(problems)
            print(f"{name:12s} {'ok' if not problems else '; '.join(problems)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
