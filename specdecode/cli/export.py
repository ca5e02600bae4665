"""`specdecode export`: write a drafter in SGLang's or vLLM's aux-layer-id convention
(a front end to ``specdecode.integrations.export.export_drafter``)."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args
from specdecode.integrations.export import ENGINES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a drafter for SGLang or vLLM (their aux-layer-id conventions differ)",
                       description="write a drafter for SGLang or vLLM (their aux-layer-id conventions differ)")
    p.add_argument("--format", choices=ENGINES, required=True, help="engine whose aux-layer-id convention to write")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--aux-layer-convention", choices=ENGINES, default=None,
                   help="how to read the SOURCE drafter's explicit aux ids when it does not record it")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.integrations.export import export_drafter

    info = export_drafter(args.model, args.drafter, args.format, args.out, args.aux_layer_convention)
    print(f"wrote {info['out']} for {info['format']}: eagle_aux_hidden_state_layer_ids {info['aux_ids']} "
          f"(= hidden states entering target layers {info['taps_entering_layers']})")
    return 0
