"""The commands, in the order `--help` lists them: name -> (module under specdecode/cli/, one-line help).
Torch-free, so that `specdecode --help` lists them without importing any command (each imports torch)."""

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", 'answer one prompt'),
    "data": ("data", 'build drafter training data with the target model, or export it'),
    "train": ("train", 'train an EAGLE-3 drafter (training-time test, online target)'),
    "train-report": ("train_report", 'acceptance vs training-set size: table and PNG plot'),
    "eval-drafter": ("eval_drafter", 'held-out acceptance: trainer estimate vs engine measurement'),
    "check": ("check", 'greedy losslessness of speculative decoding on real prompts'),
    "sweep": ("sweep", 'grid over num_steps/topk/num_draft_tokens; finds the best configuration'),
    "formats": ("formats", 'weight formats and dtypes: forward cost vs k, perplexity, greedy agreement'),
    "serve": ("serve", 'OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)'),
    "compare": ("compare", 'compare two stored runs: speed ratio with significance, environment diff ranked'),
    "runs": ("runs", 'list the runs in the results store'),
    "comm-bench": ("comm_bench", 'all-reduce time, algbw and busbw over message sizes (like nccl-tests)'),
    "export": ("export", 'write a drafter for SGLang, vLLM, SpecForge or llama.cpp (GGUF), checked against the target'),
    "launch": ("launch", "launch SGLang, vLLM or llama.cpp's llama-server with EAGLE-3 flags, a launch profile "
                         "and a recorded fingerprint"),
    "report": ("report", 'one Markdown or HTML page from stored runs: tables, plots, what changed'),
    "tune": ("tune", 'search a grid of environment variables, each point in a fresh process'),
    "bench": ("bench", 'benchmark decoding methods, interleaved, with a table and JSON'),
    "compile": ("compile", 'compile and store the graphs generate needs on this machine (later starts load them)'),
}
