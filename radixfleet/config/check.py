"""``radixfleet check-config FILE``: the file validated as the router starts with it
(its tokenizers loaded, its event binds tried, its tracing exporter found); exit 0
with a one-line summary and any warnings on stderr, or 2 with every error.
"""

from __future__ import annotations

import argparse
import sys

from radixfleet.config.document import config_warnings
from radixfleet.config.runtime import check_event_binds, load_model_keyers
from radixfleet.config.yaml_loader import load_config


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="router YAML file to validate")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)  # ConfigError -> the CLI prints one line, exit 2
    load_model_keyers(cfg)  # as the router does at start: every models: tokenizer loads
    check_event_binds(cfg)
    if cfg.tracing.enabled:  # as the router does at start: the extra and its exporter
        from radixfleet.common.tracing import exporter_class

        exporter_class(cfg.tracing.protocol)
    for w in config_warnings(cfg):
        print(f"warning: {args.file}: {w}", file=sys.stderr)
    print(f"OK: {args.file}: {cfg.summary()}")
    return 0
