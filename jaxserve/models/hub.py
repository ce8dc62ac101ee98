"""Where a model's files come from: a local checkpoint folder, or a Hugging Face hub id resolved to
a snapshot folder in the hub cache.

A name that is an existing folder, or a ``.gguf`` file (its config and tokenizer are in its
metadata, :mod:`jaxserve.models.gguf_loader`), is used as it is. Anything else that is a valid repo id
(``Qwen/Qwen3-0.6B``) goes through ``huggingface_hub.snapshot_download``, which downloads what is
missing into the hub cache (or, with ``HF_HUB_OFFLINE``, only looks there) and returns the
snapshot folder of the revision. Only configuration, tokenizer files, chat templates and
safetensors weights are fetched: never pickle checkpoints (``*.bin``), never code (``*.py``); the
one exception, asked for by ``state_dict_bin`` (EAGLE heads), is a ``pytorch_model.bin`` when the
repo has no safetensors, read by :mod:`jaxserve.models.torch_pickle` without running the pickle.
Every failure is a one-line ``ConfigError`` that says what to do.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from jaxserve import envs
from jaxserve.exceptions import ConfigError
from jaxserve.models.gguf_loader import is_gguf
from jaxserve.models.safetensors_io import check_weights
from jaxserve.models.torch_pickle import PYTORCH_BIN

logger = logging.getLogger("jaxserve")

# Files a checkpoint is served from, besides its weights. Tokenizers come in several formats;
# fetching the few small files of all of them costs less than guessing the right one.
CONFIG_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "*.tiktoken",
    "chat_template.jinja", "chat_template.json",
)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model's files on this machine and what the user named.

    ``path`` holds ``config.json`` (for a model) and the tokenizer files; ``root`` is the folder
    (absolute) or the hub id, reported as the model's ``root`` by ``/v1/models``; ``revision``
    is the hub commit served (None for a folder)."""

    path: Path
    root: str
    revision: str | None = None
    served_name: str | None = None  # the name served when the user named no model (a demo)


def resolve_model(name: str, *, revision: str | None = None, download_dir: str | None = None,
                  weights: bool = True, state_dict_bin: bool = False) -> ModelSource:
    """The folder to load ``name`` from: itself when it is a folder, else the hub snapshot of
    ``name`` at ``revision`` under ``download_dir`` (default: the hub cache). With ``weights``
    False (a tokenizer) only configuration and tokenizer files are needed; with ``state_dict_bin``
    a ``pytorch_model.bin`` serves as the weights when there are no safetensors."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            logger.warning("--revision %s applies to hub ids; %s is a local folder, served as it is", revision, name)
        source = ModelSource(folder.resolve(), str(folder.resolve()))
    elif folder.is_file() and is_gguf(folder):  # vLLM's single-file form: config and tokenizer inside
        return ModelSource(folder.resolve(), str(folder.resolve()))
    elif folder.exists():
        raise ConfigError(f"model: {name} is a file; expected a checkpoint folder, a .gguf file or a hub id")
    elif _is_repo_id(name):
        source = _snapshot(name, revision, download_dir, weights)
        if weights and state_dict_bin and not any(source.path.glob("*.safetensors")):
            source = _snapshot(name, revision, download_dir, weights, extra=(PYTORCH_BIN,))
    else:
        raise ConfigError(f"model: no such folder: {name}")
    if weights and not (state_dict_bin and (source.path / PYTORCH_BIN).is_file()):
        _check_checkpoint(source)
    return source


def _is_repo_id(name: str) -> bool:
    """``name`` or ``org/name`` in the characters the hub allows (a path-like name is not one)."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, weights: bool,
              extra: tuple[str, ...] = ()) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(download_dir).expanduser() if download_dir else envs.hf_hub_cache()
    offline = envs.hf_hub_offline()
    patterns = list(CONFIG_PATTERNS) + (list(WEIGHT_PATTERNS) if weights else []) + list(extra)
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
                                 local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        raise ConfigError(_not_cached_message(repo_id, revision, cache, offline, exc)) from exc
    except RevisionNotFoundError as exc:
        raise ConfigError(f"model: {repo_id} has no revision {revision!r} on the hub") from exc
    except GatedRepoError as exc:
        raise ConfigError(f"model: {repo_id} is gated on the hub: accept its terms there and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise ConfigError(f"model: {repo_id} is neither a local folder nor a model on the hub "
                          "(a private one needs HF_TOKEN)") from exc
    except HfHubHTTPError as exc:
        raise ConfigError(f"model: the hub refused {repo_id}: {_first_line(exc)}") from exc
    folder = Path(path)
    logger.info("model %s: revision %s from %s", repo_id, folder.name, folder)
    return ModelSource(folder, repo_id, folder.name)


def _not_cached_message(repo_id: str, revision: str | None, cache: Path, offline: bool,
                        exc: Exception) -> str:
    from huggingface_hub import errors

    incomplete = getattr(errors, "IncompleteSnapshotError", None)  # huggingface_hub >= 1.x checks snapshots
    if incomplete is not None and isinstance(exc, incomplete):
        return f"model: {_first_line(exc)}"
    what = f"revision {revision!r} of {repo_id}" if revision else repo_id
    repo_folder = cache / ("models--" + repo_id.replace("/", "--"))
    if repo_folder.is_dir() and revision:
        cached = sorted(p.name for p in (repo_folder / "refs").glob("*")) + sorted(
            p.name[:12] for p in (repo_folder / "snapshots").glob("*"))
        where = f"the hub cache {cache} (it holds {', '.join(cached) or 'no revision'} of {repo_id})"
    else:
        where = f"the hub cache {cache}"
    if offline:
        return (f"model: {what} is not in {where}, and HF_HUB_OFFLINE is set: download it first "
                "(unset HF_HUB_OFFLINE), or pass a local folder")
    return f"model: cannot reach the hub for {what}, and it is not in {where}: {_first_line(exc.__cause__ or exc)}"


def _check_checkpoint(source: ModelSource) -> None:
    if not (source.path / "config.json").is_file():
        raise ConfigError(f"model: no config.json in {source.root}; a Hugging Face checkpoint folder needs one")
    try:
        check_weights(source.path)
    except ConfigError as exc:
        if source.revision is None:
            raise
        # The snapshot never holds pickle files when they were only on the hub: say why.
        raise ConfigError(f"model: {source.root} (revision {source.revision[:12]}) has no *.safetensors "
                          "weights; jaxserve never loads pickle (*.bin) checkpoints") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
