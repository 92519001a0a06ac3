"""Every results page opens with a figure of its main finding, drawn from the page's own tables.

``tools/results_plots.py`` draws ``docs/figures/results-<page>.png`` from the Markdown tables of
``docs/results/<page>.md``; these tests redraw every figure into a temporary folder (so a page that loses
or reshapes a table the figure reads fails here) and check that each page embeds its committed figure
with a caption.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _results_plots():
    spec = importlib.util.spec_from_file_location("results_plots", ROOT / "tools" / "results_plots.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _results_pages() -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return sorted(set(re.findall(r"results/([\w-]+)\.md", str(nav))))


def test_every_results_page_but_the_index_has_a_figure_function():
    pages = _results_pages()
    assert len(pages) == 18  # the index and 17 results pages
    assert set(_results_plots().FIGURES_OF) == set(pages) - {"index"}


@pytest.mark.parametrize("page", _results_pages())
def test_each_results_page_embeds_its_committed_figure_with_a_caption(page):
    text = (DOCS / "results" / f"{page}.md").read_text()
    figure = re.search(r'<figure markdown="span">\n(.*?)</figure>', text, flags=re.S)
    assert figure, f"docs/results/{page}.md has no figure"
    image = re.search(r"\(\.\./figures/(results-[\w-]+\.png)\)", figure.group(1))
    assert image, figure.group(1)
    png = DOCS / "figures" / image.group(1)
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert png.stat().st_size < 150_000, f"{png.name} is {png.stat().st_size} bytes; keep figures under 150 kB"
    caption = re.search(r"<figcaption[^>]*>(.*?)</figcaption>", figure.group(1), flags=re.S)
    assert caption and len(caption.group(1).split()) >= 10, "a figure needs a caption saying what it shows"


def test_every_figure_is_drawn_from_its_pages_tables(tmp_path, monkeypatch):
    module = _results_plots()
    monkeypatch.setattr(module, "FIGURES", tmp_path)
    for page, draw in module.FIGURES_OF.items():
        path = draw()
        assert path == tmp_path / f"results-{page}.png" and path.stat().st_size > 5_000, page


def test_a_page_without_its_table_fails_with_one_line_naming_it(tmp_path, monkeypatch):
    module = _results_plots()
    (tmp_path / "fedcams.md").write_text("# FedCAMS\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    with pytest.raises(LookupError, match=r"docs/results/fedcams\.md has no table with the columns partition"):
        module.fedcams()


def test_cells_are_read_as_numbers():
    module = _results_plots()
    assert module.mean_sd("**0.892 ± 0.004**") == (0.892, 0.004)
    assert module.mean_sd("0.4655 ± 0.1103 (best 0.7603 ± 0.0146)") == (0.4655, 0.1103)
    assert module.mean_sd("0.7276") == (0.7276, 0.0)
    assert module.value("23,775,600") == 23775600.0
    assert module.value("1,777 MB") == 1777.0
    with pytest.raises(ValueError, match="no number"):
        module.value("-")
