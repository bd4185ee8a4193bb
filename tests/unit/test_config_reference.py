"""The configuration reference page is generated from the config's code and never drifts."""

from __future__ import annotations

from ext_proc.config import TitoConfig
from ext_proc.tools.config_reference import PAGE, reference


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text() == reference(), "run: tito config-reference --out docs/configuration.md"


def test_every_key_of_every_section_has_a_row_with_its_override() -> None:
    page = reference()
    for name in TitoConfig.model_fields:
        assert f"| `{name}` |" in page and f"`TITO__{name.upper()}`" in page
    assert (
        "| `prefix_cache_max_ids` | `int` | `2000000` | `TITO__RENDER_CONFIG__PREFIX_CACHE_MAX_IDS` | token ids" in page
    )
    assert "## `pools[].instances[]`" in page  # sections inside lists, without per-key overrides
