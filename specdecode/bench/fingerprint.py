"""The environment a measurement depends on, captured with every result, and diffs ranked
by how likely each difference is to change speed.

Why: a baseline measured with NCCL tuning variables set and a later run where a restart had
dropped them differed by 1.4x from the environment alone. Every record carries a
fingerprint; ``compare`` and ``bench --baseline-from`` diff them and name the variable.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.io.paths import file_hash
from specdecode.runtime.background import running_build

# Environment variables that change how fast kernels and collectives run.
PERF_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_",
                     "GLOO_", "NVIDIA_", "CUBLAS_", "CUDNN_", "TORCHINDUCTOR_", "SPECDECODE_", "GGML_",
                     "VLLM_", "SGLANG_", "MALLOC_", "ONEDNN_", "DNNL_", "ATEN_")
PERF_ENV_NAMES = ("LD_PRELOAD", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
                  "WORLD_SIZE", "TOKENIZERS_PARALLELISM")
# Names that hold credentials: recorded as present, never by value.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API[_-]?KEY|ACCESS[_-]?KEY|PRIVATE|CREDENTIAL|AUTH|SESSION|COOKIE", re.I)
# Values that look like credentials whatever their name (hf_..., sk-..., long hex/base64 blobs, URLs with a user:pass@).
SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|gho_|github_pat_|xox[abp]-|AKIA)|://[^/\s:@]+:[^/\s@]+@|^[A-Za-z0-9+/_=-]{40,}$")
REDACTED = "<redacted>"

CPU_FLAGS_OF_INTEREST = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
                         "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile",
                         "asimd", "sve", "sve2", "bf16", "i8mm")


def redact(name: str, value: str) -> str:
    if SECRET_NAME.search(name) or SECRET_VALUE.search(value):
        return REDACTED
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with secret values hidden: ``--api-key X``, ``--token=X``, or values that look like keys."""
    out, hide_next = [], False
    for a in argv:
        flag, eq, value = a.partition("=")
        if hide_next:
            out.append(REDACTED)
        elif a.startswith("-") and eq and SECRET_NAME.search(flag):
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(redact("argv", a))
        hide_next = a.startswith("-") and not eq and bool(SECRET_NAME.search(a))
    return out


