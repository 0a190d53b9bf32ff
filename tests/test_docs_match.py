"""The docs match the code: every example config is listed where the configuration is documented, every
``ds-profutils`` subcommand has a page that shows how to call it, and every key of a capture's manifest is in
capture.md's table."""
import argparse
import json
import re
from pathlib import Path

import pytest

from ds_profutils.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _subcommands() -> list:
    actions = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return sorted(name for action in actions for name in action.choices)


@pytest.mark.parametrize("config", sorted(path.name for path in (ROOT / "ds_configs").glob("*.json")))
def test_every_example_config_is_listed_in_the_configuration_page(config):
    assert f"| `{config}` |" in (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def test_every_subcommand_has_a_page_showing_how_to_call_it():
    pages = {path.name: path.read_text(encoding="utf-8").splitlines() for path in (ROOT / "docs").glob("*.md")}
    subcommands = _subcommands()
    assert {"check-config", "diff", "report", "timeline"} <= set(subcommands)
    for name in subcommands:
        shown = [page for page, lines in pages.items()
                 if any(line.startswith((f"    ds-profutils {name} ", f"## `ds-profutils {name}")) for line in lines)]
        assert shown, f"no docs page shows how to call ds-profutils {name}"


def test_every_key_a_capture_manifest_has_is_in_the_table_of_capture_md(tmp_path):
    from ds_profutils.engine.capture.decide import Plan
    from ds_profutils.engine.capture.files import write_manifest

    plan = Plan("request", 2, [0, 2], {"0": "asked for", "2": "asked for"}, {}, 40)
    write_manifest(tmp_path, plan, "main", None, done=True, hosts={"0": "node-a", "2": "node-b"})
    written = set(json.loads((tmp_path / "manifest.json").read_text(encoding="utf-8")))
    rows = [line.split("|")[1] for line in (ROOT / "docs" / "capture.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")]
    assert written - set(re.findall(r"`(\w+)`", " ".join(rows))) == set()
