"""`specdecode export`: write a drafter in SGLang's or vLLM's aux-layer-id convention
(a front end to ``specdecode.integrations.export.export_drafter``)."""

from __future__ import annotations

import argparse

from specdecode.cli.common import add_model_args
from specdecode.integrations.export import ENGINES


def add_parser(sub: argparse._SubParsersAction) -> None:
    about = ("write a drafter for SGLang, vLLM and SpecForge, checked against the target: the aux-layer ids in "
             "both places those engines read them (eagle_config in SGLang's numbering, the top level in vLLM's), "
             "so one file serves every engine")
    p = sub.add_parser("export", help=about, description=about)
    p.add_argument("--format", choices=ENGINES, required=True,
                   help="the engine it is for (the file is the same for both: it carries both engines' lists)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    p.add_argument("--aux-layer-convention", choices=ENGINES, default=None,
                   help="how to read the SOURCE drafter's explicit aux ids when it does not record it")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.integrations.export import export_drafter

    info = export_drafter(args.model, args.drafter, args.format, args.out, args.aux_layer_convention)
    print(f"wrote {info['out']} for {info['format']}: eagle_config ids {info['aux_ids']} (SGLang's numbering) and "
          f"top-level ids {info['taps_entering_layers']} (vLLM's): the hidden states entering target layers "
          f"{info['taps_entering_layers']}")
    return 0