def filtered_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Performance-relevant environment variables, secrets redacted."""
    environ = dict(os.environ if environ is None else environ)
    return {k: redact(k, v) for k, v in sorted(environ.items())
            if k.startswith(PERF_ENV_PREFIXES) or k in PERF_ENV_NAMES}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set[str]()
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "CPU part") and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except AttributeError:
        affinity = list(range(os.cpu_count() or 1))
    freq = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    return {
        "model": model,
        "flags": sorted(f for f in CPU_FLAGS_OF_INTEREST if f in flags),
        "logical_cores": os.cpu_count(),
        "affinity": _ranges(affinity),
        "affinity_count": len(affinity),
        "governor": _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
        "freq_mhz": round(int(freq) / 1000) if freq and freq.isdigit() else None,
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_gib": _memory_gib(),
    }


def _memory_gib() -> float | None:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (how taskset and numactl write CPU lists)."""
    out, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def _run(cmd: list[str], timeout: float = 10) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def gpu_info() -> dict | None:
    """GPU model, driver, clocks and topology (nvidia-smi), or None without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    query = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                  "power.limit,persistence_mode,compute_mode", "--format=csv,noheader"])
    return {
        "devices": names,
        "count": len(names),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
        "nvidia_smi": query.splitlines() if query else None,
        "topology": _run(["nvidia-smi", "topo", "-m"]),
    }


def git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    commit = _run(["git", "-C", str(here), "rev-parse", "HEAD"])
    if commit and _run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"]):
        commit += "+dirty"
    return commit


def capture(*, threads: int, dtype: str, device: str, model_path=None, drafter_paths=(),
            launch_profile: dict | None = None, argv: list[str] | None = None, tensor_parallel: int = 1,
            weights: str = "native", kernels: dict | None = None, compiled: str | None = None,
            activations: str | None = None, drafter_weights: Sequence[str] = ()) -> dict:
    """Everything a tok/s figure depends on besides the code path chosen by the flags.
    ``tensor_parallel``: the ranks sharing the model (``Session.world_size``); ``weights``: the
    weight format (``core.quant``); ``activations``: how quantized layers quantize activations
    (``core.quant.ACTIVATIONS``); ``kernels``: the linear kernels installed (``core.kernels.KernelPlan``);
    ``drafter_weights``: the drafters' weight formats (``core.quant.DRAFTER_WEIGHT_FORMATS``);
    ``compiled``: whether the target's steps run compiled, and why (``runtime.compiling``; a bench method's
    ``compile=`` is recorded with its rows)."""
    import torch

    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for lib in ("transformers", "numpy", "gguf", "safetensors", "llama_cpp", "openvino", "openvino_genai"):
        mod = sys.modules.get(lib)
        if mod is not None:
            versions[lib] = getattr(mod, "__version__", None)
    fp = {
        "threads": threads,
        "tensor_parallel": tensor_parallel,
        "interop_threads": torch.get_num_interop_threads(),
        "dtype": dtype,
        "weights": weights,
        "activations": activations,
        "kernels": kernels,
        "compiled": compiled,
        "device": device,
        "versions": versions,
        "torch_config": {"mkldnn": torch.backends.mkldnn.is_available(),
                         "openmp": torch.backends.openmp.is_available(),
                         "cpu_capability": _cpu_capability(torch)},
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "env": filtered_env(),
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "git_commit": git_commit(),
        "model": {"path": str(model_path) if model_path else None, "sha256": file_hash(model_path)},
        "drafter": {"path": ",".join(map(str, drafter_paths)) or None,
                    "sha256": ",".join(file_hash(p) or "missing" for p in drafter_paths) or None,
                    "weights": ",".join(drafter_weights) or None},
        "argv": redact_argv(sys.argv if argv is None else argv),
        "graph_build_running": running_build() is not None,  # runtime.background: a build shares the cores
    }
    if launch_profile:
        fp["launch_profile"] = launch_profile
    return fp


def _kernel_choice(kernels: dict | None) -> str | None:
    """The installed kernel plan as one short comparable string: its mode and a digest of its
    choices (None when not recorded)."""
    if not kernels:
        return None
    digest = hashlib.sha256(json.dumps(kernels.get("choices"), sort_keys=True).encode()).hexdigest()[:8]
    return f"{kernels.get('mode')} ({digest})" if kernels.get("choices") else str(kernels.get("mode"))


def _cpu_capability(torch) -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        return None


# ---- diffs -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Difference:
    label: str
    before: object
    after: object
    impact: int  # 3 high, 2 medium, 1 low, 0 informational
    why: str

    def __str__(self) -> str:
        return f"{self.label}: {show_value(self.before)} -> {show_value(self.after)}"


def show_value(v) -> str:
    if v is None:
        return "(unset)"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "(none)"
    return str(v)


IMPACT_NAMES = {3: "high", 2: "medium", 1: "low", 0: "info"}

# Environment variables known to change speed a lot (thread pools, collectives' algorithms).
HIGH_IMPACT_ENV = re.compile(r"^(NCCL_(PROTO|ALGO|P2P_|MAX_NCHANNELS|MIN_NCHANNELS|BUFFSIZE|NTHREADS|NET|IB_|"
                             r"SOCKET_|SHM_|NVLS|CUMEM|COLLNET)|OMP_NUM_THREADS|MKL_NUM_THREADS|OPENBLAS_NUM_THREADS|"
                             r"OPENBLAS_CORETYPE|KMP_AFFINITY|KMP_BLOCKTIME|GOMP_CPU_AFFINITY|OMP_PROC_BIND|OMP_PLACES|"
                             r"LD_PRELOAD|CUDA_VISIBLE_DEVICES|SPECDECODE_THREADS|TORCH_NUM_THREADS|GLOO_)")
INFO_ENV = re.compile(r"^(MASTER_PORT|SPECDECODE_TP_WORKER|SPECDECODE_LAUNCH_PROFILE|SPECDECODE_CACHE|"
                      r"SPECDECODE_RESULTS_DB|SPECDECODE_PROFILE_DIR|"
                      r"NCCL_DEBUG|TORCH_CPP_LOG_LEVEL|TORCH_SHOW_CPP_STACKTRACES)")


def comparable(fp: dict) -> dict[str, tuple[object, int, str]]:
    """A flat view of a fingerprint: label -> (value, impact, why it matters)."""
    cpu, gpu = fp.get("cpu") or {}, fp.get("gpu") or {}
    view: dict[str, tuple[object, int, str]] = {
        "dtype": (fp.get("dtype"), 3, "kernels and bytes moved per token"),
        "weight format": (fp.get("weights", "native"), 3, "kernels and bytes moved per token"),
        "activations": (fp.get("activations"), 3, "quantized activations: numbers and speed"),
        "linear kernels": (_kernel_choice(fp.get("kernels")), 2, "matmul kernel per weight shape and row count"),
        "compiled steps": (fp.get("compiled"), 3, "compiled or eager decode/verify steps"),
        "device": (fp.get("device"), 3, "different hardware"),
        "torch threads": (fp.get("threads"), 3, "intra-op parallelism"),
        "tensor parallel size": (fp.get("tensor_parallel", 1), 3, "ranks sharing each layer (all-reduce per layer)"),
        "torch interop threads": (fp.get("interop_threads"), 1, "inter-op pool"),
        "CPU model": (cpu.get("model"), 3, "different hardware"),
        "CPU flags": (cpu.get("flags"), 2, "vector/matrix instructions available"),
        "cores available (affinity)": (cpu.get("affinity_count"), 3, "cores this process may use"),
        "CPU affinity": (cpu.get("affinity"), 1, "which cores"),
        "frequency governor": (cpu.get("governor"), 2, "clock policy"),
        "GPU": (gpu.get("devices"), 3, "different hardware"),
        "GPU driver/clocks": (gpu.get("nvidia_smi"), 2, "driver and clocks"),
        "GPU topology": (gpu.get("topology"), 2, "interconnect between GPUs"),
        "torch version": ((fp.get("versions") or {}).get("torch"), 2, "kernels"),
        "torch CPU capability": ((fp.get("torch_config") or {}).get("cpu_capability"), 2, "kernel dispatch"),
        "model file": ((fp.get("model") or {}).get("sha256"), 3, "different weights"),
        "drafter file": ((fp.get("drafter") or {}).get("sha256"), 3, "different drafter: acceptance"),
        "drafter weights": ((fp.get("drafter") or {}).get("weights"), 3, "drafter format: draft cost, acceptance"),
        "launch profile": ((fp.get("launch_profile") or {}).get("name"), 1, "named environment"),
        "graph build running": (bool(fp.get("graph_build_running")), 3,
                                "a background build of compiled graphs shares the cores, caches and memory bandwidth"),
        "project commit": (fp.get("git_commit"), 2, "code changed"),
        "hostname": (fp.get("hostname"), 1, "different machine"),
        "python version": ((fp.get("versions") or {}).get("python"), 1, "interpreter overhead"),
    }
    for lib, v in (fp.get("versions") or {}).items():
        if lib not in ("torch", "python"):
            view[f"{lib} version"] = (v, 1, "library")
    for k, v in (fp.get("env") or {}).items():
        impact = 3 if HIGH_IMPACT_ENV.match(k) else 0 if INFO_ENV.match(k) else 2
        view[k] = (v, impact, "environment variable")
    return view


def diff(a: dict, b: dict) -> list[Difference]:
    """Differences from fingerprint ``a`` to ``b``, most likely to matter first.
    Load average is compared by magnitude: a busy machine matters, 0.1 vs 0.3 does not."""
    va, vb = comparable(a), comparable(b)
    out = []
    for label in va.keys() | vb.keys():
        (x, ia, why), (y, ib, _) = va.get(label, (None, 0, "")), vb.get(label, (None, 0, ""))
        if x != y:
            out.append(Difference(label, x, y, max(ia, ib), why or _))
    la, lb = (a.get("cpu") or {}).get("loadavg_1m"), (b.get("cpu") or {}).get("loadavg_1m")
    cores = max((a.get("cpu") or {}).get("affinity_count") or 1, 1)
    if la is not None and lb is not None and abs(la - lb) >= max(0.5, 0.25 * cores):
        out.append(Difference("load average (1 min)", la, lb, 2, "background load competes for cores"))
    return sorted(out, key=lambda d: (-d.impact, d.label))


def performance_relevant(diffs: list[Difference], min_impact: int = 2) -> list[Difference]:
    return [d for d in diffs if d.impact >= min_impact]


def interpreter_versions(python: str | None, distributions: Sequence[str]) -> dict[str, str | None]:
    """What another interpreter (an engine's own environment; None: ours) runs with: the first of
    ``distributions`` it has, torch, transformers and Python; ``{}`` where it cannot be asked."""
    probe = ("import importlib.metadata as m, json, sys\n"
             "def v(*names):\n"
             "    for n in names:\n"
             "        try:\n"
             "            return n + ' ' + m.version(n)\n"
             "        except m.PackageNotFoundError:\n"
             "            pass\n"
             f"print(json.dumps({{'engine': v(*{list(distributions)!r}), 'torch': v('torch'), "
             "'transformers': v('transformers'), 'python': sys.version.split()[0], 'executable': sys.executable}))")
    try:
        proc = subprocess.run([python or sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return dict(json.loads(proc.stdout.strip().splitlines()[-1])) if proc.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}

